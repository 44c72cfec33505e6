"""Read every rank's flight-recorder sequence numbers after a hang, through torch's worker server.

On NCCL a stack does not say who hangs (:func:`~robust_plugins.watchdog.detect.in_collective`):
the host returns from a collective at launch. torch counts, per process group, the collectives a
rank issued and those its device started (the flight recorder's ``pg_status``), and its C++
worker server answers ``POST /handler/<name>`` (:data:`HANDLERS`) on a Unix socket from its own
thread, so the numbers come back while the rank's Python thread is blocked in a collective, a
``.item()`` or a ``synchronize`` (checked on torch 2.13 over gloo: 2 ms with the main thread inside an
``all_reduce``). At its first step the rank's watchdog client starts the server where the
default group is NCCL (:func:`serve_if_needed`; on gloo stacks suffice, and torch logs three
lines per server), at a path the monitor derives from the rank and its pid
(:func:`socket_path`); the monitor reads it (:func:`collect`) and localizes by sequence first
(:func:`~robust_plugins.watchdog.detect.localize_by_sequence`). A torch without the worker
server, or a rank that cannot bind its socket, leaves the monitor with stacks alone (logged).
``ROBUST_WATCHDOG_NO_FLIGHT=1`` starts no server (the socket also answers stack dumps to anyone
who may open it: its folder's permissions decide).
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Mapping

from robust_plugins._logging import get_logger

log = get_logger(__name__)

#: AF_UNIX socket paths are at most 107 bytes on Linux; a longer run directory uses the temp dir.
_MAX_SOCKET_PATH = 100

#: The worker server answers from C++ in milliseconds; a loaded machine gets 2 s a rank.
FETCH_TIMEOUT_S = 2.0

ENV_NO_FLIGHT = "ROBUST_WATCHDOG_NO_FLIGHT"

_servers: list[Any] = []  # kept alive for the process's life (the server stops when collected)


def socket_path(run_dir: str | os.PathLike | None, rank: int, pid: int | None = None) -> str:
    """Where rank ``rank`` (process ``pid``, default this one) serves its flight recorder."""
    pid = os.getpid() if pid is None else pid
    if run_dir:
        path = str(Path(run_dir) / "stacks" / f"fr-rank{rank}-pid{pid}.sock")
        if len(path) <= _MAX_SOCKET_PATH:
            return path
    return os.path.join(tempfile.gettempdir(), f"robust-fr-rank{rank}-pid{pid}.sock")


def serve(run_dir: str | os.PathLike | None, rank: int) -> str | None:
    """Start torch's worker server for this rank; its socket path, or None (why is logged)."""
    if os.environ.get(ENV_NO_FLIGHT) == "1":
        return None
    try:
        from torch._C._distributed_c10d import _WorkerServer
    except ImportError as exc:
        log.warning("robust watchdog: this torch has no worker server (%s): hang localization on NCCL "
                    "falls back to stacks, which cannot tell a waiting rank from a stuck one.", exc)
        return None
    path = socket_path(run_dir, rank)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)  # a dead process with our pid left it
        server = _WorkerServer(path)
    except (OSError, RuntimeError) as exc:
        log.warning("robust watchdog: rank %d cannot serve its flight recorder at %s (%s): hang "
                    "localization falls back to stacks.", rank, path, exc)
        return None
    _servers.append(server)
    atexit.register(server.shutdown)  # else torch warns "destructor called without shutdown"
    return path


def serve_if_needed(run_dir: str | os.PathLike | None, rank: int) -> str | None:
    """:func:`serve` where the default process group's collectives move CUDA tensors (NCCL), whose
    hangs stacks cannot localize; None elsewhere."""
    import torch.distributed as dist

    from robust_plugins.device import device_type_for_backend

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if device_type_for_backend(dist.get_backend()) == "cpu":
        return None
    return serve(run_dir, rank)


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


#: The worker server's flight-recorder handlers: NCCL's own recorder (CUDA builds), then the one
#: every other backend (gloo) writes; a build without one answers 404 for it.
HANDLERS = ("dump_nccl_trace_json?onlyactive=true", "fr_trace_json?onlyactive=true")


def _post(path: str, handler: str, timeout: float) -> dict[str, Any] | None:
    conn = _UnixHTTP(path, timeout)
    try:
        conn.request("POST", f"/handler/{handler}")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            return None
        status = json.loads(body).get("pg_status")
        return status if isinstance(status, dict) else None
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def fetch(path: str, timeout: float = FETCH_TIMEOUT_S) -> dict[str, dict[str, Any]] | None:
    """One rank's ``pg_status`` (process group -> its counters) from every recorder it has (NCCL's
    and gloo's groups together), or None if nothing answered."""
    merged: dict[str, dict[str, Any]] = {}
    answered = False
    for handler in HANDLERS:
        status = _post(path, handler, timeout)
        if status is not None:
            answered = True
            merged.update(status)
    return merged if answered else None


def collect(paths: Mapping[int, str | None], timeout: float = FETCH_TIMEOUT_S) -> dict[int, Any]:
    """Every rank's ``pg_status`` by rank (None where it has no server or did not answer)."""
    return {r: fetch(p, timeout) if p else None for r, p in paths.items()}


def served_paths(run_dir: str | os.PathLike, pids: Mapping[int, int]) -> dict[int, str]:
    """The sockets of the ranks (rank -> pid) that serve one now; empty where none does."""
    paths = {r: socket_path(run_dir, r, pid) for r, pid in pids.items()}
    return {r: p for r, p in paths.items() if os.path.exists(p)}

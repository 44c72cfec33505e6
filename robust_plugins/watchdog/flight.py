"""Read every rank's flight recorder after a hang, through torch's worker server.

On NCCL a stack does not say who hangs (:func:`~robust_plugins.watchdog.detect.in_collective`):
the host returns from a collective at launch, and a healthy rank waiting for a peer sits in
``.item()`` or a ``synchronize``. torch's flight recorder keeps, per process group, the
sequence number of every collective a rank issued and its state on the device, and its C++
worker server answers ``POST /handler/<name>`` (:data:`HANDLERS`) on a Unix socket from its own
thread, so the records come back while the rank's Python thread is blocked. At its first step
the rank's watchdog client starts the server where the default group is NCCL
(:func:`serve_if_needed`; on gloo a collective blocks the host and stacks suffice), at a path the
monitor derives from the rank and its pid (:func:`socket_path`). ``robust run`` sizes the
recorder's ring (:func:`recorder_env`; torch records nothing by default). After a hang the
monitor reads every local rank (:func:`collect`), keeps the dumps as evidence, reduces them to
per-group progress (:func:`views`), and the agents of a multi-node job exchange those views
(:mod:`.nodes`) so that the verdict (:func:`~robust_plugins.watchdog.detect.localize_by_sequence`)
compares every rank of every group, not one node's. A torch without the worker server, or a rank
that cannot bind its socket, leaves the monitor with stacks alone (logged), and on NCCL then no
node is blamed. ``ROBUST_WATCHDOG_NO_FLIGHT=1`` starts no server (the socket also answers stack
dumps to anyone who may open it: its folder's permissions decide); ``ROBUST_WATCHDOG_FLIGHT_ALWAYS=1``
starts one on gloo too.
"""
from __future__ import annotations

import atexit
import dataclasses
import http.client
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Mapping

from robust_plugins._logging import get_logger
from robust_plugins.watchdog.detect import GroupSeq, group_view

log = get_logger(__name__)

#: AF_UNIX socket paths are at most 107 bytes on Linux; a longer run directory uses the temp dir.
_MAX_SOCKET_PATH = 100

#: The worker server answers from C++ in milliseconds; a loaded machine gets 2 s a rank.
FETCH_TIMEOUT_S = 2.0

ENV_NO_FLIGHT = "ROBUST_WATCHDOG_NO_FLIGHT"
#: ``1``: serve the flight recorder on every backend, gloo too (where stacks also tell who hangs).
ENV_FLIGHT_ALWAYS = "ROBUST_WATCHDOG_FLIGHT_ALWAYS"

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


def collective_device_type() -> str | None:
    """The device type the default process group's collectives move (``cpu`` for gloo, ``cuda``
    for NCCL), or None without an initialized process group."""
    import torch.distributed as dist

    from robust_plugins.device import device_type_for_backend

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return device_type_for_backend(dist.get_backend())


def serve_if_needed(run_dir: str | os.PathLike | None, rank: int) -> str | None:
    """:func:`serve` where the default process group's collectives move device tensors (NCCL),
    whose hangs stacks cannot localize (or everywhere with ``ROBUST_WATCHDOG_FLIGHT_ALWAYS=1``);
    None elsewhere."""
    kind = collective_device_type()
    if kind is None or (kind == "cpu" and os.environ.get(ENV_FLIGHT_ALWAYS) != "1"):
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


#: The worker server's flight-recorder handlers, by label: NCCL's own recorder (CUDA builds), then
#: the one every other backend (gloo) writes; a build without one answers 404 for it. The whole
#: ring (``onlyactive=false``): the newest record of every group names it and its sequence
#: numbers (:func:`~robust_plugins.watchdog.detect.group_view`), completed or not.
HANDLERS = {"nccl": "dump_nccl_trace_json?includecollectives=true&onlyactive=false",
            "gloo": "fr_trace_json?includecollectives=true&onlyactive=false"}

#: Variables a rank needs for its flight recorder to record anything (torch's default ring is 0
#: entries, which leaves ``pg_status`` and the entries empty), and the value ``robust run`` sets
#: when the user set neither name. torch 2.4-2.5 read only ``TORCH_NCCL_TRACE_BUFFER_SIZE``;
#: newer ones read ``TORCH_FR_BUFFER_SIZE`` first, then the old name. 2,000 records is torch's
#: documented example; a record holds sizes and names, no tensor.
BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
BUFFER_DEFAULT = "2000"


def recorder_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What ``robust run`` adds to the ranks' environment so that their flight recorder records
    on every torch of the declared range (pure): both names of the ring size, the user's value
    where they set one name (0 included: their choice, said in the log), else the default."""
    chosen = [environ[name] for name in BUFFER_ENV if name in environ]
    value = chosen[0] if chosen else BUFFER_DEFAULT
    return {name: value for name in BUFFER_ENV if name not in environ}


def _post(path: str, handler: str, timeout: float) -> dict[str, Any] | None:
    conn = _UnixHTTP(path, timeout)
    try:
        conn.request("POST", f"/handler/{handler}")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            return None
        dump = json.loads(body)
        return dump if isinstance(dump, dict) else None
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def fetch(path: str, timeout: float = FETCH_TIMEOUT_S) -> dict[str, dict[str, Any]] | None:
    """One rank's flight-recorder dumps by label (:data:`HANDLERS`: NCCL's and gloo's groups are
    counted apart), or None if nothing answered."""
    dumps = {label: d for label, handler in HANDLERS.items() if (d := _post(path, handler, timeout)) is not None}
    return dumps or None


def collect(paths: Mapping[int, str | None], timeout: float = FETCH_TIMEOUT_S) -> dict[int, Any]:
    """Every rank's dumps by rank (None where it has no server or did not answer)."""
    return {r: fetch(p, timeout) if p else None for r, p in paths.items()}


def views(dumps: Mapping[int, Mapping[str, Any] | None]) -> dict[int, dict[str, Any] | None]:
    """Every rank's :func:`~robust_plugins.watchdog.detect.group_view` as plain data (JSON: what
    ``faults.jsonl`` records and the agents exchange), None where unreadable."""
    out: dict[int, dict[str, Any] | None] = {}
    for rank, d in dumps.items():
        out[rank] = None if not d else {k: dataclasses.asdict(g) for k, g in group_view(d).items()}
    return out


def from_json(views_json: Mapping[Any, Mapping[str, Any] | None]) -> dict[int, dict[str, GroupSeq] | None]:
    """:func:`views` read back (rank keys as JSON strings or ints)."""
    out: dict[int, dict[str, GroupSeq] | None] = {}
    for rank, v in views_json.items():
        out[int(rank)] = None if v is None else {
            k: GroupSeq(members=list(g["members"]), enqueued=int(g["enqueued"]), completed=int(g["completed"]),
                        started=int(g.get("started", -1)),
                        pending_p2p=[(str(op), int(peer)) for op, peer in g.get("pending_p2p", [])],
                        pending_unknown_p2p=bool(g.get("pending_unknown_p2p", False)))
            for k, g in v.items()}
    return out


def served_paths(run_dir: str | os.PathLike, pids: Mapping[int, int]) -> dict[int, str]:
    """The sockets of the ranks (rank -> pid) that serve one now; empty where none does."""
    paths = {r: socket_path(run_dir, r, pid) for r, pid in pids.items()}
    return {r: p for r, p in paths.items() if os.path.exists(p)}

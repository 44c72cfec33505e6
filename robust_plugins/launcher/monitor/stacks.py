"""Collect every rank's Python stack after a hang: py-spy first, faulthandler as the fallback.

``py-spy dump --pid`` reads a stuck process from outside (ptrace), even one blocked in C++. When
py-spy is missing or cannot attach (no ptrace permission in a container), the monitor sends the
rank SIGUSR1, which :mod:`faulthandler` (registered by the rank's watchdog client) answers by
writing all threads' stacks to the rank's file under ``<run_dir>/stacks/``.
``ROBUST_WATCHDOG_NO_PYSPY=1`` skips py-spy (to test or force the fallback).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from robust_plugins._logging import get_logger
from robust_plugins.watchdog.detect import Frame, parse_faulthandler, parse_pyspy

log = get_logger(__name__)

#: faulthandler writes from the signal handler within milliseconds; 2 s covers a loaded machine.
FAULTHANDLER_WAIT_S = 2.0


@dataclass
class RankStack:
    """One rank's main-thread stack and where its dump was saved."""

    frames: list[Frame]
    path: str | None
    tool: str
    """``py-spy``, ``faulthandler`` or ``none``."""


def pyspy_path() -> str | None:
    """The py-spy executable (next to this Python first), or None."""
    if os.environ.get("ROBUST_WATCHDOG_NO_PYSPY", "0") not in ("", "0"):
        return None
    local = Path(sys.executable).parent / "py-spy"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("py-spy")


def collect(targets: dict[int, tuple[int, str | None]], out_dir: Path, tag: str,
            timeout_s: float) -> dict[int, RankStack]:
    """Dump the stacks of ``{rank: (pid, faulthandler_file)}`` into ``out_dir``; bounded by timeout_s."""
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    result: dict[int, RankStack] = {}
    spy = pyspy_path()
    if spy:
        procs = {}
        for rank, (pid, _) in targets.items():
            path = out_dir / f"{tag}-rank{rank}.pyspy.txt"
            out = open(path, "wb")
            procs[rank] = (subprocess.Popen([spy, "dump", "--pid", str(pid)], stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), out, path)
        for rank, (proc, out, path) in procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
            out.close()
            frames = parse_pyspy(path.read_text(errors="replace")) if proc.returncode == 0 else []
            if frames:
                result[rank] = RankStack(frames, str(path), "py-spy")
            else:
                log.warning("robust watchdog: py-spy could not read rank %d (exit %s; see %s); "
                            "trying faulthandler.", rank, proc.returncode, path)
    missing = {r: t for r, t in targets.items() if r not in result}
    if missing:
        result.update(_faulthandler(missing, out_dir, tag, deadline))
    return result


def _faulthandler(targets: dict[int, tuple[int, str | None]], out_dir: Path, tag: str,
                  deadline: float) -> dict[int, RankStack]:
    sizes: dict[int, int] = {}
    result: dict[int, RankStack] = {}
    for rank, (pid, fh) in targets.items():
        if not fh:
            result[rank] = RankStack([], None, "none")
            continue
        sizes[rank] = os.path.getsize(fh) if os.path.exists(fh) else 0
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            result[rank] = RankStack([], None, "none")
            sizes.pop(rank)
    wait_until = min(deadline, time.monotonic() + FAULTHANDLER_WAIT_S)
    pending = dict(sizes)
    texts: dict[int, str] = {}
    while pending and time.monotonic() < wait_until:
        time.sleep(0.05)
        for rank in list(pending):
            fh = targets[rank][1]
            if os.path.getsize(fh) > pending[rank]:
                # One more short wait so a dump still being written is read whole.
                time.sleep(0.05)
                with open(fh, "rb") as f:
                    f.seek(pending.pop(rank))
                    texts[rank] = f.read().decode(errors="replace")
    for rank in sizes:
        text = texts.get(rank, "")
        frames = parse_faulthandler(text)
        if not frames:
            log.warning("robust watchdog: no faulthandler dump from rank %d within %.1f s.", rank,
                        FAULTHANDLER_WAIT_S)
            result[rank] = RankStack([], None, "none")
            continue
        path = out_dir / f"{tag}-rank{rank}.faulthandler.txt"
        path.write_text(text)
        result[rank] = RankStack(frames, str(path), "faulthandler")
    return result

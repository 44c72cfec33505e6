"""A JIT-build lock that a killed process cannot leave behind.

torch's C++-extension loader (``torch.utils.cpp_extension.load``, which DeepSpeed calls for every
op it builds on the fly, ``deepspeed_shm_comm`` in every CPU rank's ``deepspeed.initialize``
included) takes a lock file in the build directory even when the op is already built, and holds
it while ninja checks the build. torch's lock (``FileBaton``) is an empty file: a process killed
while holding it (a rank stopped during start-up, which is what a restart does to its peers)
leaves it for good, and every later load, in every later job that shares the directory, waits
forever without a word.

Promised here: the lock file names its holder (``pid host``) from the moment it exists (written
to a temporary file and hard-linked into place, so it is never empty), and a waiter that finds
the holder dead **on this host** removes the lock, says so in a warning naming the file and the
pid, and goes on. Refused: breaking a lock whose holder is alive, on another host (a build
directory on a shared file system) or unknown (an empty lock left by a process without this
patch): that one is waited for as torch does, with a warning after :data:`WARN_AFTER_S` naming
the file to remove if no build is running.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from robust_plugins._logging import get_logger

log = get_logger(__name__)

#: Seconds a waiter waits on a lock it cannot judge before it says which file to remove.
WARN_AFTER_S = 60.0
#: Seconds between looks at the lock (torch's own period).
POLL_S = 0.1

_HOST = socket.gethostname()


def _holder(path: str) -> tuple[int, str] | None:
    """(pid, host) written in the lock file, or None (gone, empty or unreadable)."""
    try:
        with open(path) as f:
            pid, host = f.read().split()
        return int(pid), host
    except (OSError, ValueError):
        return None


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _baton_class(base: type) -> type:
    class HolderBaton(base):  # type: ignore[misc, valid-type]
        """torch's ``FileBaton`` with its holder written in the lock (module docstring)."""

        def try_acquire(self) -> bool:
            tmp = f"{self.lock_file_path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{os.getpid()} {_HOST}\n")
            try:
                os.link(tmp, self.lock_file_path)  # atomic, and never an empty lock
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)

        def wait(self) -> None:
            t0, warned = time.monotonic(), False
            while os.path.exists(self.lock_file_path):
                holder = _holder(self.lock_file_path)
                if holder is not None and holder[1] == _HOST and _dead(holder[0]):
                    try:
                        os.unlink(self.lock_file_path)
                    except FileNotFoundError:
                        pass
                    log.warning("robust_plugins: removed the JIT build lock %s: its holder, pid %d, "
                                "is dead (killed while it loaded the op); the op is loaded as built.",
                                self.lock_file_path, holder[0])
                    return
                if not warned and time.monotonic() - t0 > WARN_AFTER_S:
                    warned = True
                    who = f"pid {holder[0]} on {holder[1]}" if holder else "a process that did not say who"
                    log.warning("robust_plugins: waited %.0f s for the JIT build lock %s, held by %s. If no "
                                "build is running, remove that file.", WARN_AFTER_S, self.lock_file_path, who)
                time.sleep(POLL_S)

        def release(self) -> None:
            # torch's release closes the descriptor try_acquire kept; this one keeps none.
            os.remove(self.lock_file_path)

    return HolderBaton


def install() -> None:
    """Replace the lock class torch's extension loader uses (idempotent)."""
    from torch.utils import cpp_extension

    current: Any = getattr(cpp_extension, "FileBaton", None)
    if current is None:
        log.warning("robust_plugins: torch.utils.cpp_extension has no FileBaton; a rank killed while "
                    "DeepSpeed loads a JIT op may leave a lock that later loads wait on forever.")
        return
    if getattr(current, "__robust_plugins_patch__", False):
        return
    baton = _baton_class(current)
    baton.__robust_plugins_patch__ = True
    baton.__wrapped__ = current
    cpp_extension.FileBaton = baton


def undo() -> None:
    """Put torch's own lock class back."""
    from torch.utils import cpp_extension

    current = getattr(cpp_extension, "FileBaton", None)
    if getattr(current, "__robust_plugins_patch__", False):
        cpp_extension.FileBaton = current.__wrapped__

"""The agent's side of the standby fork server (:mod:`.zygote`): start it, ask it to fork,
and follow the children it forks, which are the agent's grandchildren.

The agent cannot ``waitpid`` a grandchild, so each forked standby is a :class:`ForkedProc`, a
``subprocess.Popen`` look-alike (``pid``, ``poll``, ``wait``, ``returncode``, ``kill``) that
torch's ``SubprocessContext`` can drive once the standby is a rank. It watches the child through a
pidfd (sent by the zygote while the child was still unreaped, so it is surely that process) and
takes the exit code from, in order: the zygote's ``exit`` message; the child's own
``/proc/PID/stat`` while it is a zombie (the zygote stopped, so nobody reaped it); -SIGKILL when the
zygote is dead (its death SIGKILLs its children) or has not said within :data:`EXIT_REPORT_S`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

from robust_plugins._logging import get_logger
from robust_plugins.launcher.standby import worker as _worker
from robust_plugins.launcher.standby import zygote as _zygote

log = get_logger(__name__)

#: Seconds a child may be seen dead without its exit code before it counts as killed. The zygote
#: reports within milliseconds (SIGCHLD wakes it); only a zygote that stopped after reaping the
#: child and before writing would leave the agent waiting forever.
EXIT_REPORT_S = 5.0


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def zombie_exitcode(pid: int, pidfd: int) -> int | None:
    """The exit code of ``pid`` while it is an unreaped zombie, else None (field 52 of
    /proc/PID/stat, Linux >= 3.5; the pidfd proves the pid was not reused meanwhile)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        if fields[0] != "Z":
            return None
        status = int(fields[49])
        signal.pidfd_send_signal(pidfd, 0)  # raises once the process is reaped
        return os.waitstatus_to_exitcode(status)
    except (OSError, IndexError, ValueError):
        return None


class ForkedProc:
    """A standby forked by a :class:`Zygote` (see the module docstring). ``pid`` is None until the
    zygote forked it."""

    def __init__(self, zygote: Zygote, fid: int) -> None:
        self.zygote = zygote
        self.id = fid
        self.pid: int | None = None
        self.pidfd: int | None = None
        self.returncode: int | None = None
        self.served = False
        """Handed a rank: its zygote must outlive it."""
        self._dead_since: float | None = None

    def _settle(self, code: int) -> None:
        self.returncode = code
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def poll(self) -> int | None:
        """The exit code, or None while it runs (or waits to be forked)."""
        if self.returncode is not None:
            return self.returncode
        self.zygote.pump()
        if self.returncode is not None:
            return self.returncode
        if self.pidfd is None:  # never forked
            if not self.zygote.alive():
                self._settle(-signal.SIGKILL)
            return self.returncode
        if not _readable(self.pidfd):
            return None
        code = zombie_exitcode(self.pid, self.pidfd)
        now = time.monotonic()
        self._dead_since = self._dead_since or now
        if code is None and (not self.zygote.alive() or now - self._dead_since > EXIT_REPORT_S):
            log.warning("robust run: standby %d ended and its fork server %d did not report how; "
                        "counted as killed", self.pid, self.zygote.pid)
            code = -signal.SIGKILL
        if code is not None:
            self._settle(code)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"standby {self.pid}", timeout)
            if self.pidfd is not None and not _readable(self.pidfd):
                select.select([self.pidfd], [], [], 0.05)
            else:
                time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the process (through its pidfd: never a reused pid)."""
        if self.pidfd is not None and self.returncode is None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL it; one not forked yet never will run (the zygote's fork is killed on arrival)."""
        if self.pid is None and self.returncode is None:
            self._settle(-signal.SIGKILL)
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One fork server process, spawned from the agent's main thread (see :mod:`.zygote`)."""

    def __init__(self, env: dict[str, str], cwd: str, modules: list[str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zenv = {**env, _zygote.ENV_SOCKET_FD: str(theirs.fileno()), _worker.ENV_PARENT: str(os.getpid()),
                _worker.ENV_PREIMPORT: ",".join(modules)}
        zenv.setdefault(_zygote.NVML_CHECK, "1")  # the job's own value, if any, is kept
        try:
            self.proc = subprocess.Popen([sys.executable, "-u", "-m", _zygote.__name__], env=zenv, cwd=cwd,
                                         pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self.env = env
        """The environment it imported under, less the variables that are ours."""
        self.spawned = time.monotonic()
        self.ready: dict | None = None
        self.pinged: float | None = None
        self.answered = 0.0
        self.news: list[dict] = []
        """``ready``, ``refused`` and ``unsafe`` messages not yet taken by the pool."""
        self.children: dict[int, ForkedProc] = {}
        self._by_pid: dict[int, ForkedProc] = {}
        self._eof = False

    @property
    def pid(self) -> int:
        """The zygote's pid."""
        return self.proc.pid

    def alive(self) -> bool:
        """True while the zygote process runs."""
        return self.proc.poll() is None

    def fork(self, status_w: int, handoff_r: int) -> ForkedProc:
        """Ask for a standby with these pipe ends (the caller closes its copies)."""
        child = ForkedProc(self, len(self.children))
        socket.send_fds(self.sock, [json.dumps({"k": "fork", "id": child.id}).encode()], [status_w, handoff_r])
        self.children[child.id] = child
        return child

    def ping(self) -> None:
        """Ask for a ``pong`` (a liveness check); raises OSError if the zygote is gone."""
        self.sock.send(b'{"k": "ping"}')
        self.pinged = time.monotonic()

    def pump(self) -> None:
        """Read what the zygote said, without blocking."""
        reset = False
        while not self._eof:
            try:
                got = _zygote.receive(self.sock, 1)
            except ConnectionResetError:
                # A zygote that exits with our fork request unread (it found forking unsafe)
                # resets the socket: Linux reports that once, before the messages it sent last
                # ("unsafe" among them). Read on: taking it for the end lost them, and the pool
                # took a refusal for a death (no standby at all, seen in CI).
                if not reset:
                    reset = True
                    continue
                got = (b"", [])
            except OSError:
                got = (b"", [])
            if got is None:
                return
            data, fds = got
            if not data:
                self._eof = True
                return
            msg = json.loads(data)
            k = msg.get("k")
            if k == "forked":
                child = self.children[msg["id"]]
                child.pid = msg["pid"]
                if child.returncode is not None:  # killed before it was forked: never runs
                    signal.pidfd_send_signal(fds[0], signal.SIGKILL)
                    os.close(fds[0])
                else:
                    child.pidfd = fds[0]
                    self._by_pid[child.pid] = child
                continue
            for fd in fds:
                os.close(fd)
            if k == "exit" and msg["pid"] in self._by_pid:
                child = self._by_pid.pop(msg["pid"])
                if child.returncode is None:
                    child._settle(msg["code"])
            elif k == "pong":
                self.pinged, self.answered = None, time.monotonic()
            elif k in ("ready", "refused", "unsafe"):
                if k == "ready":
                    self.ready, self.answered = msg, time.monotonic()
                self.news.append(msg)

    def live_served(self) -> list[ForkedProc]:
        """Its children that were handed a rank and still run."""
        return [c for c in self.children.values() if c.served and c.poll() is None]

    def stop(self) -> int | None:
        """SIGKILL the zygote (its unused children die with it); its exit code."""
        if self.alive():
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        finally:
            self.sock.close()
            self._eof = True
        return self.proc.returncode

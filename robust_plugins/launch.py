"""Start a multi-process job under ``torchrun`` with a hard, whole-process-group timeout.

Tests, ``robust demo`` and ``robust bench`` all launch through :func:`run_torchrun`, so every
multi-process run on these machines is bounded: the job runs in its own session (process group),
and a timeout, a Ctrl-C or any exception in the caller kills the whole group (torchrun *and* every
rank), SIGTERM first, SIGKILL after a grace period. A hung gloo collective therefore cannot outlive
the command that started it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence, Union

from robust_plugins.errors import RobustPluginsError

#: Seconds between SIGTERM and SIGKILL when tearing a job down.
KILL_GRACE_S = 10.0

#: Lines of the job's log quoted in a failure message.
LOG_TAIL_LINES = 60


class LaunchError(RobustPluginsError):
    """A launched job failed (non-zero exit) or timed out; the message quotes its log tail."""

    def __init__(self, message: str, result: "LaunchResult | None" = None) -> None:
        super().__init__(message)
        self.result = result


class LaunchTimeout(LaunchError):
    """A launched job ran past its timeout and was killed (whole process group)."""


@dataclass
class LaunchResult:
    """What :func:`run_torchrun` returns; shaped like :class:`subprocess.CompletedProcess`."""

    args: list[str]
    """The full command line."""

    returncode: int
    """torchrun's exit status (non-zero if any rank failed); -9 / -15 when we killed it."""

    log_path: Path
    """File holding the job's combined stdout and stderr (each line prefixed with its rank)."""

    wall_s: float
    """Seconds from start to exit."""

    timed_out: bool = False
    """True when the job was killed for running past its timeout."""

    @property
    def stdout(self) -> str:
        """The whole log (stdout and stderr are merged into one file)."""
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.stdout.splitlines()[-lines:])

    def first_traceback(self, max_lines: int = 40) -> str:
        """The first Python traceback any rank printed (the root cause, usually), or ''."""
        return first_traceback(self.stdout, max_lines)

    def check_returncode(self) -> None:
        """Raise :class:`LaunchError` (or :class:`LaunchTimeout`) if the job did not succeed."""
        if self.timed_out:
            raise LaunchTimeout(
                f"Job timed out after {self.wall_s:.0f} s and was killed (whole process group): "
                f"{' '.join(self.args)}\nLog: {self.log_path}\n--- last lines ---\n{self.tail()}",
                self,
            )
        if self.returncode != 0:
            # torchrun's own summary fills the log's tail; the rank's traceback says what went wrong.
            cause = self.first_traceback()
            cause = f"--- first traceback ---\n{cause}\n" if cause else ""
            # A rank killed by a signal (an abort: exit -6) prints no traceback; its own last
            # lines say how far it got, which torchrun's summary at the log's end does not.
            last = rank_tails(self.stdout)
            last = f"--- each rank's last lines ---\n{last}\n" if last else ""
            raise LaunchError(
                f"Job failed with exit status {self.returncode}: {' '.join(self.args)}\n"
                f"Log: {self.log_path}\n{cause}{last}--- last lines ---\n{self.tail(20)}",
                self,
            )


def first_traceback(log_text: str, max_lines: int = 40) -> str:
    """Cut the first ``Traceback`` block (one rank's lines only) out of a rank-prefixed log."""
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        pos = line.find("Traceback (most recent call last)")
        if pos < 0:
            continue
        prefix = line[:pos]
        block = [ln for ln in lines[i:] if ln.startswith(prefix)]
        # The block ends at the first line that is not indented (the exception line itself).
        for j, ln in enumerate(block[1:], start=1):
            if not ln[len(prefix):].startswith(" "):
                block = block[: j + 1]
                break
        return "\n".join(block[-max_lines:])
    return ""


_RANK_PREFIX = re.compile(r"\[default\d+\]:")


def rank_tails(log_text: str, lines: int = 6) -> str:
    """The last ``lines`` lines of each rank in a log of torchrun's ``--tee`` (``[defaultN]:``)."""
    by_rank: dict[str, list[str]] = {}
    for line in log_text.splitlines():
        m = _RANK_PREFIX.match(line)
        if m:
            by_rank.setdefault(m.group(0), []).append(line)
    order = sorted(by_rank, key=lambda prefix: int(prefix[len("[default"):-2]))  # rank 2 before 10
    return "\n".join(ln for prefix in order for ln in by_rank[prefix][-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(
    module_or_script: str, args: Sequence[str], nproc: int, port: int, python: str = sys.executable
) -> list[str]:
    """The command line: ``python -m torch.distributed.run`` on one node, explicit port on 127.0.0.1.

    ``module_or_script`` ending in ``.py`` (or naming an existing file) runs as a script; anything
    else runs as ``-m module``. ``--tee 3`` copies every rank's output to our log with a rank prefix.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}.")
    cmd = [
        python, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(port),
        "--tee", "3",
    ]
    if module_or_script.endswith(".py") or Path(module_or_script).is_file():
        cmd.append(module_or_script)
    else:
        cmd += ["-m", module_or_script]
    return cmd + [str(a) for a in args]


def launch_env(base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for the job: the caller's, plus CPU-friendly settings, plus ``extra``.

    ``OMP_NUM_THREADS=1``: several ranks share few cores; more threads a rank only oversubscribe.
    ``TORCH_EXTENSIONS_DIR`` defaults to ``<venv>/torch_extensions`` (where ``make install`` built
    DeepSpeed's CPU comm op) so ranks load the cached build instead of compiling it again.
    """
    env = dict(os.environ if base is None else base)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def _proc_start(pid: int) -> str | None:
    """Start time of ``pid`` (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces: split after its closing parenthesis.
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> list[tuple[int, str]]:
    """``(pid, start time)`` of every living descendant of ``root`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            start = _proc_start(child)
            if start is not None:
                found.append((child, start))
                todo.append(child)
    return found


def _kill_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    # torchrun leads the job's session, but the elastic agent starts every rank in a session of
    # its own (start_new_session=True), so killing torchrun's group reaches only torchrun. It
    # SIGTERMs its ranks when it gets SIGTERM; a rank that ignores SIGTERM would outlive a
    # SIGKILLed torchrun, re-parented and out of reach. So note every descendant first and
    # SIGKILL whichever of them is still the same process at the end.
    family = _descendants(proc.pid) if proc.poll() is None else []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # torchrun exited; ranks it failed to reap may still be in the group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    for pid, start in family:
        # Same pid and start time: still the process we noted, not a reused pid.
        if _proc_start(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_torchrun(
    module_or_script: str,
    args: Sequence[str] = (),
    nproc: int = 2,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike | None = None,
    check: bool = True,
    echo: Union[bool, Callable[[str], bool]] = False,
) -> LaunchResult:
    """Run ``module_or_script`` on ``nproc`` local ranks under torchrun; bounded by ``timeout_s``.

    ``env`` adds to (and overrides) the caller's environment. Output goes to ``log_path`` (a new
    temporary file when None); ``echo=True`` also streams it to this process's stdout, and a
    predicate ``echo(line) -> bool`` streams only the lines it accepts. With
    ``check=True`` (default) a failure or timeout raises :class:`LaunchError` quoting the log's
    tail; otherwise the result carries ``returncode`` and ``timed_out``.
    """
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="robust-launch-", suffix=".log")
        os.close(fd)
        log = Path(name)
    else:
        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(module_or_script, args, nproc, free_port())
    t0 = time.monotonic()
    timed_out = False
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=launch_env(extra=env), start_new_session=True,
        )
        try:
            if echo:
                accept = echo if callable(echo) else (lambda line: True)
                timed_out = _follow(proc, log, t0 + timeout_s, accept)
            else:
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            # Always, including KeyboardInterrupt: never leave ranks behind. A no-op when the
            # group has already exited.
            _kill_group(proc)
    result = LaunchResult(cmd, proc.returncode, log, time.monotonic() - t0, timed_out)
    if check:
        result.check_returncode()
    return result


def _follow(proc: subprocess.Popen, log: Path, deadline: float, accept: Callable[[str], bool]) -> bool:
    """Copy accepted log lines to stdout until the job exits; True if ``deadline`` passed first."""
    def emit(buf: bytes, final: bool) -> bytes:
        lines = buf.split(b"\n")
        rest = b"" if final else lines.pop()  # keep a partial last line for the next read
        for raw in lines:
            line = raw.decode(errors="replace")
            if line and accept(line):
                print(line, flush=True)
        return rest

    pending = b""
    with open(log, "rb") as src:
        while True:
            pending = emit(pending + src.read(), final=False)
            if proc.poll() is not None:
                emit(pending + src.read(), final=True)
                return False
            if time.monotonic() > deadline:
                return True
            time.sleep(0.2)

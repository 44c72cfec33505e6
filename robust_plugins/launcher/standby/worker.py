"""A warm standby rank of ``robust run``: a process that imported the job's libraries and becomes
a rank when the agent hands it one.

A standby is either forked from the node's fork server (:mod:`.zygote`, the default: one
import per node) or, where that server found forking unsafe, spawned by the agent
(:mod:`.pool`) as ``python -u -m robust_plugins.launcher.standby.worker``, which imports by
itself (:func:`main`). Either way :func:`become_rank` runs in it, with two pipes: it writes one
JSON line per event to the agent (``ready``, ``pong``, ``go``, ``refused``) and reads JSON lines
from it (``ping`` while it waits, then the hand-off: argv, environment, working directory, output
files). Then it runs the user's script as ``python -u script.py ...`` or ``python -u -m module
...`` would: a fresh ``__main__`` module with the same ``__file__``, ``__spec__``, ``__loader__``,
``sys.argv`` and ``sys.path[0]``.

What it must not do before the hand-off (why it is safe on GPUs): create a CUDA context. It
imports only libraries (never the user's script or its own modules), and before it says
``ready`` it checks ``torch.cuda.is_initialized()`` is False; otherwise it refuses and exits, and
the agent starts that rank cold. A spawned standby is a fresh interpreter (``subprocess``), never
a fork of the agent: nothing of the agent's threads, sockets or CUDA state is inherited; where a
forked one is safe and why: :mod:`.zygote`.
"""

from __future__ import annotations

import builtins
import ctypes
import importlib
import io
import json
import os
import signal
import sys
import time
import types

#: Variables the agent sets for a standby only (removed before the user's script runs).
ENV_STATUS_FD = "ROBUST_STANDBY_STATUS_FD"
ENV_HANDOFF_FD = "ROBUST_STANDBY_HANDOFF_FD"
ENV_PARENT = "ROBUST_STANDBY_PARENT"
ENV_PREIMPORT = "ROBUST_STANDBY_PREIMPORT"
STANDBY_ENV = (ENV_STATUS_FD, ENV_HANDOFF_FD, ENV_PARENT, ENV_PREIMPORT)

#: Exit status of a standby that refuses to serve (a library it imported touched CUDA).
EXIT_REFUSED = 3


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` ends (``PR_SET_PDEATHSIG``); exit now if it already did."""
    # PR_SET_PDEATHSIG (1): SIGKILL when the thread that started us exits. The agent starts
    # standbys and the fork server from its main thread, which lives as long as the agent; the
    # fork server is single-threaded. Set first (imports take seconds), then checked against the
    # parent's pid in case it died before the prctl (we would have been re-parented already).
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def preimport(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Import ``names`` in order; the imported ones and, per failed one, why."""
    done, failed = [], {}
    for name in names:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as exc:  # the script's own import will raise it again, where it belongs
            failed[name] = f"{type(exc).__name__}: {exc}"[:200]
    return done, failed


def cuda_touched() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def _redirect(fd: int, path: str | None) -> None:
    if path:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _fresh_main() -> types.ModuleType:
    # A new, empty __main__ (this module stays importable under its own name): the script's
    # globals hold nothing of ours, and pickling by "__main__.X" finds the script's classes.
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    return main


def _run_script(path: str, args: list[str]) -> None:
    """What ``python path args`` does (CPython 3.9+): ``__file__`` made absolute (not
    normalized), ``sys.path[0]`` the script's real directory, ``argv[0]`` the path as given."""
    from importlib.machinery import SourceFileLoader

    file = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    main = _fresh_main()
    main.__dict__.update(__file__=file, __cached__=None, __builtins__=builtins,
                         __loader__=SourceFileLoader("__main__", file))
    with io.open_code(file) as f:
        code = compile(f.read(), file, "exec")
    exec(code, main.__dict__)


def _run_module(name: str, args: list[str]) -> None:
    """What ``python -m name args`` does: CPython's own ``runpy._run_module_as_main``."""
    import runpy

    sys.argv = ["-m", *args]  # runpy replaces argv[0] with the module's file, as python -m does
    sys.path[0] = os.getcwd()
    _fresh_main()
    runpy._run_module_as_main(name, alter_argv=True)


def _read_line(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)


def become_rank(status: int, handoff: int, report: dict) -> None:
    """Say ``ready`` (with ``report``) unless CUDA was touched, answer pings, and at the hand-off
    run the user's script in this process; returns when the script does."""
    def say(event: dict) -> None:
        os.write(status, (json.dumps(event) + "\n").encode())

    if cuda_touched():
        say({"k": "refused", "why": f"torch.cuda was initialized while importing {report.get('modules')} "
                                    f"(before the rank and its device are known)"})
        os._exit(EXIT_REFUSED)
    say({"k": "ready", "pid": os.getpid(), **report})
    while True:
        line = _read_line(handoff)
        if not line:
            os._exit(0)  # the agent closed the pipe: retired unused
        job = json.loads(line)
        if job.get("k") != "ping":
            break
        say({"k": "pong"})  # the agent's liveness check of an idle standby
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    _redirect(1, job.get("stdout"))
    _redirect(2, job.get("stderr"))
    say({"k": "go"})
    from robust_plugins.patches import wandb_fork

    wandb_fork.own_media_dir()  # not the zygote's: a sibling's exit would remove it
    os.close(status)
    os.close(handoff)
    if job.get("module"):
        _run_module(job["module"], job["args"])
    else:
        _run_script(job["script"], job["args"])


def main() -> None:
    """A spawned standby: import, then :func:`become_rank`."""
    status, handoff = int(os.environ[ENV_STATUS_FD]), int(os.environ[ENV_HANDOFF_FD])
    die_with_parent(int(os.environ[ENV_PARENT]))
    t0 = time.monotonic()
    done, failed = preimport([n for n in os.environ.get(ENV_PREIMPORT, "").split(",") if n])
    become_rank(status, handoff, {"import_s": round(time.monotonic() - t0, 3), "modules": done, "failed": failed})


if __name__ == "__main__":
    main()

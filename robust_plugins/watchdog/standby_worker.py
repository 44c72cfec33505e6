"""A warm standby rank of ``robust run``: imports the job's libraries, then becomes a rank.

Started by the node's agent (:mod:`robust_plugins.watchdog.standby`) as
``python -u -m robust_plugins.watchdog.standby_worker``, with two pipes: it writes one JSON line
per event to the agent (``ready``, ``pong``, ``go``, ``refused``) and reads JSON lines from it
(``ping`` while it waits, then the hand-off: argv, environment, working directory, output files). Then it runs the user's
script as ``python -u script.py ...`` or ``python -u -m module ...`` would: a fresh ``__main__``
module with the same ``__file__``, ``__spec__``, ``__loader__``, ``sys.argv`` and ``sys.path[0]``.

What it must not do before the hand-off (why it is safe on GPUs): create a CUDA context. It
imports only libraries (never the user's script or its own modules), and before it says
``ready`` it checks ``torch.cuda.is_initialized()`` is False; otherwise it refuses and exits, and
the agent starts that rank cold. DeepSpeed's accelerator probe (``torch.cuda.is_available()``)
loads the CUDA driver without a context, exactly as the script's own ``import deepspeed`` would.
It is a spawned interpreter (``subprocess``), never a fork of the agent: nothing of the agent's
threads, sockets or CUDA state is inherited.
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


def _die_with_agent(parent: int) -> None:
    # PR_SET_PDEATHSIG (1): SIGKILL when the thread that spawned us exits; the agent spawns
    # standbys from its main thread, which lives as long as the agent. Set before the imports
    # (seconds), and checked against the agent's pid in case it died before the prctl.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def _preimport(names: list[str]) -> tuple[list[str], dict[str, str]]:
    done, failed = [], {}
    for name in names:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as exc:  # the script's own import will raise it again, where it belongs
            failed[name] = f"{type(exc).__name__}: {exc}"[:200]
    return done, failed


def _cuda_touched() -> bool:
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


def main() -> None:
    """Import, report ready, wait for the hand-off, become the rank."""
    status, handoff = int(os.environ[ENV_STATUS_FD]), int(os.environ[ENV_HANDOFF_FD])
    _die_with_agent(int(os.environ[ENV_PARENT]))
    t0 = time.monotonic()
    names = [n for n in os.environ.get(ENV_PREIMPORT, "").split(",") if n]
    done, failed = _preimport(names)

    def say(event: dict) -> None:
        os.write(status, (json.dumps(event) + "\n").encode())

    if _cuda_touched():
        say({"k": "refused", "why": f"torch.cuda was initialized while importing {done} (before the "
                                    f"rank and its device are known)"})
        os._exit(EXIT_REFUSED)
    say({"k": "ready", "pid": os.getpid(), "import_s": round(time.monotonic() - t0, 3),
         "modules": done, "failed": failed})
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
    os.close(status)
    os.close(handoff)
    if job.get("module"):
        _run_module(job["module"], job["args"])
    else:
        _run_script(job["script"], job["args"])


if __name__ == "__main__":
    main()

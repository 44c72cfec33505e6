"""The node's standby fork server ("zygote"): imports the job's libraries once, checks that forking
is safe, then forks one warm standby (:func:`.worker.become_rank`) per request.

Started by the agent (:class:`.fork.Zygote`) as ``python -u -m
robust_plugins.launcher.standby.zygote`` with one ``SOCK_SEQPACKET`` socket; one JSON object a
message. The agent sends ``fork`` (with the new standby's two pipe ends as ``SCM_RIGHTS``) and
``ping``; the zygote answers ``ready``, ``refused`` or ``unsafe`` once, then ``forked`` (with a
pidfd of the child), ``pong``, and ``exit`` (pid, exit code) for every child it reaps: the agent
cannot ``waitpid`` its grandchildren. The children share the imported modules' pages
copy-on-write, so a node pays one import's CPU and mostly one import's memory, not one per rank.

Why fork is safe here. ``fork()`` copies only the calling thread, every lock in the state it was
in, and every library's belief about which threads and devices it owns. It is unsafe when, at the
fork, another thread could hold a lock (malloc's, a Python lock, a library mutex: the child
deadlocks on its first use), when a library owns threads the child will not have (an OpenMP team
after a parallel region: the child hangs in its next one), or when CUDA was initialized: after
``cuInit`` (any CUDA runtime call, e.g. the runtime's device count behind
``torch.cuda.is_available()``) a forked child cannot use CUDA, and a context's device mappings do
not exist in it. The zygote is a fresh interpreter started by the agent, never a fork of the agent
(whose threads, sockets and store it must not inherit); it only imports libraries (never the
user's code) and calls no device. Before it says ``ready`` it checks (:func:`fork_hazards`):

- exactly one Python thread (``threading.active_count()``) and one OS thread
  (``/proc/self/task``); a pool that stops its threads in a ``pthread_atfork`` handler passes:
  numpy's OpenBLAS starts (cores - 1) threads at ``import numpy`` unless ``OMP_NUM_THREADS=1``
  (torchrun's default with several ranks a node) and joins them before every fork. One probe
  fork, whose child exits at once, shows it: such threads are gone after it, and only the next
  BLAS call (never made here) starts them again;
- ``torch.cuda.is_initialized()`` is False (else ``refused``, as a spawned standby would: the
  same imports would touch CUDA there too, so standbys are off for the job);
- the CUDA driver is not initialized: where ``libcuda`` is loaded, ``cuDeviceGetCount`` still
  answers ``CUDA_ERROR_NOT_INITIALIZED``. So that DeepSpeed's accelerator probe
  (``torch.cuda.device_count() > 0 and torch.cuda.is_available()`` at import) does not call
  ``cuInit``, the zygote imports with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (NVML, no driver
  initialization) unless the job's environment sets it. The rank's own environment, given at the
  hand-off, no longer has it: its CUDA calls behave as in a fresh process.

and again before every fork (threads and CUDA, without a probe). Not checkable, and not done by
the libraries in :data:`.pool.PREIMPORT_ROOTS` at import: a file offset or socket a library
expects to own alone (the children inherit the zygote's descriptors).

What would make it unsafe, and then happens instead: a thread started at import (a telemetry
agent in ``sitecustomize``, a library's watchdog thread), an OpenMP parallel region run at import,
a CUDA call at import (``torch.cuda.init()``, a tensor on a GPU, the runtime's device count with
``PYTORCH_NVML_BASED_CUDA_CHECK=0``). The zygote then says ``unsafe`` and exits; the agent logs a
warning with the reason, records ``zygote_unsafe`` in ``standbys.jsonl`` and spawns one standby
interpreter per rank instead (each importing by itself).

Each child: ``setsid`` (its own session, as a spawned standby has, so the agent can signal its
process group), then ``PR_SET_PDEATHSIG`` towards the zygote, whose own points at the agent's
main thread: a SIGKILLed agent takes the zygote, which takes every child. Hence the agent never
kills a zygote while ranks it forked still run (:mod:`.pool`). What a forked rank sees that a
fresh process would not: its parent is the zygote (``os.getppid()``); every child of one zygote
has the zygote's ``str`` hash seed; the imported objects sit in the gc's permanent generation
(``gc.freeze()``, so the children's collections do not copy the shared pages). Python's ``random``
is reseeded by CPython at fork, numpy's global ``RandomState`` here (a fresh process seeds it from
the OS).
"""

from __future__ import annotations

import array
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import warnings

from robust_plugins.launcher.standby import worker as _worker

#: The fd of the zygote's end of its socket to the agent.
ENV_SOCKET_FD = "ROBUST_STANDBY_ZYGOTE_FD"

#: torch reads it at every ``torch.cuda.is_available()``: "1" asks NVML, which initializes no
#: CUDA driver, instead of the runtime's device count (``cuInit``, after which forks lose CUDA).
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"

#: Exit status of a zygote that found forking unsafe (threads, CUDA driver).
EXIT_UNSAFE = 4

#: ``cuDeviceGetCount``'s answer before ``cuInit``: the driver is loaded but not initialized.
CUDA_ERROR_NOT_INITIALIZED = 3

#: Largest message: a fork request, a ping (the agent sends nothing longer).
MAX_MESSAGE = 1 << 16


def os_threads() -> list[str]:
    """The names (``comm``) of this process's OS threads, the main one included."""
    tasks = [f"/proc/self/task/{tid}/comm" for tid in os.listdir("/proc/self/task")]
    return [name for name in map(_first_line, tasks) if name is not None]


def _first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return None  # a thread that ended meanwhile


def cuda_driver_initialized() -> bool:
    """True if ``libcuda`` is loaded in this process and ``cuInit`` has run."""
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)  # only if already loaded
    except OSError:
        return False
    count = ctypes.c_int()
    return lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def _probe_fork() -> None:
    # The child exits at once (nothing it could deadlock on): only the parent's threads matter.
    # Python 3.12+ warns about any fork with threads running; for this one it does not apply.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def fork_hazards(probe: bool) -> list[str]:
    """Why forking this process now would be unsafe (see the module docstring); empty if safe.
    ``probe``: fork once first if other OS threads run, to let ``pthread_atfork`` pools stop."""
    why = []
    if _worker.cuda_touched():
        why.append("torch.cuda is initialized (a CUDA context exists)")
    if cuda_driver_initialized():
        why.append(f"the CUDA driver is initialized (cuInit ran during the imports; {NVML_CHECK}="
                   f"{os.environ.get(NVML_CHECK)!r}): a forked child could not use CUDA")
    if threading.active_count() > 1:
        why.append(f"{threading.active_count()} Python threads run: "
                   f"{[t.name for t in threading.enumerate()]}")
    threads = os_threads()
    if len(threads) > 1 and probe:
        _probe_fork()
        threads = os_threads()
    if len(threads) > 1:
        why.append(f"{len(threads)} OS threads ({', '.join(threads)}) run{' after a probe fork' if probe else ''}: "
                   f"one may hold a lock or own a thread pool at the fork")
    return why


def receive(sock: socket.socket, maxfds: int) -> tuple[bytes, list[int]] | None:
    """One message and the descriptors that came with it, b"" at the end; None if none waits.
    (``socket.recv_fds`` of Python 3.11 drops its ``flags``: with MSG_DONTWAIT lost, a zygote woken
    by SIGCHLD alone would block in it and report no exit until the agent's next ping.)"""
    fds = array.array("i")
    try:
        data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_LEN(maxfds * fds.itemsize), socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _send(sock: socket.socket, msg: dict, fds: tuple[int, ...] = ()) -> None:
    try:
        socket.send_fds(sock, [json.dumps(msg).encode()], list(fds))
    except OSError:
        os._exit(0)  # the agent is gone (its death also SIGKILLs us: PR_SET_PDEATHSIG)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"k": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _in_child(sock: socket.socket, wake: tuple[int, int], zygote: int) -> None:
    os.setsid()  # its own session and process group, as a spawned standby's
    _worker.die_with_parent(zygote)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    for fd in wake:
        os.close(fd)
    nprandom = sys.modules.get("numpy.random")
    if nprandom is not None:
        nprandom.seed()  # from the OS, as numpy's import does in a fresh process


def serve_forks(sock: socket.socket) -> tuple[int, int]:
    """The zygote's loop: fork on request, answer pings, report exits. Returns only in a forked
    child: its status and hand-off descriptors."""
    zygote = os.getpid()
    wake = os.pipe()
    for fd in wake:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the C handler writes to ``wake``: select returns
    while True:
        select.select([sock, wake[0]], [], [])
        try:
            os.read(wake[0], 512)
        except BlockingIOError:
            pass
        _reap(sock)
        got = receive(sock, 2)
        if got is None:
            continue
        data, fds = got
        if not data:
            os._exit(0)  # the agent closed its end: retired (its unused children die with us)
        msg = json.loads(data)
        if msg["k"] == "ping":
            _send(sock, {"k": "pong"})
            continue
        hazards = fork_hazards(probe=False)
        if hazards:
            _send(sock, {"k": "unsafe", "why": "; ".join(hazards)})
            os._exit(EXIT_UNSAFE)
        pid = os.fork()
        if pid == 0:
            _in_child(sock, wake, zygote)
            return fds[0], fds[1]
        pidfd = os.pidfd_open(pid)  # the child is unreaped here: the pidfd is surely its
        _send(sock, {"k": "forked", "id": msg["id"], "pid": pid}, (pidfd,))
        for fd in (pidfd, *fds):
            os.close(fd)


def main() -> None:
    """Import, check, say ready, serve forks; in each forked child, become a standby."""
    sock = socket.socket(fileno=int(os.environ[ENV_SOCKET_FD]))
    _worker.die_with_parent(int(os.environ[_worker.ENV_PARENT]))
    t0 = time.monotonic()
    done, failed = _worker.preimport([n for n in os.environ.get(_worker.ENV_PREIMPORT, "").split(",") if n])
    import_s = round(time.monotonic() - t0, 3)
    if _worker.cuda_touched():
        _send(sock, {"k": "refused", "why": f"torch.cuda was initialized while importing {done} "
                                            f"(before the rank and its device are known)"})
        os._exit(_worker.EXIT_REFUSED)
    threads = os_threads()
    hazards = fork_hazards(probe=True)
    if hazards:
        _send(sock, {"k": "unsafe", "why": "; ".join(hazards)})
        os._exit(EXIT_UNSAFE)
    gc.freeze()
    _send(sock, {"k": "ready", "import_s": import_s, "modules": done, "failed": failed,
                 "threads_before_probe": len(threads)})
    status, handoff = serve_forks(sock)
    _worker.become_rank(status, handoff, {"import_s": 0.0, "zygote": os.getppid(), "modules": done,
                                          "failed": failed})


if __name__ == "__main__":
    main()

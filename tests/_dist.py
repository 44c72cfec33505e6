"""Run a function on W gloo ranks in fresh processes, with a hard timeout and full clean-up.

``run_ranks(fn, world_size, timeout_s, *args)`` starts one process per rank, initializes a gloo
process group on 127.0.0.1 with a free port, calls ``fn(rank, world_size, *args)`` and returns
the per-rank return values in rank order. ``fn`` must be importable by name (a module-level
function) and return picklable values; tensors come back by value. If a rank raises, the error
text of every failed rank is raised in the parent; if the run exceeds ``timeout_s``, every
process is killed and ``TimeoutError`` names the ranks that had not answered.

Ranks are forked from a fork server that has imported torch (and megatron-core, when installed)
once per pytest session, not spawned: a spawned rank spends ~1.5 s of CPU importing torch and
~5 s more importing megatron-core, which dominated these tests on 2 cores (the 11 files that use
run_ranks: 211 s spawned, 54 s forked, side by side; BENCHMARKS.md, "Test suite").
The server holds nothing else (no process group, no robust_plugins, no test state); each rank
gets the caller's current ``os.environ`` (below) and ``sys.path`` (multiprocessing sends it), as
a spawned rank would. Only environment variables that torch or megatron-core read while being
imported are fixed at the server's start.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, timeout_s, fn, args, results, env, init):
    # The fork server's environment is the one pytest had when the server started: replace it.
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    from robust_plugins.patches import wandb_fork

    wandb_fork.own_media_dir()  # as robust run's standbys do: not the fork server's
    import torch
    import torch.distributed as dist

    # 2-core CI machines run up to 8 ranks: intra-op threads would only fight each other.
    torch.set_num_threads(1)
    try:
        if init:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context():
    """The fork-server context, preloading torch and (if installed) megatron-core."""
    ctx = mp.get_context("forkserver")
    preload = ["torch", "torch.distributed"]
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        preload.append("megatron.core")
    if importlib.util.find_spec("deepspeed") is not None:
        preload.append("deepspeed")
    # Takes effect when the server starts (the first run_ranks of the session); later calls
    # set the same list.
    ctx.set_forkserver_preload(preload)
    return ctx


def kill_stray_ranks() -> list[int]:
    """SIGKILL every process the session's fork server forked that is still alive; returns their
    pids. Between tests there should be none (``run_ranks`` ends its ranks before it returns): one
    left by a test that was cut off would take the 2 cores from every later test."""
    from multiprocessing import forkserver

    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if server is None:
        return []
    try:
        with open(f"/proc/{server}/task/{server}/children") as f:
            pids = [int(p) for p in f.read().split()]
    except OSError:
        return []
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # exited, not yet reaped by the server
            os.kill(pid, 9)
            alive.append(pid)
        except (OSError, IndexError):
            pass
    return alive


def run_ranks(
    fn, world_size: int, timeout_s: float, *args, env: dict | None = None, init: bool = True
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the values by rank.

    ``env`` adds environment variables in the children, which also get ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``. With ``init=False`` the process
    group is left to ``fn`` (e.g. ``deepspeed.init_distributed``). Raises ``RuntimeError`` with the
    tracebacks of failed ranks, ``TimeoutError`` after ``timeout_s`` seconds.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    child_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                 **(env or {})}
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, timeout_s, fn, args, results, child_env, init),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    values: dict[int, object] = {}
    errors: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        while len(values) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(values) - set(errors))
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout_s} s"
                    + (f"; failures: {errors}" if errors else "")
                )
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                # A rank gone without a report (os._exit, a signal) never reports: fail now.
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None]
                dead = [r for r in dead if r not in values and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} without reporting"
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                # Peers of a failed rank usually block in a collective: stop waiting for them soon.
                deadline = min(deadline, time.monotonic() + 10.0)
        if errors:
            raise RuntimeError(
                "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            )
        return [values[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        results.cancel_join_thread()
def _script_rank(rank, world_size, script, argv, log_path):
    """One rank of :func:`run_script`: ``script`` as ``__main__`` with torchrun's environment."""
    import runpy
    import sys

    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_WORLD_SIZE=str(world_size), ROBUST_TEST_FORKED_RANK="1")
    # This rank's own file, C-level output (gloo, DeepSpeed's ops) included; run_script merges them.
    fd = os.open(f"{log_path}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    is_path = script.endswith(".py")
    sys.argv = [script, *argv]
    if is_path:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        if is_path:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise RuntimeError(f"{script} exited with {exc.code!r} on rank {rank}") from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # A normal interpreter exit runs the atexit handlers (W&B's finish, the plugin's clean-up);
    # the fork server's child leaves with os._exit, so run them here, unless the script asked to
    # leave without teardown (tests/integration/_exit.py).
    if not os.environ.get("ROBUST_TEST_LEFT_WITHOUT_TEARDOWN"):
        import atexit
        import multiprocessing.util

        # multiprocessing's own handler would stop the result queue before this rank reports;
        # the child's exit runs it after the report.
        atexit.unregister(multiprocessing.util._exit_function)
        atexit._run_exitfuncs()


def _merge_logs(log_path: str, nproc: int) -> str:
    """Join the ranks' files into ``log_path`` with torchrun's ``[defaultN]:`` prefixes; return
    the last lines of each rank (for an error message)."""
    tails = []
    with open(log_path, "w") as out:
        for rank in range(nproc):
            part = f"{log_path}.rank{rank}"
            try:
                with open(part, errors="replace") as f:
                    lines = f.read().splitlines()
                os.unlink(part)
            except FileNotFoundError:
                lines = ["(no output)"]
            out.writelines(f"[default{rank}]:{line}\n" for line in lines)
            tails.append(f"--- rank {rank}, last lines ---\n" + "\n".join(lines[-25:]))
    return "\n".join(tails)


def run_script(script, argv=(), nproc: int = 2, timeout_s: float = 300.0, env: dict | None = None,
               log_path=None) -> None:
    """Run a torchrun-style ``script`` (a ``.py`` path or a module name) on ``nproc`` forked ranks.

    What ``torchrun --nproc-per-node N --tee 3 script argv...`` runs, without N fresh
    interpreters importing torch, DeepSpeed and megatron-core: each rank is forked from the
    preloaded server, gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``, and runs the script as ``__main__`` with ``sys.argv`` set;
    the script forms its own process group (``deepspeed.init_distributed``,
    ``dist.init_process_group``). Every rank's output goes to ``log_path`` (a temporary file when
    None), each line prefixed ``[defaultN]:`` as torchrun's. A non-zero exit, an exception or a
    death on any rank raises ``RuntimeError`` with the tracebacks and each rank's last lines;
    past ``timeout_s``, ``TimeoutError``.
    """
    import tempfile

    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="robust-test-", suffix=".log")
        os.close(fd)
    log_path = str(log_path)
    try:
        run_ranks(_script_rank, nproc, timeout_s, str(script), [str(a) for a in argv], log_path,
                  env=env, init=False)
    except (RuntimeError, TimeoutError) as exc:
        raise type(exc)(f"{script} {' '.join(map(str, argv))}: {exc}\nlog: {log_path}\n"
                        + _merge_logs(log_path, nproc)) from None
    _merge_logs(log_path, nproc)

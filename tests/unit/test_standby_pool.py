"""Warm standby workers without a job: the pure pieces (what a standby imports, what it can run,
which variables may change, when forking is safe), real hand-offs compared with a fresh
``python`` (forked and spawned standbys), the fork server's fallback and its exit-code paths."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from robust_plugins.patches import torch_elastic
from robust_plugins.launcher.standby import fork as standby_fork
from robust_plugins.launcher.standby import pool as standby
from robust_plugins.launcher.standby import zygote as standby_zygote



def test_target_of_reads_torchruns_command_and_refuses_what_it_cannot_run():
    py = sys.executable
    assert standby.target_of(py, ["-u", "train.py", "--lr", "1"]) == (
        standby.Target("train.py", None, ("--lr", "1")), "")
    assert standby.target_of(py, ("-u", "-m", "pkg.train", "x"))[0] == standby.Target(None, "pkg.train", ("x",))
    target, why = standby.target_of("/usr/bin/bash", ["run.sh"])
    assert target is None and "'/usr/bin/bash' is not this Python" in why
    target, why = standby.target_of(py, ["-u", "-X", "dev", "t.py"])
    assert target is None and "['-X'] are not supported" in why
    assert standby.target_of(py, ["t.py"])[0] is None  # not torchrun's 'python -u'


def test_preimports_are_the_scripts_library_imports_never_the_script_or_user_modules(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os, deepspeed\nimport mylib.data\nfrom megatron.core import parallel_state\n"
                      "from . import sibling\ndef f():\n    import transformers\n")
    names = standby.preimports(standby.Target(str(script), None, ()), str(tmp_path))
    # DeepSpeed's setup-time imports come last (standby.HOST_LAZY)
    assert names == [*standby.ALWAYS, "deepspeed", "megatron.core", "transformers",
                     *standby.HOST_LAZY["robust_plugins"], *standby.HOST_LAZY["deepspeed"]]
    pkg = tmp_path / "robust_plugins_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "run.py").write_text("import numpy\nimport robust_plugins_probe_pkg.run\n")
    names = standby.preimports(standby.Target(None, "robust_plugins_probe_pkg.run", ()), str(tmp_path))
    assert names == [*standby.ALWAYS, "numpy", *standby.HOST_LAZY["robust_plugins"]]  # found from the cwd, not imported
    # the target module itself is never imported before it runs as __main__ (its body would run twice)
    own = standby.preimports(standby.Target(None, "robust_plugins.recipes.plain_gpt.train", ()), str(tmp_path))
    assert "robust_plugins.recipes.plain_gpt.train" not in own and "robust_plugins.workloads" in own


def test_what_a_host_imports_at_a_call_the_script_makes_is_imported_ahead(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom transformers import Trainer\n"
                      "def main():\n    m = torch.nn.parallel.DistributedDataParallel(net)\n")
    names = standby.preimports(standby.Target(str(script), None, ()), str(tmp_path))
    assert names[-2:] == ["torch._dynamo", "transformers.trainer"]  # after the hosts' HOST_LAZY
    # A script that never builds DDP / FSDP does not pay torch._dynamo's import (seconds).
    script.write_text("import torch\nimport torch.distributed as dist\nmodel = torch.nn.Linear(2, 2)\n")
    names = standby.preimports(standby.Target(str(script), None, ()), str(tmp_path))
    assert "torch._dynamo" not in names
    script.write_text("from torch.distributed.fsdp import fully_shard\n")
    assert "torch._dynamo" in standby.preimports(standby.Target(str(script), None, ()), str(tmp_path))


def test_only_rank_and_incarnation_variables_may_differ():
    ours = {"ROBUST_INCARNATION"}
    per_rank = lambda k: torch_elastic.is_rank_env(k) or k in ours  # noqa: E731
    spawn = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    rank = {**spawn, "RANK": "3", "MASTER_PORT": "1234", "TORCHELASTIC_RESTART_COUNT": "1",
            "ROBUST_INCARNATION": "1"}
    assert standby.import_env_mismatch(spawn, rank, per_rank) == []
    assert standby.import_env_mismatch(spawn, {**rank, "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "0"},
                                       per_rank) == ["CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"]


PROBE = """\
import json, os, sys
TORCH_AT_START = "torch" in sys.modules
with open(os.path.join(os.environ["PROBE_DIR"], os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"argv": sys.argv, "file": __file__, "path0": sys.path[0], "name": __name__,
               "package": __package__, "spec": __spec__, "loader": type(__loader__).__name__,
               "main_is_me": sys.modules["__main__"].__dict__ is globals(), "cwd": os.getcwd(),
               "rank": os.environ.get("RANK"), "torch": TORCH_AT_START, "ppid": os.getppid(),
               "standby_env": sorted(k for k in os.environ if k.startswith("ROBUST_STANDBY"))}, f)
"""


def _events(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "standbys.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
def test_a_standby_runs_a_script_as_a_fresh_python_would_and_leaves_nothing(tmp_path, monkeypatch, fork):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    subprocess.run([sys.executable, "-u", "sub/../sub/probe.py", "a"], check=True, timeout=60,
                   env={**os.environ, "RANK": "0"})
    target, _ = standby.target_of(sys.executable, ["-u", "sub/../sub/probe.py", "a"])
    pool = standby.StandbyPool(2, target, tmp_path, per_rank=torch_elastic.is_rank_env,
                               ready_timeout_s=120, fork=fork)
    try:
        pool.tick(spawn=True)
        assert len(pool.standbys) == 2
        sb = pool.take(wait_s=120)
        assert sb is not None and sb.ready["modules"][:2] == ["torch", "robust_plugins"]
        env = {**os.environ, "RANK": "1"}  # RANK may differ: torch sets it per rank
        # A variable that could have changed what the imports did: retired, not used.
        other = pool.take(wait_s=120)
        assert not pool.hand(other, target, {**env, "OMP_NUM_THREADS": "7"}, None, None, "1")
        assert pool.hand(sb, target, env, None, None, "1")
        assert sb.proc.wait(timeout=60) == 0
    finally:
        pool.close()
    a, b = json.loads((tmp_path / "0.json").read_text()), json.loads((tmp_path / "1.json").read_text())
    assert (a.pop("torch"), b.pop("torch")) == (False, True)
    assert (a.pop("rank"), b.pop("rank")) == ("0", "1")
    ppids = (a.pop("ppid"), b.pop("ppid"))  # the test stands in for the agent
    assert a == b and b["name"] == "__main__" and b["main_is_me"] and b["standby_env"] == []
    events = _events(tmp_path)
    names = [e["event"] for e in events]
    assert names.count("spawned") == 2 and "served" in names and "retired" in names
    assert not [sb for sb in pool.standbys if sb.proc.poll() is None]
    zygotes = [e["pid"] for e in events if e["event"] == "zygote_ready"]
    assert [e.get("zygote") for e in events if e["event"] == "spawned"] == ([zygotes[0]] * 2 if fork else [None] * 2)
    if fork:  # one fork server, stopped at the end; its children were the agent's grandchildren
        assert names[-1] == "zygote_stopped" and not os.path.exists(f"/proc/{zygotes[0]}")
        assert ppids == (os.getpid(), zygotes[0])
    else:
        assert zygotes == [] and ppids == (os.getpid(), os.getpid())


def test_a_standby_that_imported_cuda_refuses_and_switches_the_pool_off(tmp_path, monkeypatch):
    # A stand-in for a library that initializes CUDA at import: this module's import sets
    # torch.cuda.is_initialized to return True in the standby.
    (tmp_path / "cuda_at_import.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    target = standby.Target(str(tmp_path / "t.py"), None, ())
    pool = standby.StandbyPool(1, target, tmp_path, per_rank=torch_elastic.is_rank_env)
    pool.modules.append("cuda_at_import")
    try:
        pool.tick(spawn=True)
        deadline = time.monotonic() + 120
        while pool.standbys and time.monotonic() < deadline:
            time.sleep(0.1)
            pool.tick(spawn=True)
        assert pool.standbys == [] and pool.size == 0
    finally:
        pool.close()
    (event,) = [e for e in _events(tmp_path) if e["event"] == "refused"]
    assert "torch.cuda was initialized" in event["why"] and event["exitcode"] == 3
    assert [e["event"] for e in _events(tmp_path)][0] == "zygote_spawned"  # the fork server refused


def _hazards(code: str, **env: str) -> dict:
    # A fresh interpreter: what fork_hazards says about it after ``code`` ran.
    out = subprocess.run([sys.executable, "-c", code + "\nimport json\nfrom robust_plugins.launcher.standby import zygote as z\n"
                          "n = len(z.os_threads())\nprint(json.dumps({'before': n, 'why': z.fork_hazards(probe=True),"
                          " 'after': len(z.os_threads())}))"],
                         capture_output=True, text=True, timeout=120, check=True, env={**os.environ, **env})
    return json.loads(out.stdout.splitlines()[-1])


def test_forking_is_safe_after_library_imports_and_not_with_a_thread_running():
    assert _hazards("import torch, robust_plugins", OMP_NUM_THREADS="1") == {"before": 1, "why": [], "after": 1}
    # numpy's OpenBLAS runs a pool (OPENBLAS_NUM_THREADS - 1 threads) that it stops at every fork
    # (pthread_atfork): the probe fork shows it, and nothing starts it again before our forks.
    blas = _hazards("import numpy", OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2")
    assert blas["before"] == 2 and blas["why"] == [] and blas["after"] == 1
    # A thread that does not stop at a fork may hold any lock at that moment: refused, and said.
    held = _hazards("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True, "
                    "name='holder').start()", OMP_NUM_THREADS="1")
    assert held["after"] == 2 and len(held["why"]) == 2
    assert "2 Python threads run: ['MainThread', 'holder']" in held["why"][0]
    assert "2 OS threads" in held["why"][1] and "after a probe fork" in held["why"][1]


def test_an_initialized_cuda_driver_makes_forking_unsafe(monkeypatch):
    # Without a GPU: a stand-in for libcuda. cuDeviceGetCount says CUDA_ERROR_NOT_INITIALIZED (3)
    # before cuInit, success (0) after it; a process that never loaded libcuda initialized nothing.
    class Driver:
        def __init__(self, answer: int) -> None:
            self.answer = answer

        def cuDeviceGetCount(self, _):  # noqa: N802 (the driver's name)
            return self.answer

    for answer, initialized in ((3, False), (0, True), (100, True)):
        monkeypatch.setattr(standby_zygote.ctypes, "CDLL", lambda name, mode, a=answer: Driver(a))
        assert standby_zygote.cuda_driver_initialized() is initialized
        assert any("the CUDA driver is initialized" in w for w in standby_zygote.fork_hazards(False)) is initialized

    def not_loaded(name, mode):
        assert name == "libcuda.so.1" and mode == os.RTLD_NOLOAD  # never loads it
        raise OSError("not loaded")

    monkeypatch.setattr(standby_zygote.ctypes, "CDLL", not_loaded)
    assert standby_zygote.cuda_driver_initialized() is False


THREAD_AT_IMPORT = "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True, name='lib-watchdog').start()\n"
EXIT_WHEN = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(0.02)\nsys.exit(7)\n"


def test_where_forking_is_unsafe_the_pool_says_why_and_spawns_standbys(tmp_path, monkeypatch, caplog):
    (tmp_path / "thread_at_import.py").write_text(THREAD_AT_IMPORT)
    (tmp_path / "t.py").write_text("import sys\nsys.exit(5)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(tmp_path)
    target = standby.Target("t.py", None, ())
    pool = standby.StandbyPool(1, target, tmp_path, per_rank=torch_elastic.is_rank_env, ready_timeout_s=120)
    pool.modules.append("thread_at_import")  # a library that starts a thread at import
    try:
        with caplog.at_level(logging.WARNING, logger="robust_plugins"):
            pool.tick(spawn=True)
            sb = pool.take(wait_s=120)  # waits through the refusal for the spawned standby
        assert sb is not None and sb.zygote is None and not pool.fork
        assert pool.hand(sb, target, dict(os.environ), None, None, "0")
        assert sb.proc.wait(timeout=60) == 5
    finally:
        pool.close()
    (warning,) = [r.getMessage() for r in caplog.records if "unsafe" in r.getMessage()]
    assert "forking standbys is unsafe here: 2 Python threads run: ['MainThread', 'lib-watchdog']" in warning
    assert "Standbys are spawned instead" in warning
    events = _events(tmp_path)
    assert [e["event"] for e in events if e["event"].startswith("zygote")] == ["zygote_spawned", "zygote_unsafe"]
    (unsafe,) = [e for e in events if e["event"] == "zygote_unsafe"]
    assert unsafe["exitcode"] == standby_zygote.EXIT_UNSAFE and "lib-watchdog" in unsafe["why"]


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def _tick_until(pool: standby.StandbyPool, tmp_path: Path, event: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool.tick(spawn=False)
        found = [e for e in _events(tmp_path) if e["event"] == event]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no {event} within {timeout_s} s: {_events(tmp_path)}")


def test_a_hung_fork_server_is_replaced_but_outlives_the_rank_it_forked(tmp_path, monkeypatch):
    """Killing a fork server kills its children (PR_SET_PDEATHSIG), so one that stops answering
    while a rank it forked runs is only drained; that rank's exit code is read while it is an
    unreaped zombie; then the server is killed."""
    monkeypatch.setattr(standby, "PING_EVERY_S", 0.2)
    monkeypatch.setattr(standby, "PING_TIMEOUT_S", 1.0)
    (tmp_path / "t.py").write_text(EXIT_WHEN)
    monkeypatch.chdir(tmp_path)
    target = standby.Target("t.py", None, (str(tmp_path / "go"),))
    pool = standby.StandbyPool(2, target, tmp_path, per_rank=torch_elastic.is_rank_env, ready_timeout_s=120)
    z = None
    try:
        pool.tick(spawn=True)
        sb = pool.take(wait_s=120)
        z = sb.zygote
        assert _ppid(sb.proc.pid) == z.pid  # the agent's grandchild
        assert pool.hand(sb, target, dict(os.environ), None, None, "0")
        os.kill(z.pid, signal.SIGSTOP)
        hung = _tick_until(pool, tmp_path, "zygote_hung")
        assert hung["pid"] == z.pid and hung["draining"] == [sb.proc.pid] and "ping" in hung["why"]
        assert pool.draining == [z] and z.alive() and sb.proc.poll() is None  # the rank runs on
        assert [e["exitcode"] for e in _events(tmp_path) if e["event"] == "stopped"] == [-signal.SIGKILL]  # its idle one
        (tmp_path / "go").touch()
        assert sb.proc.wait(timeout=30) == 7  # from /proc while the stopped server cannot reap it
        stopped = _tick_until(pool, tmp_path, "zygote_stopped")
        assert stopped["pid"] == z.pid and pool.draining == [] and not z.alive()
    finally:
        if z is not None and z.alive():
            os.kill(z.pid, signal.SIGCONT)
        pool.close()


def test_a_dead_fork_server_is_replaced_and_its_standbys_counted_killed(tmp_path, monkeypatch):
    (tmp_path / "t.py").write_text(EXIT_WHEN)
    monkeypatch.chdir(tmp_path)
    target = standby.Target("t.py", None, (str(tmp_path / "go"),))
    pool = standby.StandbyPool(1, target, tmp_path, per_rank=torch_elastic.is_rank_env, ready_timeout_s=120)
    try:
        pool.tick(spawn=True)
        first = pool.take(wait_s=120)
        pool.standbys.append(first)  # keep it in the pool, ready
        os.kill(first.zygote.pid, signal.SIGKILL)
        died = _tick_until(pool, tmp_path, "zygote_died")
        assert died["pid"] == first.zygote.pid and first.proc.wait(timeout=10) == -signal.SIGKILL
        pool.tick(spawn=True)  # a new server, a new standby from it
        again = pool.take(wait_s=120)
        assert again is not None and again.zygote is not first.zygote and again.proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            standby_fork.ForkedProc(again.zygote, 99).wait(timeout=0.1)  # not forked (yet)
        assert pool.hand(again, target, dict(os.environ), None, None, "0")
        (tmp_path / "go").touch()
        assert again.proc.wait(timeout=30) == 7  # reported by the server that reaped it
    finally:
        pool.close()


def test_a_zygote_that_exits_with_a_fork_request_unread_still_says_why():
    # A fork server that finds forking unsafe exits without reading the fork request queued for
    # it. Linux then resets our end of the socket once, before the "unsafe" message it sent last:
    # read as the end, the message was lost and the pool took a refusal for a death (no standby;
    # CI). The real kernel behaviour, on a socket pair; the zygote object without its process.
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    z = object.__new__(standby_fork.Zygote)
    z.sock, z.news, z.children, z._by_pid, z._eof, z.ready, z.pinged = ours, [], {}, {}, False, None, None
    ours.setblocking(False)
    ours.send(json.dumps({"k": "fork", "id": 0}).encode())  # never read
    theirs.send(json.dumps({"k": "unsafe", "why": "2 Python threads run"}).encode())
    theirs.close()
    z.pump()
    assert [m["k"] for m in z.news] == ["unsafe"] and z._eof
    ours.close()

"""Warm standby workers without a job: the pure pieces (what a standby imports, what it can run,
which variables may change) and one real hand-off compared with a fresh ``python``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from robust_plugins.patches import torch_elastic
from robust_plugins.watchdog import standby


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
               "rank": os.environ.get("RANK"), "torch": TORCH_AT_START,
               "standby_env": sorted(k for k in os.environ if k.startswith("ROBUST_STANDBY"))}, f)
"""


def test_a_standby_runs_a_script_as_a_fresh_python_would_and_leaves_nothing(tmp_path, monkeypatch):
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
                               ready_timeout_s=120)
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
    assert a == b and b["name"] == "__main__" and b["main_is_me"] and b["standby_env"] == []
    events = [json.loads(x)["event"] for x in (tmp_path / "standbys.jsonl").read_text().splitlines()]
    assert events.count("spawned") == 2 and "served" in events and "retired" in events
    assert not [sb for sb in pool.standbys if sb.proc.poll() is None]


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
    (event,) = [json.loads(x) for x in (tmp_path / "standbys.jsonl").read_text().splitlines()
                if json.loads(x)["event"] == "refused"]
    assert "torch.cuda was initialized" in event["why"] and event["exitcode"] == 3

"""Warm recovery (a restart served by forked standby workers, the default) ends bitwise equal to a run
without faults: DeepSpeed ZeRO 0/1/2 and megatron-core with in-memory snapshots. The plain loop:
``test_robust_run_defaults.py``. The workers and oracles are those of ``test_memory_restore.py``
and ``test_megatron_memory.py``; here the restart must have been served by standbys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]

DS_SCRIPT = str(Path(__file__).with_name("ds_memory_train.py"))
STEPS = 10
MCORE = ["-m", "robust_plugins.recipes.megatron_gpt.train", "--preset", "cpu-tiny", "--steps", str(STEPS),
         "--log-every", "0", "--memory-every", "1", "--peer-backup"]


def _warm(job, kind: str, rank: int) -> None:
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"]) == (kind, [rank])
    assert fault["detail"]["standby"] is True and fault["detail"]["standby_ranks"] == [0, 1]
    assert fault["lost_steps"] <= 1
    # Both incarnations' ranks were served by standbys forked from the node's fork server (not
    # the spawned fallback).
    events = [json.loads(x) for x in (job.run_dir / "standbys.jsonl").read_text().splitlines()]
    served = {e["pid"] for e in events if e["event"] == "served"}
    forked = {e["pid"] for e in events if e["event"] == "spawned" and e.get("zygote")}
    assert len(served) == 4 and served <= forked, events


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_deepspeed_zero_warm_recovery_is_bitwise(tmp_path, stage):
    pytest.importorskip("deepspeed")
    args = [DS_SCRIPT, "--steps", str(STEPS), "--persist-every", "100", "--stage", str(stage)]
    clean = robust_run(tmp_path / "clean", 2, "--max-restarts", "0", timeout_s=280, script=args)
    assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
    job = robust_run(tmp_path / "kill", 2, "--inject", "kill:rank=1,step=6", timeout_s=280, script=args)
    assert job.returncode == 0, job.output[-3000:]
    _warm(job, "crash", 1)
    for key in ("final_loss", "params_hash", "fp32_hashes"):
        assert job.result[key] == clean.result[key], key


def test_megatron_core_warm_recovery_is_bitwise(tmp_path):
    pytest.importorskip("megatron.core")
    clean = robust_run(tmp_path / "clean", 2, "--max-restarts", "0", timeout_s=280, script=MCORE)
    assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
    job = robust_run(tmp_path / "kill", 2, "--inject", "kill:rank=0,step=6", timeout_s=280, script=MCORE)
    assert job.returncode == 0, job.output[-3000:]
    _warm(job, "crash", 0)
    assert job.result["digest"] == clean.result["digest"]
    assert job.result["losses"] == clean.result["losses"][job.result["start"]:]

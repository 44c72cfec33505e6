"""Megatron-LM's own ``pretrain_gpt.py`` under ``robust run -m robust_plugins.megatron_lm`` with
int8 compression and in-memory snapshots (``memory_every: 1``, ``peer_backup``), 2 gloo ranks:


* a rank SIGKILLed at a random step is restored by Megatron-LM's ``load_checkpoint`` from memory
  (own slot or a peer's copy, never Megatron-LM's disk checkpoint), loses at most one step, and
  ends with parameters, optimizer state and residuals bitwise equal to an uninterrupted run;
* a NaN loss reported from ``train_step`` by one rank, then a bit flipped in another rank's
  parameters (found by the snapshots' replica check): each rolls every rank back one snapshot,
  in memory, and the job ends bitwise equal to the uninterrupted run.

Skipped without a Megatron-LM checkout (``MEGATRON_LM_PATH``). Cost with one: 3 jobs, ~250 s.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import run_job

from _megatron_lm import SCRIPT, gpt_args, saved_state, skip_without_checkout, tensors

# One incarnation is 60-150 s here (Megatron-LM's imports on 2 shared cores); a job has up to 3.
pytestmark = [pytest.mark.fault, pytest.mark.timeout(900)]

STEPS = 10
BLOCK = {"compression": {"codec": "int8"}, "checkpoint": {"memory_every": 1, "peer_backup": True}}


def _job(run_dir, *robust_args, timeout_s=300):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "block.json").write_text(json.dumps(BLOCK))
    ckpt = str(run_dir / "ckpt")
    cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(run_dir), "--standalone",
           "--nproc-per-node", "2", "--monitor-interval", "0.1", "--watchdog", "straggler_factor=0", *robust_args,
           "-m", "robust_plugins.megatron_lm", "--robust-config", str(run_dir / "block.json"), SCRIPT,
           *gpt_args(STEPS), "--save", ckpt, "--load", ckpt, "--save-interval", "1000"]
    return run_job(cmd, run_dir, timeout_s)


def _final(job) -> dict:
    state = saved_state(job.run_dir / "ckpt", STEPS)
    return tensors({"model": state["model"], "optimizer": state["optimizer"]})


def _plugin(job, rank: int) -> dict:
    return tensors(torch.load(job.run_dir / "ckpt" / f"iter_{STEPS:07d}" / f"robust_plugins_rank{rank:05d}.pt",
                              weights_only=True))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    skip_without_checkout()
    job = _job(tmp_path_factory.mktemp("mlm_clean"), "--max-restarts", "0")
    assert job.returncode == 0 and job.faults == [], job.output[-3000:]
    return job


def test_sigkill_restores_from_memory_bitwise(tmp_path, clean, draw):
    rank, step = draw.randrange(2), draw.randrange(3, STEPS)
    where = f"(kill:rank={rank},step={step}, ROBUST_TEST_SEED={draw.seed_value})"
    job = _job(tmp_path / "kill", "--max-restarts", "1", "--inject", f"kill:rank={rank},step={step}", timeout_s=500)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["step"]) == ("crash", [rank], step), where
    lines = (job.run_dir / "restores.jsonl").read_text().splitlines()
    restores = [r for r in map(json.loads, lines) if r["incarnation"] > 0]
    assert sorted(r["rank"] for r in restores) == [0, 1], (where, restores)
    assert {r["source"].split(":")[0] for r in restores} <= {"memory", "peer"}, (where, restores)
    (resumed,) = {r["step"] for r in restores}
    assert resumed in (step - 1, step), (where, restores)  # at most one step lost
    a, b = _final(clean), _final(job)
    assert a.keys() == b.keys() and len(a) > 20
    assert [k for k in a if not torch.equal(a[k], b[k])] == [], where
    for r in (0, 1):  # int8's error-feedback residuals came back from the snapshot too
        pa, pb = _plugin(clean, r), _plugin(job, r)
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa), where


def test_nan_then_a_bit_flip_each_roll_back_one_snapshot_bitwise(tmp_path, clean, draw):
    rank, step = draw.randrange(2), draw.randrange(3, 5)
    flip_rank, flip_step = draw.randrange(2), draw.randrange(step + 2, STEPS - 1)
    specs = f"nan:rank={rank},step={step};bitflip:rank={flip_rank},step={flip_step}"
    where = f"({specs}, ROBUST_TEST_SEED={draw.seed_value})"
    job = _job(tmp_path / "nan", "--max-restarts", "2", "--inject", specs, timeout_s=700)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    nan, sdc = job.faults
    assert (nan["kind"], nan["step"], nan["action"], nan["suspect_ranks"]) == ("nan", step, "rollback", [rank]), \
        (where, nan)
    assert (sdc["kind"], sdc["step"], sdc["action"]) == ("sdc", flip_step, "rollback"), (where, sdc)
    assert sdc["detail"]["checked_by"] == "snapshot", (where, sdc)
    lines = (job.run_dir / "restores.jsonl").read_text().splitlines()
    restores = [r for r in map(json.loads, lines) if r["incarnation"] > 0]
    assert {(r["incarnation"], r["rank"], r["step"]) for r in restores} == \
        {(i, r, s - 1) for i, s in ((1, step), (2, flip_step)) for r in range(2)}, (where, restores)
    assert {r["source"] for r in restores} == {"memory"}, (where, restores)
    a, b = _final(clean), _final(job)
    assert [k for k in a if not torch.equal(a[k], b[k])] == [], where

"""``robust run`` + DeepSpeed ZeRO-3 (bf16, 2 ranks) with ``memory_every: 1`` and ``peer_backup``.

Two jobs for the module: a fault-free one, and one where rank 1 is SIGKILLed at one step and rank
0 reports a NaN loss at a later one (both drawn; ``ROBUST_TEST_SEED`` replays them). Each restart
resumes inside ``deepspeed.initialize`` from each rank's own ZeRO-3 partitions in shared memory:
at most one step lost per fault, and the job ends bitwise equal to the fault-free one (every
rank's fp32 master partition, bf16 parameter partition and Adam state, and the loss), although
each incarnation builds its model from another seed and seeds its RNGs differently.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import robust_run

from robust_plugins.checkpoint import memory

pytestmark = [pytest.mark.fault, pytest.mark.timeout(210)]

SCRIPT = str(Path(__file__).with_name("ds_zero3_train.py"))
STEPS = 14


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    import os

    env = os.environ.get("ROBUST_TEST_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(2**32)
    draw = random.Random(seed)
    kill, nan = draw.randrange(3, 8), draw.randrange(9, STEPS - 1)
    where = f"(kill:rank=1,step={kill}, nan:rank=0,step={nan}, ROBUST_TEST_SEED={seed})"
    print(where)
    root = tmp_path_factory.mktemp("zero3_faults")
    args = [SCRIPT, "--steps", str(STEPS)]
    clean = robust_run(root / "clean", 2, "--max-restarts", "0", timeout_s=120, script=args)
    job = robust_run(root / "faults", 2, "--max-restarts", "2", "--inject", f"kill:rank=1,step={kill}",
                     "--inject", f"nan:rank=0,step={nan}", timeout_s=160, script=args)
    return clean, job, kill, nan, where


def _restores(job) -> list[dict]:
    path = job.run_dir / "restores.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_fault_free_zero3_job_completes(jobs):
    clean, _, _, _, _ = jobs
    assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
    assert clean.result["started_at"] == 1 and "in-memory snapshots skipped" in clean.output


def test_kill_and_nan_are_recovered_from_memory_with_at_most_one_step_lost(jobs):
    _, job, kill, nan, where = jobs
    assert job.returncode == 0, f"{where}\n{job.output[-4000:]}"
    kinds = [(f["kind"], f["step"], f["suspect_ranks"]) for f in job.faults]
    assert kinds == [("crash", kill, [1]), ("nan", nan, [0])], (where, kinds)
    by_inc: dict[int, list[dict]] = {}
    for r in _restores(job):
        by_inc.setdefault(r["incarnation"], []).append(r)
    assert sorted(by_inc) == [1, 2], (where, by_inc)
    for inc, lost_at, bound in ((1, kill, (kill - 1, kill)), (2, nan, (nan - 1, nan - 1))):
        rs = by_inc[inc]
        assert sorted(r["rank"] for r in rs) == [0, 1], (where, rs)
        assert {r["source"].split(":")[0] for r in rs} <= {"memory", "peer"}, (where, rs)
        (step,) = {r["step"] for r in rs}
        # a crash loses at most the step in flight; a NaN rolls back to the step before it
        assert bound[0] <= step <= bound[1], (where, inc, rs)
    assert job.faults[0]["resumed_at_step"] in (kill, kill + 1), (where, job.faults[0])
    assert job.faults[1]["resumed_at_step"] == nan, (where, job.faults[1])


def test_recovered_zero3_job_ends_bitwise_equal_to_the_fault_free_one(jobs):
    clean, job, _, _, where = jobs
    assert job.returncode == 0, where
    assert job.result["hashes"] == clean.result["hashes"], where  # every rank's partitions and Adam state
    assert job.result["final_loss"] == clean.result["final_loss"], where
    assert len(set(clean.result["hashes"])) == 2  # two ranks, two different partitions


def test_zero3_jobs_leave_no_shared_memory(jobs):
    clean, job, _, _, _ = jobs
    for j in (clean, job):
        assert memory.job_files(memory.job_key(str(j.run_dir.resolve()))) == []

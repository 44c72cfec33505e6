"""megatron-core with in-memory snapshots (``MegatronCheckpointer`` + ``memory_every: 1`` +
``peer_backup``), the CPU recipe (cpu-tiny, int8 compression, plain DDP and megatron's
``FP32Optimizer``; the distributed optimizer: test_megatron_3d_memory.py) under ``robust run``:

* a rank SIGKILLed at a random step resumes from shared memory (its own slot, or a peer's copy
  when its newest was not committed yet), loses at most one step and ends bitwise equal (every
  parameter, every later loss) to a run that never failed; the job's shared memory is removed
  when it completes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import robust_run

from robust_plugins.checkpoint import memory

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

STEPS = 16
# The recipe with a loss scaled by torch, tracker, numpy and Python RNG draws (mcore_rng_train.py):
# a restore that left out any of those states would not end bitwise equal.
SCRIPT = [str(Path(__file__).with_name("mcore_rng_train.py")), "--noise", "all", "--preset", "cpu-tiny", "--codec", "int8",
          "--steps", str(STEPS), "--log-every", "0", "--memory-every", "1", "--peer-backup",
          "--no-distributed-optimizer"]


def _restores(job) -> list[dict]:
    path = job.run_dir / "restores.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _shm_files(job) -> list[str]:
    return memory.job_files(memory.job_key(str(job.run_dir.resolve())))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    job = robust_run(tmp_path_factory.mktemp("mcore_mem_clean"), 2, "--max-restarts", "0", timeout_s=150,
                     script=SCRIPT)
    assert job.returncode == 0 and job.faults == [], job.output[-3000:]
    return job


def test_random_sigkill_resumes_from_memory_bitwise(tmp_path, clean, draw):
    rank, step = draw.randrange(2), draw.randrange(3, STEPS)
    where = f"(kill:rank={rank},step={step}, ROBUST_TEST_SEED={draw.seed_value})"
    job = robust_run(tmp_path / "kill", 2, "--max-restarts", "1", "--inject", f"kill:rank={rank},step={step}",
                     timeout_s=150, script=SCRIPT)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["step"]) == ("crash", [rank], step), where
    restores = [r for r in _restores(job) if r["incarnation"] > 0]
    assert sorted(r["rank"] for r in restores) == [0, 1], (where, restores)
    assert {r["source"].split(":")[0] for r in restores} <= {"memory", "peer"}, (where, restores)
    (resumed,) = {r["step"] for r in restores}
    assert resumed in (step - 1, step), (where, restores)  # at most one step lost
    assert job.result["start"] == resumed
    assert job.result["digest"] == clean.result["digest"], where
    assert job.result["losses"] == clean.result["losses"][resumed:], where
    assert "in-memory snapshots skipped" in clean.output  # the first incarnation found none and said so
    assert _shm_files(clean) == [] and _shm_files(job) == []


def test_a_bit_flip_is_rolled_back_one_snapshot_from_memory_bitwise(tmp_path, clean, draw):
    """No --max-restarts and no watchdog option: the snapshot of step S holds the flipped bit,
    its replica check finds it (both ranks named: two replicas have no majority), and the job
    resumes from S-1 in memory and ends bitwise equal to the clean run."""
    rank, step = draw.randrange(2), draw.randrange(3, STEPS - 2)
    where = f"(bitflip:rank={rank},step={step}, ROBUST_TEST_SEED={draw.seed_value})"
    job = robust_run(tmp_path / "flip", 2, "--inject", f"bitflip:rank={rank},step={step}", timeout_s=150,
                     script=SCRIPT)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    assert (fault["kind"], fault["step"], fault["action"], fault["suspect_ranks"]) == \
        ("sdc", step, "rollback", [0, 1]), (where, fault)
    assert fault["detail"]["checked_by"] == "snapshot", (where, fault)
    restores = [r for r in _restores(job) if r["incarnation"] > 0]
    assert {(r["rank"], r["step"], r["source"]) for r in restores} == {(0, step - 1, "memory"),
                                                                      (1, step - 1, "memory")}, (where, restores)
    assert job.result["digest"] == clean.result["digest"], where
    assert job.result["losses"] == clean.result["losses"][step - 1:], where

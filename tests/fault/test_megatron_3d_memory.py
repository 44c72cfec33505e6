"""megatron-core in 3D under ``robust run``, recovered from in-memory snapshots: the recipe's
``cpu-3d`` preset (PP 2 x DP 2 on 4 ranks, bf16 in ``Float16Module``, megatron's own
``DistributedOptimizer`` from ``get_megatron_optimizer``, int8 compression, 4 micro-batches a step
through megatron's 1F1B schedule) with ``MegatronCheckpointer`` + ``memory_every: 1`` +
``peer_backup``:

* a rank SIGKILLed at a random step of an interleaved job (``--vpp 2``: two model chunks a
  stage): every rank of every stage restores from shared memory (its own slot or a peer's copy),
  at most one step is lost, and every rank's parameters end bitwise equal to a run that never
  failed (each snapshot holds only its rank's shard of the distributed optimizer: fp32 main
  parameters, moments, steps, for every chunk);
* a NaN loss reported by one rank, then a bit flipped in another rank's bf16 parameters (in the
  same job): each rolls the whole job (both stages) back one snapshot from memory, and it ends
  bitwise equal. The flip is found by the replica check of its snapshot, which compares each rank
  with its data-parallel replica of the same stage (never with the other stage's ranks).

The loss is scaled by torch, tracker, numpy and Python RNG draws (``mcore_rng_train.py``): a
restore that left out any of those states would not end bitwise equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import robust_run

from robust_plugins.checkpoint import memory

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.fault]

STEPS = 10
SCRIPT = [str(Path(__file__).with_name("mcore_rng_train.py")), "--noise", "all", "--preset", "cpu-3d",
          "--codec", "int8", "--steps", str(STEPS), "--log-every", "0", "--memory-every", "1", "--peer-backup"]
SCRIPT_VPP = [*SCRIPT, "--vpp", "2"]  # 4 layers: 2 virtual stages of 1 layer on each of the 2 stages


def _restores(job) -> list[dict]:
    path = job.run_dir / "restores.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _shm_files(job) -> list[str]:
    return memory.job_files(memory.job_key(str(job.run_dir.resolve())))


def _clean(run_dir, script: list[str], vpp: int | None):
    job = robust_run(run_dir, 4, "--max-restarts", "0", timeout_s=200, script=script)
    assert job.returncode == 0 and job.faults == [], job.output[-3000:]
    r = job.result
    assert (r["pp"], r["vpp"], r["dp"], r["bf16"], r["distopt"], r["optimizer"]) == \
        (2, vpp, 2, True, True, "megatron"), r
    # every snapshot checked against its stage's other data-parallel replica (and found equal)
    assert "checked against its 2 data-parallel replicas" in job.output, job.output[-3000:]
    return job


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The fault-free run, 1F1B (one model chunk a stage)."""
    return _clean(tmp_path_factory.mktemp("mcore3d_clean"), SCRIPT, None)


@pytest.fixture(scope="module")
def clean_vpp(tmp_path_factory):
    """The fault-free run, interleaved 1F1B (two model chunks a stage)."""
    return _clean(tmp_path_factory.mktemp("mcore3d_vpp_clean"), SCRIPT_VPP, 2)


@pytest.mark.timeout(240)
def test_random_sigkill_in_3d_with_virtual_stages_resumes_from_memory_bitwise(tmp_path, clean_vpp, draw):
    clean = clean_vpp
    rank, step = draw.randrange(4), draw.randrange(3, STEPS)
    where = f"(kill:rank={rank},step={step}, ROBUST_TEST_SEED={draw.seed_value})"
    job = robust_run(tmp_path / "kill", 4, "--max-restarts", "1", "--inject", f"kill:rank={rank},step={step}",
                     timeout_s=200, script=SCRIPT_VPP)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["step"]) == ("crash", [rank], step), where
    restores = [r for r in _restores(job) if r["incarnation"] > 0]
    assert sorted(r["rank"] for r in restores) == [0, 1, 2, 3], (where, restores)
    assert {r["source"].split(":")[0] for r in restores} <= {"memory", "peer"}, (where, restores)
    (resumed,) = {r["step"] for r in restores}
    assert resumed in (step - 1, step), (where, restores)  # at most one step lost
    assert job.result["start"] == resumed
    assert job.result["digests"] == clean.result["digests"], where  # every stage and replica
    assert job.result["losses"] == clean.result["losses"][resumed:], where
    assert _shm_files(clean) == [] and _shm_files(job) == []


@pytest.mark.timeout(240)
def test_nan_then_a_bit_flip_each_roll_every_stage_back_one_snapshot_bitwise(tmp_path, clean, draw):
    """A NaN reported by one rank, then (after that rollback) a bit flipped in another rank's bf16
    parameters: the replica check of that snapshot compares the flipped rank with its data-parallel
    replica of the same stage only (both named: two replicas have no majority; the other stage's
    ranks are not compared with them), and every rank resumes from the snapshot before, in memory."""
    rank, step = draw.randrange(4), draw.randrange(3, 6)
    flip_rank, flip_step = draw.randrange(4), draw.randrange(step + 2, STEPS - 1)
    specs = f"nan:rank={rank},step={step};bitflip:rank={flip_rank},step={flip_step}"
    where = f"({specs}, ROBUST_TEST_SEED={draw.seed_value})"
    job = robust_run(tmp_path / "nan", 4, "--max-restarts", "2", "--inject", specs, timeout_s=200, script=SCRIPT)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    nan, sdc = job.faults
    assert (nan["kind"], nan["step"], nan["action"]) == ("nan", step, "rollback"), (where, nan)
    stage = sorted(clean.result["dp_group_by_rank"][flip_rank])  # this rank's DP replicas: its stage's
    digests = clean.result["digests"]
    assert len(stage) == 2 and len({digests[r] for r in stage}) == 1, (stage, digests)
    assert not {digests[r] for r in stage} & {digests[r] for r in range(4) if r not in stage}  # other stage
    assert (sdc["kind"], sdc["step"], sdc["action"], sdc["suspect_ranks"]) == \
        ("sdc", flip_step, "rollback", stage), (where, sdc)
    assert sdc["detail"]["checked_by"] == "snapshot", (where, sdc)
    restores = [r for r in _restores(job) if r["incarnation"] > 0]
    assert {(r["incarnation"], r["rank"], r["step"]) for r in restores} == \
        {(i, r, s - 1) for i, s in ((1, step), (2, flip_step)) for r in range(4)}, (where, restores)
    assert {r["source"] for r in restores} == {"memory"}, (where, restores)
    assert job.result["start"] == flip_step - 1
    assert job.result["digests"] == clean.result["digests"], where
    assert job.result["losses"] == clean.result["losses"][flip_step - 1:], where

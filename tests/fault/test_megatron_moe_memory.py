"""Mixture of experts under ``robust run``, recovered from in-memory snapshots: the recipe's
``cpu-moe`` preset (4 experts top-2, EP 2 x expert-DP 2 on 4 ranks, bf16 in ``Float16Module``,
megatron's ``DistributedOptimizer``, int8 compression on dense and expert buckets) with
``MegatronCheckpointer`` + ``memory_every: 1`` + ``peer_backup``. A rank SIGKILLed at a random
step: every rank restores from shared memory (its own slot or a peer's copy; each holds its own
experts and its shard of the distributed optimizer over its expert-data-parallel group), at most
one step is lost, and every rank's parameters end bitwise equal to a run that never failed. The
loss is scaled by torch, tracker, numpy and Python RNG draws (``mcore_rng_train.py``).

Cost: two 4-rank ``robust run`` jobs, about 60-110 s on the 2-core box (most of it the three incarnations' imports).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import robust_run

from robust_plugins.checkpoint import memory

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.fault]

STEPS = 6
SCRIPT = [str(Path(__file__).with_name("mcore_rng_train.py")), "--noise", "all", "--preset", "cpu-moe",
          "--codec", "int8", "--steps", str(STEPS), "--log-every", "0", "--memory-every", "1", "--peer-backup"]


def _restores(job) -> list[dict]:
    path = job.run_dir / "restores.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(300)
def test_random_sigkill_on_moe_resumes_from_memory_bitwise(tmp_path, draw):
    clean = robust_run(tmp_path / "clean", 4, "--max-restarts", "0", timeout_s=140, script=SCRIPT)
    assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
    r = clean.result
    assert (r["experts"], r["ep"], r["dp"], r["bf16"], r["distopt"]) == (4, 2, 4, True, True), r
    # expert weights differ between the two expert-parallel ranks of a node: the ranks are not all equal
    assert len(set(r["digests"])) > 1, r["digests"]
    rank, step = draw.randrange(4), draw.randrange(3, STEPS)
    where = f"(kill:rank={rank},step={step}, ROBUST_TEST_SEED={draw.seed_value})"
    job = robust_run(tmp_path / "kill", 4, "--max-restarts", "1", "--inject", f"kill:rank={rank},step={step}",
                     timeout_s=140, script=SCRIPT)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["step"]) == ("crash", [rank], step), where
    restores = [x for x in _restores(job) if x["incarnation"] > 0]
    assert sorted(x["rank"] for x in restores) == [0, 1, 2, 3], (where, restores)
    assert {x["source"].split(":")[0] for x in restores} <= {"memory", "peer"}, (where, restores)
    (resumed,) = {x["step"] for x in restores}
    assert resumed in (step - 1, step), (where, restores)  # at most one step lost
    assert job.result["start"] == resumed
    assert job.result["digests"] == clean.result["digests"], where  # every rank: dense and its experts
    assert job.result["losses"] == clean.result["losses"][resumed:], where
    assert memory.job_files(memory.job_key(str(job.run_dir.resolve()))) == []

"""``robust run`` + DeepSpeed ZeRO-3 (bf16, 2 ranks) with ``memory_every: 1`` and ``peer_backup``.

Two jobs for the module: a fault-free one, and one where, in this order, rank 1 is SIGKILLed at
one step, a rank hangs at a later one, rank 0 reports a NaN loss, and a rank reports a loss spike
(steps and hang/spike ranks drawn; ``ROBUST_TEST_SEED`` replays them): four restarts inside one
job. Each restart resumes inside ``deepspeed.initialize`` from each rank's own ZeRO-3 partitions
in shared memory: at most one step lost per fault, and the job ends bitwise equal to the
fault-free one (every rank's fp32 master partition, bf16 parameter partition and Adam state, and
the loss), although each incarnation builds its model from another seed and seeds its RNGs
differently. Silent data corruption has no replica to be checked against on ZeRO-3: both jobs
show the statement and the refusal a user gets instead (``patches/deepspeed_zero3.py``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import robust_run

from robust_plugins.checkpoint import memory

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

SCRIPT = str(Path(__file__).with_name("ds_zero3_train.py"))
#: A hang is declared after 3 s without progress once 3 steps were timed (ZeRO-3 steps here take
#: well under 0.3 s, so the learned timeout is the floor); before that, 60 s (start-up, restores).
WATCH = ["--watchdog", "hang_warmup_steps=3", "--watchdog", "hang_min_timeout_s=3",
         "--watchdog", "hang_initial_timeout_s=60", "--watchdog", "spike_warmup_steps=3"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    import os

    env = os.environ.get("ROBUST_TEST_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(2**32)
    draw = random.Random(seed)
    # The kill leaves the restarted incarnation at least 3 timed steps before the hang (the hang
    # timeout's warm-up). The spike comes at the NaN rollback's second or third step, before the
    # restarted ranks reported spike_warmup_steps values, and is the third-to-last step: a rank
    # holds there only with the monitor's spike windows (hold.py); with an empty window of its own
    # it trained on, the ranks could finish the job before the monitor's rollback, and the step
    # before the spike was evicted from memory (3 slots), so no restore came from memory.
    kill = draw.randrange(3, 5)
    hang = kill + 6 + draw.randrange(2)
    nan = hang + 2 + draw.randrange(2)
    spike = nan + 1 + draw.randrange(2)
    steps = spike + 2
    hang_rank, spike_rank = draw.randrange(2), draw.randrange(2)
    faults = {"kill": (1, kill), "hang": (hang_rank, hang), "nan": (0, nan), "spike": (spike_rank, spike)}
    where = (f"({', '.join(f'{k}:rank={r},step={s}' for k, (r, s) in faults.items())}, "
             f"ROBUST_TEST_SEED={seed})")
    print(where)
    root = tmp_path_factory.mktemp("zero3_faults")
    args = [SCRIPT, "--steps", str(steps)]
    clean = robust_run(root / "clean", 2, "--max-restarts", "0", timeout_s=120, script=args)
    injects = [x for k, (r, s) in faults.items() for x in ("--inject", f"{k}:rank={r},step={s}")]
    job = robust_run(root / "faults", 2, "--max-restarts", "4", *injects, *WATCH, timeout_s=240, script=args)
    return clean, job, faults, where


def _restores(job) -> list[dict]:
    path = job.run_dir / "restores.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_fault_free_zero3_job_completes(jobs):
    clean, _, _, _ = jobs
    assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
    assert clean.result["started_at"] == 1 and "in-memory snapshots skipped" in clean.output


def test_kill_hang_nan_and_spike_are_recovered_from_memory_with_at_most_one_step_lost(jobs):
    _, job, faults, where = jobs
    assert job.returncode == 0, f"{where}\n{job.output[-4000:]}"
    kinds = [(f["kind"], f["step"], f["suspect_ranks"]) for f in job.faults]
    expected = [("crash" if k == "kill" else k, s, [r]) for k, (r, s) in faults.items()]
    assert kinds == expected, (where, kinds)
    hang = job.faults[1]
    assert hang["detail"]["timeout_s"] >= 3.0 and "never entered" in hang["detail"]["reason"], (where, hang)
    spike = job.faults[3]
    assert spike["detail"]["what"] == "loss" and spike["detail"]["value"] > 100 * spike["detail"]["median"], where
    by_inc: dict[int, list[dict]] = {}
    for r in _restores(job):
        by_inc.setdefault(r["incarnation"], []).append(r)
    assert sorted(by_inc) == [1, 2, 3, 4], (where, by_inc)
    for inc, (kind, (_, at)) in enumerate(faults.items(), start=1):
        rs = by_inc[inc]
        assert sorted(r["rank"] for r in rs) == [0, 1], (where, rs)
        assert {r["source"].split(":")[0] for r in rs} <= {"memory", "peer"}, (where, rs)
        (step,) = {r["step"] for r in rs}
        # A crash or a hang loses at most the step in flight; a NaN or a spike rolls back to the
        # step before it (its snapshot may hold the update).
        low, high = (at - 1, at) if kind in ("kill", "hang") else (at - 1, at - 1)
        assert low <= step <= high, (where, inc, rs)
        assert job.faults[inc - 1]["resumed_at_step"] == step + 1, (where, job.faults[inc - 1], rs)


def test_restarted_ranks_judge_spikes_with_the_monitors_windows(jobs):
    """The spike came before the restarted ranks had reported spike_warmup_steps values: each rank
    of the last incarnation started its spike rule from the monitor's windows (with the values of
    every incarnation before it), so it could hold at the spike (hold.py)."""
    _, job, _, where = jobs
    windows = json.loads((job.run_dir / "spike_windows.json").read_text())
    assert windows["incarnation"] == 4 and sorted(windows["ranks"]) == ["0", "1"], (where, windows)
    # Steps 1..spike-1 of the earlier incarnations, less the NaN: far beyond the warm-up of 3.
    assert all(len(w["loss"]) >= 8 for w in windows["ranks"].values()), (where, windows)
    assert "cannot take over the monitor's spike windows" not in job.output, where


def test_recovered_zero3_job_ends_bitwise_equal_to_the_fault_free_one(jobs):
    clean, job, _, where = jobs
    assert job.returncode == 0, where
    assert job.result["hashes"] == clean.result["hashes"], where  # every rank's partitions and Adam state
    assert job.result["final_loss"] == clean.result["final_loss"], where
    assert len(set(clean.result["hashes"])) == 2  # two ranks, two different partitions


def test_zero3_says_silent_data_corruption_is_not_checked_and_refuses_check_params(jobs):
    """ZeRO-3 partitions have no replica: the snapshot check is announced off (verify_replicas is
    on by default) and watchdog.check_params raises instead of hashing empty placeholders."""
    clean, job, _, where = jobs
    for j in (clean, job):
        assert ("in-memory snapshots are not checked against the replicas: DeepSpeed ZeRO-3 partitions"
                in j.output), where
        said = j.result["check_params"]
        assert said.startswith("robust_plugins.watchdog.check_params: DeepSpeed ZeRO-3 partitions"), said
        assert "silent data corruption is not detected on ZeRO-3" in said and "ZeRO stage 0, 1 or 2" in said
    assert not any(f["kind"] == "sdc" for f in job.faults)


def test_zero3_jobs_leave_no_shared_memory(jobs):
    clean, job, _, _ = jobs
    for j in (clean, job):
        assert memory.job_files(memory.job_key(str(j.run_dir.resolve()))) == []

"""SDC replay: after a parameter-hash mismatch the job rolls back and replays the step; the
replayed check tells a transient fault (replicas agree now) from a persistent one (the same rank
differs again, which stops a single-node job with action ``evict`` instead of restarting forever)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault]

#: 3 ranks: the smallest job where a minority hash names one rank (2 replicas have no majority).
ARGS = ["--steps", "22", "--save-every", "10", "--corpus-bytes", "200000"]


def _evidence(fault: dict) -> dict:
    (path,) = [p for p in fault["evidence"] if "replay-step" in p]
    return json.loads(Path(path).read_text())


def test_a_one_time_bit_flip_is_replayed_and_judged_transient(tmp_path):
    job = robust_run(tmp_path, 3, "--max-restarts", "2", "--watchdog", "sdc_every_steps=5",
                     "--inject", "bitflip:rank=2,step=17", recipe_args=ARGS, timeout_s=150)
    assert job.returncode == 0, job.output[-3000:]
    (sdc,) = job.faults
    assert (sdc["kind"], sdc["suspect_ranks"], sdc["step"], sdc["action"]) == ("sdc", [2], 20, "rollback")
    assert sdc["resumed_at_step"] == 11
    assert sdc["detail"]["replay"]["verdict"] == "transient", sdc
    ev = _evidence(sdc)
    before, after = ev["hashes_at_detection"], ev["hashes_at_replay"]
    assert before["2"] != before["0"] == before["1"]  # the flipped replica was the odd one out
    # The replay from checkpoint 10 reproduced the healthy replicas' step 20 bitwise, on every rank.
    assert after == {"0": before["0"], "1": before["0"], "2": before["0"]}
    assert ev["replayed_in_incarnation"] == 1
    assert len(job.worker_pids()) == 6  # two incarnations


def test_a_stuck_bit_corrupts_the_replay_again_and_the_job_stops_with_evict(tmp_path):
    job = robust_run(tmp_path, 3, "--max-restarts", "3", "--watchdog", "sdc_every_steps=5",
                     "--inject", "stuckbit:rank=1,step=17", recipe_args=ARGS, timeout_s=150)
    assert job.returncode != 0
    first, evict = job.faults
    assert (first["kind"], first["suspect_ranks"], first["action"]) == ("sdc", [1], "rollback")
    assert first["detail"]["replay"]["verdict"] == "persistent"
    assert (evict["kind"], evict["suspect_ranks"], evict["step"], evict["action"]) == ("sdc", [1], 20, "evict")
    ev = _evidence(first)
    assert ev["hashes_at_replay"]["1"] != ev["hashes_at_replay"]["0"] == ev["hashes_at_replay"]["2"]
    # The corrupted value is the same both times: the same bit of the same state.
    assert ev["hashes_at_replay"]["1"] == ev["hashes_at_detection"]["1"]
    assert "persistent silent data corruption" in job.output and "evicted" in job.output
    # Stopped after the replay although two more restarts were allowed.
    assert len(job.worker_pids()) == 6


def test_replay_off_keeps_the_plain_rollback(tmp_path):
    job = robust_run(tmp_path, 3, "--max-restarts", "2", "--watchdog", "sdc_every_steps=5",
                     "--watchdog", "sdc_replay=false", "--inject", "bitflip:rank=0,step=17",
                     recipe_args=ARGS, timeout_s=150)
    assert job.returncode == 0, job.output[-3000:]
    (sdc,) = job.faults
    assert sdc["action"] == "rollback" and sdc["suspect_ranks"] == [0] and "replay" not in sdc["detail"]
    assert not (tmp_path / "sdc").exists()

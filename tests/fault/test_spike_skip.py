"""``robust run`` end to end: a batch that spikes again after the rollback is recorded and
skipped by the restarted ranks; the run then equals one that skipped that batch from the start."""

from __future__ import annotations

import json

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]

ARGS = ["--steps", "30", "--save-every", "10", "--corpus-bytes", "200000"]


def test_a_batch_that_spikes_twice_is_skipped_and_the_run_completes(tmp_path):
    job = robust_run(tmp_path / "faults", 2, "--max-restarts", "2", "--inject", "badbatch:rank=1,step=25",
                     "--watchdog", "spike_warmup_steps=5", recipe_args=ARGS, timeout_s=200)
    assert job.returncode == 0, job.output[-3000:]
    first, second = job.faults
    for f in (first, second):
        assert (f["kind"], f["step"], f["suspect_ranks"], f["action"]) == ("spike", 25, [1], "rollback")
        assert f["resumed_at_step"] == 21
    assert first["detail"]["skip_batch"] is False and second["detail"]["skip_batch"] is True
    assert json.loads((job.run_dir / "skip_steps.json").read_text())["steps"] == [25]
    assert "skipping the batch of step 25" in job.output
    assert len(job.worker_pids()) == 6
    losses = job.result["losses"]
    assert "25" not in losses and "24" in losses and "26" in losses

    # The same job told from its start to skip step 25 (a relaunch into a run directory that
    # recorded it): bitwise the same end, so the skip is exactly "no update from that batch".
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    (ref_dir / "skip_steps.json").write_text(json.dumps({"steps": [25]}))
    ref = robust_run(ref_dir, 2, "--max-restarts", "0", recipe_args=ARGS, timeout_s=120)
    assert ref.returncode == 0 and ref.faults == [], ref.output[-3000:]
    assert job.result["final_loss"] == ref.result["final_loss"]
    assert job.result["params_hash"] == ref.result["params_hash"]

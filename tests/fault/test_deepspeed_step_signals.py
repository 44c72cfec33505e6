"""``robust run`` with a DeepSpeed script that never calls the watchdog: the engine (a
``robust_plugins`` block) reports step, loss and gradient norm by itself and asks before saving,
so injected NaN and loss spikes are detected, rolled back and the run ends as a fault-free one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]

SCRIPT = str(Path(__file__).with_name("ds_auto_train.py"))
ARGS = ["--steps", "30", "--save-every", "10", "--gas", "2"]


def _rank_out(job, rank: int) -> dict:
    return json.loads(Path(f"{job.run_dir / 'result.json'}.rank{rank}").read_text())


def test_engine_signals_catch_nan_and_spike_in_a_script_without_step_end(tmp_path):
    clean = robust_run(tmp_path / "clean", 2, "--max-restarts", "0", script=[SCRIPT, *ARGS], timeout_s=150)
    assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
    for rank in (0, 1):
        out = _rank_out(clean, rank)
        latest = out["latest"]
        # The engine's report of its last step: step number, this rank's mean micro-batch loss.
        assert latest["step"] == 30 and latest["grad_norm"] is not None and latest["grad_norm"] > 0
        assert latest["loss"] == pytest.approx(out["losses"]["30"], rel=1e-6)
        assert latest["step_time"] is not None and latest["step_time"] > 0

    # The values are only *reported* wrong (the model is untouched): detection needs the engine's
    # signals, and the final result must be the clean run's.
    job = robust_run(tmp_path / "faults", 2, "--max-restarts", "2",
                     "--inject", "nan:rank=1,step=12", "--inject", "spike:rank=0,step=24,what=loss",
                     "--watchdog", "spike_warmup_steps=5", script=[SCRIPT, *ARGS], timeout_s=260)
    assert job.returncode == 0, job.output[-3000:]
    nan, spike = job.faults
    assert (nan["kind"], nan["suspect_ranks"], nan["step"], nan["action"]) == ("nan", [1], 12, "rollback")
    assert nan["detail"]["what"] == "loss"
    # No checkpoint of step 20 was written after the NaN (the save asked first): back to 10.
    assert nan["resumed_at_step"] == 11
    assert (spike["kind"], spike["suspect_ranks"], spike["step"]) == ("spike", [0], 24)
    assert spike["detail"]["what"] == "loss" and spike["resumed_at_step"] == 21
    assert spike["detail"]["value"] > 100 * spike["detail"]["median"]  # a real loss, x1000
    assert len(job.worker_pids()) == 6
    assert job.result["started_at"] == 21
    assert job.result["final_loss"] == clean.result["final_loss"]
    assert job.result["params_hash"] == clean.result["params_hash"]

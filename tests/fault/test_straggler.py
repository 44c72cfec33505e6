"""``robust run`` end to end: a rank slowed outside its collectives is reported as a straggler
(rank and host, action ``report``) while training goes on to the fault-free result."""

from __future__ import annotations

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault]

SLOW_S = 0.25  # the injected sleep a step, outside any collective


def test_slow_rank_is_reported_as_a_straggler_and_training_is_not_disturbed(tmp_path, baseline_2):
    job = robust_run(tmp_path, 2, "--max-restarts", "0", "--inject", f"slow:rank=1,step=8,seconds={SLOW_S}",
                     "--watchdog", "straggler_window=8",
                     # ~32 slow steps of 0.25 s+: a 2 s minimum (the default 10 s may outlast the job)
                     "--watchdog", "straggler_min_s=2", timeout_s=150, stragglers=True)
    assert job.returncode == 0, job.output[-3000:]
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["action"]) == ("straggler", [1], "report")
    assert fault["suspect_hosts"] and fault["resumed_at_step"] is None
    # Both ranks take the same time a step (rank 0 waits in the gradient all-reduce); only the
    # compute time, step time minus time in collectives, names rank 1.
    detail = fault["detail"]
    # straggler_factor (2.0 by default) is the detector's threshold; the gap between rank 1 and its
    # peers is the injected sleep (half of it as the bound: a loaded machine slows both sides)
    assert detail["ratio"] > 2.0 and detail["compute_s"] > 2.0 * detail["peers_compute_s"]
    assert detail["compute_s"] - detail["peers_compute_s"] > 0.5 * SLOW_S, detail
    # One row for the whole episode, written when it ended (the rank stayed slow to the job's end):
    # its first slow step, every slow step counted, its duration.
    assert 8 <= fault["step"] <= 8 + 2 and detail["ended"] == "job end", detail
    assert detail["slow_steps"] >= detail["reported_at_step"] - fault["step"] - 2, detail
    assert detail["duration_s"] >= 0.5 * SLOW_S * (detail["slow_steps"] - 1), detail
    assert "1 fault(s) recovered" not in job.output and "0 fault(s) recovered" in job.output
    # A report never restarts: one incarnation, and the result of the run that was never slow.
    assert len(job.worker_pids()) == 2
    assert job.result["final_loss"] == baseline_2["final_loss"]
    assert job.result["params_hash"] == baseline_2["params_hash"]

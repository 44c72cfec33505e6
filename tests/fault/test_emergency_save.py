"""Emergency checkpoint before a restart: rank 1 dies, rank 0 (a live replica) saves the last step.

The script checkpoints only every 100 steps (so there is no recent checkpoint at all) and
registers ``watchdog.on_emergency``; the state is replicated (plain data parallelism), so the one
file rank 0 writes when its gradient all-reduce fails restores both ranks at that step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

SCRIPT = str(Path(__file__).with_name("elastic_train.py"))
STEPS = 12


def _job(tmp_path: Path, *script_args: str):
    return robust_run(tmp_path, 2, "--max-restarts", "1", "--inject", "kill:rank=1,step=6",
                      timeout_s=90, script=[SCRIPT, "--steps", str(STEPS), "--save-every", "100",
                                            *script_args])


def _params(run_dir: Path):
    return json.loads((run_dir / "result.json").read_text())["params"]


@pytest.mark.timeout(200)
def test_live_rank_saves_before_the_restart_and_the_job_resumes_there(tmp_path):
    # Rank 0 sleeps 0.5 s after each step, so it is still asleep, before its failing all-reduce,
    # when torch's poll sees rank 1 die: the stop must wait for its save to start (it once
    # SIGTERMed the survivor 40 ms after the death, its save "not started").
    job = _job(tmp_path / "emergency", "--emergency", "--step-sleep", "0.5")
    assert job.returncode == 0, job.output[-4000:]
    (crash,) = [f for f in job.faults if f["kind"] == "crash"]
    assert crash["suspect_ranks"] == [1]
    saves = crash["detail"]["emergency_save"]
    assert saves["0"]["ok"] is True and saves["0"]["step"] == 6, saves
    # The stop waited for the save, and no longer than it took (well under the 30 s bound).
    assert 0 < crash["detail"]["emergency_hold_s"] <= crash["detail"]["stop_s"] < 15, crash["detail"]
    assert saves["1"]["ok"] is False  # the dead rank saved nothing
    assert crash["resumed_at_step"] == 7 and crash["lost_steps"] == 0, crash
    assert "rank 0 emergency save of step 6 done" in job.output
    # Control: without the emergency save the restart starts over (no checkpoint at all).
    plain = _job(tmp_path / "plain")
    assert plain.returncode == 0, plain.output[-4000:]
    (crash2,) = [f for f in plain.faults if f["kind"] == "crash"]
    assert crash2["detail"]["emergency_save"] is None
    assert "emergency_hold_s" not in crash2["detail"]  # no saver registered: no wait
    assert crash2["resumed_at_step"] == 1, crash2
    # Both end with the same parameters (float64, same sums in the same order).
    for g, w in zip(_params(tmp_path / "emergency"), _params(tmp_path / "plain"), strict=True):
        assert all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-14) for x, y in zip(g, w, strict=True))


@pytest.mark.timeout(120)
def test_nccl_like_survivor_that_never_raises_saves_when_the_monitor_asks(tmp_path):
    # The NCCL path on gloo: rank 0's host waits for its all-reduce and never sees an exception
    # (--nccl-like), so the exception path cannot save. The monitor asks its listener instead
    # (ROBUST_EMERGENCY_VIA=monitor: what `auto` does for a rank whose collectives move CUDA
    # tensors), which saves step 6 while the training thread stays blocked.
    job = robust_run(tmp_path, 2, "--max-restarts", "1", "--inject", "kill:rank=1,step=6", timeout_s=100,
                     env={"ROBUST_EMERGENCY_VIA": "monitor"},
                     script=[SCRIPT, "--steps", str(STEPS), "--save-every", "100", "--emergency", "--nccl-like"])
    assert job.returncode == 0, job.output[-4000:]
    (crash,) = [f for f in job.faults if f["kind"] == "crash"]
    saves = crash["detail"]["emergency_save"]
    log = (tmp_path / "monitor.log").read_text(errors="replace")[-3000:]
    assert saves["0"].get("ok") is True and saves["0"]["step"] == 6 and saves["0"]["via"] == "monitor", \
        f"{saves}\n--- monitor.log ---\n{log}\n--- output ---\n{job.output[-3000:]}"
    assert crash["resumed_at_step"] == 7 and crash["lost_steps"] == 0, crash
    assert "rank 0 emergency save of step 6 done" in job.output and "(via monitor)" in job.output

"""A new ``robust run`` on the checkpoints of an earlier one keeps the learned hang timeout: the
DeepSpeed engine saves each rank's step times in its checkpoint and hands them to the fresh
monitor on load, so a hang right after the relaunch is caught after the learned timeout, not
after ``hang_initial_timeout_s``."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault, pytest.mark.timeout(270)]

SCRIPT = str(Path(__file__).with_name("ds_auto_train.py"))
WATCH = ["--watchdog", "hang_min_timeout_s=3", "--watchdog", "hang_initial_timeout_s=120",
         "--watchdog", "hang_warmup_steps=5"]


def test_relaunch_restores_the_learned_hang_timeout_from_the_checkpoint(tmp_path):
    run_dir = tmp_path / "job"
    first = robust_run(run_dir, 2, "--max-restarts", "0", *WATCH,
                       script=[SCRIPT, "--steps", "20", "--save-every", "10"], timeout_s=150)
    assert first.returncode == 0 and first.faults == [], first.output[-3000:]
    # A new launcher (its monitor has learned nothing) on the same checkpoints; rank 0 hangs at
    # the third step after the resume, long before a warm-up of 5 steps could be learned again.
    second = robust_run(run_dir, 2, "--max-restarts", "1", *WATCH, "--inject", "hang:rank=0,step=23",
                        script=[SCRIPT, "--steps", "30", "--save-every", "10"], timeout_s=200)
    assert second.returncode == 0, second.output[-3000:]
    (hang,) = second.faults
    assert (hang["kind"], hang["suspect_ranks"], hang["step"]) == ("hang", [0], 23)
    # Learned (>= the 3 s floor), not the 120 s initial timeout of a launcher without history.
    assert 3.0 <= hang["detail"]["timeout_s"] < 30.0
    assert hang["detected_after_s"] < 60.0
    assert hang["resumed_at_step"] == 21 and second.result["started_at"] == 21
    log = (run_dir / "monitor.log").read_text()
    assert "restored" in log and "step times from its checkpoint" in log

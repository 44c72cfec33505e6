"""``robust run`` with no restart flag recovers, warm: restarts are on by default (3) and served
by standby workers; ``--max-restarts 0`` still means none. The plain loop's warm recovery is
bitwise equal to a run without faults."""

from __future__ import annotations

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault, pytest.mark.timeout(150)]

#: The recipe saves every step (its own choice, not a launcher flag): a kill loses at most one.
EVERY_STEP = ["--steps", "40", "--save-every", "1", "--corpus-bytes", "200000"]


def test_the_defaults_alone_recover_a_sigkill_bitwise_losing_at_most_one_step(tmp_path, baseline_2):
    job = robust_run(tmp_path, 2, "--inject", "kill:rank=1,step=25", recipe_args=EVERY_STEP)
    assert job.returncode == 0, job.output[-3000:]
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["action"]) == ("crash", [1], "restart")
    assert fault["detail"]["signal"] == "SIGKILL"
    assert fault["detail"]["standby"] is True  # warm: the defaults include standby workers
    assert fault["lost_steps"] <= 1 and fault["resumed_at_step"] in (25, 26)
    assert job.result["final_loss"] == baseline_2["final_loss"]
    assert job.result["params_hash"] == baseline_2["params_hash"]


def test_max_restarts_0_still_means_no_restart(tmp_path):
    job = robust_run(tmp_path, 2, "--max-restarts", "0", "--inject", "kill:rank=1,step=5",
                     recipe_args=EVERY_STEP)
    assert job.returncode == 1, job.output[-3000:]
    assert "restart budget exhausted (--max-restarts 0)" in job.output
    assert [f["action"] for f in job.faults] == ["report"]

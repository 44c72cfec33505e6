"""A stalled pipeline stage under ``robust run``: the recipe's ``cpu-3d`` preset (PP 2 x DP 2 on 4
ranks, megatron's 1F1B). When one rank hangs, its pipeline neighbour blocks in megatron's p2p
(``p2p_communication.py``, no torch frame on the stack) and the other replica in the
data-parallel sync; the hang must be blamed on the stalled rank alone, not on the neighbour.
"""

from __future__ import annotations

import pytest
from conftest import robust_run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.fault]

SCRIPT = ["-m", "robust_plugins.recipes.megatron_gpt.train", "--preset", "cpu-3d", "--steps", "12",
          "--log-every", "0"]


@pytest.mark.timeout(150)
def test_a_stalled_stage_is_named_not_its_pipeline_neighbour(tmp_path, draw):
    rank = draw.randrange(4)
    where = f"(hang:rank={rank},step=6, ROBUST_TEST_SEED={draw.seed_value})"
    job = robust_run(tmp_path, 4, "--max-restarts", "0", "--inject", f"hang:rank={rank},step=6",
                     "--watchdog", "hang_warmup_steps=3", "--watchdog", "hang_min_timeout_s=3",
                     "--watchdog", "hang_initial_timeout_s=60", script=SCRIPT, timeout_s=120)
    (fault,) = job.faults
    assert (fault["kind"], fault["step"]) == ("hang", 6), (where, fault)
    assert fault["suspect_ranks"] == [rank], (where, fault["detail"]["reason"])
    assert "never entered" in fault["detail"]["reason"], where
    waiting = {int(r) for r, inside in fault["detail"]["in_collective"].items() if inside}
    assert waiting == {0, 1, 2, 3} - {rank}, (where, fault["detail"]["in_collective"])
    assert job.returncode != 0  # no restart allowed: the job ends after the report

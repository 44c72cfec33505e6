"""A stalled pipeline stage under ``robust run``: the recipe's ``cpu-3d`` preset (PP 2 x DP 2 on 4
ranks, megatron's 1F1B). One rank stalls inside its stage's forward in the middle of a step
(``mcore_stall_train.py``), so its pipeline neighbour blocks in megatron's p2p
(``p2p_communication.py``: the activation it waits for, or the gradient) and the other replica in
the data-parallel sync; the hang must be blamed on the stalled rank alone, not on the neighbour.
The same run shows each rank's pipeline stage named to the straggler detector (``pp0``/``pp1``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import robust_run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.fault]

STALL_STEP = 6
SCRIPT = [str(Path(__file__).with_name("mcore_stall_train.py")), "--preset", "cpu-3d", "--steps", "12",
          "--log-every", "0"]


@pytest.mark.timeout(150)
def test_a_stage_stalled_in_its_forward_is_named_not_its_pipeline_neighbour(tmp_path, draw):
    rank = draw.randrange(4)
    where = f"(stall rank {rank} in forward of step {STALL_STEP}, ROBUST_TEST_SEED={draw.seed_value})"
    job = robust_run(tmp_path, 4, "--max-restarts", "0",
                     "--watchdog", "hang_warmup_steps=3", "--watchdog", "hang_min_timeout_s=3",
                     "--watchdog", "hang_initial_timeout_s=60",
                     script=[SCRIPT[0], "--stall-rank", str(rank), "--stall-step", str(STALL_STEP), *SCRIPT[1:]],
                     timeout_s=120)
    assert f"rank {rank} stalls in its forward of step {STALL_STEP}" in job.output, (where, job.output[-3000:])
    (fault,) = job.faults
    assert (fault["kind"], fault["step"]) == ("hang", STALL_STEP), (where, fault)
    assert fault["suspect_ranks"] == [rank], (where, fault["detail"]["reason"])
    assert "never entered" in fault["detail"]["reason"], where
    waiting = {int(r) for r, inside in fault["detail"]["in_collective"].items() if inside}
    assert waiting == {0, 1, 2, 3} - {rank}, (where, fault["detail"]["in_collective"])
    # Its pipeline neighbour (pipeline stride 2) waits in megatron's p2p, not at the step's end.
    neighbour = (rank + 2) % 4
    (stack,) = [p for p in fault["evidence"] if f"rank{neighbour}." in Path(p).name and "hang-" in Path(p).name]
    assert "p2p_communication.py" in Path(stack).read_text(), (where, stack)
    # PP 2 x DP 2, pipeline stride 2 (order tp-cp-ep-dp-pp): ranks 0, 1 are stage 0; 2, 3 stage 1.
    assert fault["detail"]["straggler_groups"] == {"0": "pp0", "1": "pp0", "2": "pp1", "3": "pp1"}, where
    assert job.returncode != 0  # no restart allowed: the job ends after the report

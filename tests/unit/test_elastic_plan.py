"""The elastic-restart planner (``robust_plugins.checkpoint.elastic.plan_reshard``)."""

import pytest

from robust_plugins.checkpoint.elastic import DIRECT, UNIVERSAL, plan_reshard
from robust_plugins.errors import CheckpointError


def saved(**kw):
    base = {"where": "ckpt/t", "world_size": 4, "dp_world_size": 4, "zero_stage": 1, "train_batch_size": 32,
            "gradient_accumulation_steps": 1}
    return {**base, **kw}


def now(**kw):
    base = {"world_size": 2, "dp_world_size": 2, "zero_stage": 1, "micro_batch": 8}
    return {**base, **kw}


def test_same_dp_size_needs_nothing():
    assert plan_reshard(saved(), now(world_size=4, dp_world_size=4)) is None


@pytest.mark.parametrize("stage,method", [(0, DIRECT), (1, UNIVERSAL), (2, UNIVERSAL)])
def test_shrink_keeps_global_batch_by_accumulation(stage, method):
    plan = plan_reshard(saved(zero_stage=stage), now(zero_stage=stage))
    assert plan.method == method and plan.train_batch_size == 32 and plan.gradient_accumulation_steps == 2
    assert "from dp_world_size 4 to 2" in plan.message and "gradient_accumulation_steps 1 -> 2" in plan.message


def test_grow_lowers_accumulation():
    plan = plan_reshard(saved(world_size=2, dp_world_size=2, gradient_accumulation_steps=2),
                        now(world_size=4, dp_world_size=4))
    assert plan.gradient_accumulation_steps == 1


def test_indivisible_batch_names_the_allowed_sizes():
    with pytest.raises(CheckpointError, match=r"not a multiple of micro batch 8 x dp_world_size 3.*one of \[1, 2, 4\]"):
        plan_reshard(saved(), now(world_size=3, dp_world_size=3))


def test_model_parallel_change_and_stage_change_are_refused():
    with pytest.raises(CheckpointError, match="Only the data-parallel size may change"):
        plan_reshard(saved(world_size=8, dp_world_size=4), now(world_size=2, dp_world_size=2))
    with pytest.raises(CheckpointError, match="stage 1, this job runs stage 2"):
        plan_reshard(saved(), now(zero_stage=2))


def test_old_manifest_without_global_batch_is_refused():
    s = saved()
    del s["train_batch_size"]
    with pytest.raises(CheckpointError, match="without a recorded global batch.*Resume with 4"):
        plan_reshard(s, now())

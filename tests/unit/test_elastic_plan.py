"""The elastic-restart planner (``robust_plugins.checkpoint.elastic.plan_reshard``)."""

import pytest

from robust_plugins.checkpoint.elastic import DIRECT, DIST_CHECKPOINTING, UNIVERSAL, plan_megatron_reshard, plan_reshard
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


# ------------------------------------------------------------------------------ megatron-core
def msaved(**kw):
    base = {"where": "ckpt/iter_0000004", "world_size": 4, "tp": 1, "pp": 1, "dp": 4, "global_batch": 16,
            "micro_batch": 4, "gradient_accumulation_steps": 1}
    return {**base, **kw}


def mnow(**kw):
    base = {"world_size": 2, "tp": 1, "pp": 1, "dp": 2, "micro_batch": 4}
    return {**base, **kw}


def test_megatron_same_dp_needs_nothing():
    assert plan_megatron_reshard(msaved(), mnow(world_size=4, dp=4)) is None


def test_megatron_shrink_and_grow_keep_the_global_batch():
    shrink = plan_megatron_reshard(msaved(), mnow())
    assert (shrink.method, shrink.gradient_accumulation_steps, shrink.train_batch_size) == (DIST_CHECKPOINTING, 2, 16)
    assert "from dp 4 to 2 (dist_checkpointing); global batch 16 kept: gradient_accumulation_steps 1 -> 2" \
        in shrink.message
    grow = plan_megatron_reshard(msaved(world_size=2, dp=2, gradient_accumulation_steps=2),
                                 mnow(world_size=8, dp=8, micro_batch=2))
    assert grow.gradient_accumulation_steps == 1 and "2 -> 1 (micro batch 2)" in grow.message


def test_megatron_model_parallel_change_is_refused_naming_the_size():
    with pytest.raises(CheckpointError, match="tensor-parallel size 2, this job has 1.*launch with tp=2"):
        plan_megatron_reshard(msaved(tp=2, world_size=8), mnow())
    with pytest.raises(CheckpointError, match="pipeline-parallel size 2"):
        plan_megatron_reshard(msaved(pp=2, world_size=8), mnow())


def test_megatron_without_batch_sizes_is_refused_with_what_to_pass():
    s = msaved()
    del s["global_batch"]
    with pytest.raises(CheckpointError, match="without a recorded global batch.*pass global_batch= and micro_batch="):
        plan_megatron_reshard(s, mnow())
    with pytest.raises(CheckpointError, match="did not give its micro batch"):
        plan_megatron_reshard(msaved(), mnow(micro_batch=None))
    with pytest.raises(CheckpointError, match=r"dp may be one of \[1, 2, 4\]"):
        plan_megatron_reshard(msaved(), mnow(world_size=3, dp=3))


def test_megatron_checkpointer_batch_arguments_are_checked():
    from robust_plugins.errors import ConfigError
    from robust_plugins.megatron import _accumulation

    assert _accumulation(None, None, 4) is None
    assert _accumulation(32, 4, 4) == 2
    with pytest.raises(ConfigError, match="global_batch 30 is not a multiple of micro_batch 4 x data-parallel size 4"):
        _accumulation(30, 4, 4)
    with pytest.raises(ConfigError, match="micro_batch must be an int >= 1.*got None"):
        _accumulation(32, None, 4)

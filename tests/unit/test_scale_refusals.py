"""What stays refused with ZeRO-3 and the pipeline engine (no processes): each error names the key, the value and what is allowed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from robust_plugins.checkpoint.elastic import plan_reshard
from robust_plugins.config import PluginConfig
from robust_plugins.errors import CheckpointError, UnsupportedError


def _refuse(zero: dict, block: dict):
    from robust_plugins.patches.deepspeed_refuse import _refuse_before_init

    ds = {"zero_optimization": zero, "robust_plugins": block}
    _refuse_before_init({"config": ds}, PluginConfig.from_ds_config(ds))


def test_zero3_passes_before_init_and_unknown_stages_are_refused():
    pytest.importorskip("deepspeed")
    _refuse({"stage": 3}, {"checkpoint": {"memory_every": 1}})  # no error
    _refuse({"stage": 3}, {"compression": {"codec": "int8"}, "checkpoint": {"memory_every": 1}})
    with pytest.raises(UnsupportedError, match=r"zero_optimization.stage = 5 .*allowed: 0, 1, 2, 3"):
        _refuse({"stage": 5}, {"checkpoint": {"memory_every": 1}})


def _engine(**zero):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return SimpleNamespace(_config=SimpleNamespace(zero_config=DeepSpeedZeroConfig(stage=3, **zero)),
                           has_moe_layers=False, zero_quantized_gradients=lambda: zero.get("zero_quantized_gradients",
                                                                                           False))


@pytest.mark.parametrize("key,device", [("offload_optimizer", "cpu"), ("offload_optimizer", "nvme"),
                                        ("offload_param", "cpu"), ("offload_param", "nvme")])
def test_zero3_snapshots_refuse_offloaded_partitions(key, device, tmp_path):
    pytest.importorskip("deepspeed")
    from robust_plugins.patches import deepspeed_zero3

    engine = _engine(**{key: {"device": device, "nvme_path": str(tmp_path)}})
    with pytest.raises(UnsupportedError) as info:
        deepspeed_zero3.check_engine(engine, "checkpoint.memory_every")
    msg = str(info.value)
    assert f"zero_optimization.{key}.device = '{device}'" in msg and "allowed:" in msg, msg
    deepspeed_zero3.check_engine(_engine(), "checkpoint.memory_every")  # no offload: accepted
    with pytest.raises(UnsupportedError, match=r"zero_hpz_partition_size = 2 .*allowed: 1"):
        deepspeed_zero3.check_engine(_engine(zero_hpz_partition_size=2), "checkpoint.memory_every")


def test_resharding_zero3_goes_through_the_universal_checkpoint():
    from robust_plugins.checkpoint.elastic import UNIVERSAL

    saved = {"where": "ckpt/global_step8", "world_size": 4, "dp_world_size": 4, "zero_stage": 3,
             "train_batch_size": 32, "gradient_accumulation_steps": 1}
    now = {"world_size": 2, "dp_world_size": 2, "zero_stage": 3, "micro_batch": 8}
    plan = plan_reshard(saved, now)
    assert (plan.method, plan.gradient_accumulation_steps, plan.train_batch_size) == (UNIVERSAL, 2, 32)
    assert plan_reshard(saved, {**now, "world_size": 4, "dp_world_size": 4}) is None  # same size: loads
    with pytest.raises(CheckpointError, match="resharding keeps the stage"):
        plan_reshard(saved, {**now, "zero_stage": 2})


@pytest.mark.parametrize("block,needle", [
    ({"compression": {"codec": "int8", "overlap": True}}, "compression.overlap = true; allowed there: false"),
    ({"compression": {"codec": "sign", "sign_mode": "momentum", "freeze_steps": 2}},
     "compression.sign_mode = 'momentum'; allowed there: 'gradient'"),
])
def test_pipeline_compression_refuses_what_was_not_verified(block, needle):
    from robust_plugins.patches.deepspeed_refuse import _refuse_pipeline

    with pytest.raises(UnsupportedError) as info:
        _refuse_pipeline(PluginConfig.from_ds_config({"robust_plugins": block}))
    assert needle in str(info.value) and "pipeline engine" in str(info.value)
    for served in ({"compression": {"codec": "int8"}}, {"compression": {"codec": "auto"}},
                   {"compression": {"codec": "int8"}, "topology": {"hierarchical": True}}):
        _refuse_pipeline(PluginConfig.from_ds_config({"robust_plugins": served}))  # test_deepspeed_pipeline.py


@pytest.mark.parametrize("block,zero,needle", [
    ({"compression": {"codec": "sign"}}, {}, "compression.codec = 'sign' is not wired for ZeRO-3's reduce-scatter; "
                                             "allowed there: none, int8, int4, auto"),
    ({"compression": {"codec": "bf16"}}, {}, "compression.codec = 'bf16'"),
    ({"compression": {"codec": "int8", "overlap": True}}, {}, "compression.overlap = true"),
    ({"compression": {"codec": "int8"}}, {"reduce_scatter": False}, "zero_optimization.reduce_scatter = false"),
    ({"compression": {"codec": "int8"}}, {"zero_quantized_gradients": True},
     "zero_optimization.zero_quantized_gradients = true (DeepSpeed's qgZ); allowed: false"),
])
def test_zero3_compression_refusals_name_key_value_allowed(block, zero, needle):
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace as NS

    from robust_plugins.patches.deepspeed_zero3_reduce import unsupported_reason

    plugin = NS(config=PluginConfig.from_ds_config({"robust_plugins": block}))
    assert needle in unsupported_reason(_engine(**zero), plugin)
    ok = NS(config=PluginConfig.from_ds_config({"robust_plugins": {"compression": {"codec": "int8"}}}))
    assert unsupported_reason(_engine(), ok) is None


@pytest.mark.parametrize("block", [
    {"compression": {"codec": "auto"}},
    {"compression": {"codec": "int8"}, "topology": {"hierarchical": True}},
    {"compression": {"codec": "auto"}, "topology": {"hierarchical": True}},
])
def test_zero3_serves_auto_and_the_hierarchy(block):
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace as NS

    from robust_plugins.patches.deepspeed_zero3_reduce import unsupported_reason

    assert unsupported_reason(_engine(), NS(config=PluginConfig.from_ds_config({"robust_plugins": block}))) is None


def test_zero3_refuses_an_explicit_replica_check_and_names_why():
    pytest.importorskip("deepspeed")
    from robust_plugins.patches import deepspeed_zero3

    asked = PluginConfig.from_ds_config({"robust_plugins": {"checkpoint": {"memory_every": 1,
                                                                           "verify_replicas": True}}})
    with pytest.raises(UnsupportedError) as info:
        deepspeed_zero3.refuse_sdc(asked.checkpoint)
    msg = str(info.value)
    assert "checkpoint.verify_replicas = true with ZeRO-3" in msg and "no rank holds a replica" in msg, msg
    assert "Allowed with ZeRO-3: false or unset" in msg, msg
    for block in ({"memory_every": 1}, {"memory_every": 1, "verify_replicas": False}):  # default or off: accepted
        deepspeed_zero3.refuse_sdc(PluginConfig.from_ds_config({"robust_plugins": {"checkpoint": block}}).checkpoint)



def test_zero3_refuses_parameter_fault_injections_and_check_params():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from robust_plugins.patches.deepspeed_watchdog import _refuse_sdc_on_zero3
    from robust_plugins.watchdog.inject import parse_one

    zero3 = SimpleNamespace(optimizer=DeepSpeedZeroOptimizer_Stage3.__new__(DeepSpeedZeroOptimizer_Stage3))
    client = SimpleNamespace(params_refused=None, injections=SimpleNamespace(params=[]))
    _refuse_sdc_on_zero3(zero3, client)  # no parameter fault armed: accepted, check_params refused
    assert "no rank holds a replica" in client.params_refused
    client.injections.params = [parse_one("bitflip:rank=0,step=3")]
    with pytest.raises(UnsupportedError) as info:
        _refuse_sdc_on_zero3(zero3, client)
    msg = str(info.value)
    assert "--inject bitflip:rank=0,step=3" in msg and "silent data corruption is not detected on ZeRO-3" in msg, msg
    assert "Allowed on ZeRO-3: kill, hang, nan, spike, slow, badbatch." in msg, msg
    other = SimpleNamespace(params_refused=None, injections=client.injections)
    _refuse_sdc_on_zero3(SimpleNamespace(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)), other)
    assert other.params_refused is None  # not ZeRO-3: the replica checks serve it


@pytest.mark.parametrize("what", ["checkpoint.memory_every", "MegatronCheckpointer"])
def test_megatron_overlap_param_gather_is_refused_for_snapshots_and_saves(what):
    """megatron's DistributedOptimizer with overlap_param_gather: after the step only the rank's own
    shard is updated until the next forward's all-gather, so a capture then differs between the
    replicas (a false SDC rollback at every snapshot). Refused, naming the key; False passes."""
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from robust_plugins.patches import megatron_optim

    def distopt(overlap: bool):
        opt = DistributedOptimizer.__new__(DistributedOptimizer)  # the fields check reads, no process group
        opt.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        opt.config = SimpleNamespace(use_precision_aware_optimizer=False)
        opt.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                                                       overlap_param_gather=overlap)
        return opt

    megatron_optim.check(distopt(False), what)
    with pytest.raises(UnsupportedError, match=rf"^{what}: overlap_param_gather = True .*\(allowed: False\)"):
        megatron_optim.check(distopt(True), what)

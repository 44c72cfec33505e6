"""megatron-core patch guards, in one process: version refusal, CPU-shim refusal on CUDA, undo."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from robust_plugins.errors import ConfigError, HostVersionError, UnsupportedError  # noqa: E402
from robust_plugins.patches import megatron as patch  # noqa: E402
from robust_plugins.patches import megatron_cpu  # noqa: E402


@pytest.mark.parametrize("version", [f"{patch.RANGE.minimum[0]}.{patch.RANGE.minimum[1] - 1}.2", "0.17.0", "1.0.0rc1"])
def test_enable_refuses_unsupported_megatron_versions(monkeypatch, version):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", version)
    with pytest.raises(HostVersionError) as err:
        patch.enable(object(), {"compression": {"codec": "int8"}})
    msg = str(err.value)
    assert f"found megatron-core {version}" in msg and patch.RANGE.spec in msg
    with pytest.raises(HostVersionError):
        megatron_cpu.install()


def test_enable_refuses_a_changed_signature(monkeypatch):
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    def start_grad_sync(self, force_all_reduce, extra):  # a future megatron-core's new parameter
        pass

    monkeypatch.setattr(_ParamAndGradBucketGroup, "start_grad_sync", start_grad_sync)
    with pytest.raises(HostVersionError, match="start_grad_sync"):
        patch.check_megatron_version()


def test_enable_refuses_what_is_not_megatron_ddp():
    with pytest.raises(ConfigError, match="DistributedDataParallel"):
        patch.enable(torch.nn.Linear(2, 2), {"compression": {"codec": "int8"}})


def test_cpu_shim_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UnsupportedError, match="CUDA is available"):
        megatron_cpu.install()
    assert not megatron_cpu.active()


def test_cpu_shim_installs_once_and_undoes():
    from megatron.core.tensor_parallel import random as tp_random

    before = (torch.cuda.current_device, tp_random._get_cuda_rng_state, tp_random.torch)
    megatron_cpu.install()
    try:
        megatron_cpu.install()  # idempotent
        assert torch.cuda.current_device() == "cpu"
        assert tp_random._get_cuda_rng_state.__wrapped__ is before[1]
        # The tracker keeps CPU generator states: forking restores the default stream afterwards.
        tracker = tp_random.get_cuda_rng_tracker()
        tracker.reset()
        tracker.add("model-parallel-rng", 123)
        torch.manual_seed(7)
        expected = torch.rand(3)
        torch.manual_seed(7)
        with tracker.fork():
            forked = torch.rand(3)
        assert torch.equal(torch.rand(3), expected) and not torch.equal(forked, expected)
    finally:
        megatron_cpu.undo()
    assert (torch.cuda.current_device, tp_random._get_cuda_rng_state, tp_random.torch) == before


def test_cpu_shim_covers_schedules_optimizers_and_tensor_cuda_and_undoes():
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, grad_scaler
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.pipeline_parallel import schedules

    modules = (schedules, mcore_optimizer, clip_grads, grad_scaler, mcore_utils)
    inits = (mcore_optimizer.Float16OptimizerWithFloat16Params.__init__, DistributedOptimizer.__init__)
    clip = clip_grads.clip_grad_by_total_norm_fp32
    t = torch.ones(2)
    with pytest.raises((AssertionError, RuntimeError)):  # torch without CUDA: the literals raise
        schedules.torch.zeros([], dtype=torch.int, device="cuda")
    megatron_cpu.install()
    try:
        for m in modules:  # the device="cuda" literals of each module land on the CPU
            assert m.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
            assert m.torch.tensor([1.0], device="cuda").device.type == "cpu"
            assert m.torch.Tensor is torch.Tensor and m.torch.float32 is torch.float32
        assert torch.zeros(1).device.type == "cpu" and t.cuda() is t  # Tensor.cuda: no move
        assert t.type() == "torch.FloatTensor"  # outside the three wrapped calls, torch's own answer
        seen = []
        with megatron_cpu._cuda_type_names():
            seen += [t.type(), t.bfloat16().type(), t.long().type(), t.type(torch.float64).dtype]
        assert seen == ["torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor", "torch.LongTensor", torch.float64]
        assert t.type() == "torch.FloatTensor"
        assert mcore_optimizer.Float16OptimizerWithFloat16Params.__init__.__wrapped__ is inits[0]
        # both bindings of the clipping function (optimizer.py calls the name it imported)
        assert clip_grads.clip_grad_by_total_norm_fp32.__wrapped__ is clip
        assert mcore_optimizer.clip_grad_by_total_norm_fp32.__wrapped__ is clip
    finally:
        megatron_cpu.undo()
    assert all(m.torch is torch for m in modules)
    assert "cuda" not in vars(torch.Tensor) and "type" not in vars(torch.Tensor)
    assert (mcore_optimizer.Float16OptimizerWithFloat16Params.__init__, DistributedOptimizer.__init__) == inits
    assert clip_grads.clip_grad_by_total_norm_fp32 is clip is mcore_optimizer.clip_grad_by_total_norm_fp32


@pytest.mark.parametrize("block", [
    {"compression": {"codec": "auto"}},
    {"compression": {"codec": "int8"}, "topology": {"hierarchical": True}},
    {"compression": {"codec": "auto"}, "topology": {"hierarchical": True}},
])
def test_auto_and_hierarchical_are_served_with_and_without_the_distributed_optimizer(block):
    from types import SimpleNamespace

    for distopt in (True, False):  # the reduce-scatter and the all-reduce path
        ddp = SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=distopt, overlap_grad_reduce=False))
        patch._refuse_config(patch._as_plugin_config(block), ddp)


def test_distributed_optimizer_checkpoint_fixes_install_once_and_undo(monkeypatch):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from robust_plugins.patches import megatron_optim

    names = ("_set_main_param_and_optimizer_states", "load_state_dict")
    before = {n: vars(DistributedOptimizer)[n] for n in names}
    megatron_optim.install()
    try:
        megatron_optim.install()  # idempotent
        for n in names:
            assert getattr(DistributedOptimizer, n).__wrapped__ is before[n]
    finally:
        megatron_optim.undo()
    assert {n: vars(DistributedOptimizer)[n] for n in names} == before

    def changed(self, model_param, tensors, extra):  # a future megatron-core's new parameter
        pass

    monkeypatch.setattr(DistributedOptimizer, "_set_main_param_and_optimizer_states", changed)
    with pytest.raises(HostVersionError, match=r"written for \(self, model_param, tensors\)"):
        megatron_optim.install()
    assert vars(DistributedOptimizer)["load_state_dict"] is before["load_state_dict"]  # nothing half-installed

"""1-bit Adam (``compression.sign_mode: momentum``): config checks, the optimizer check and the step.

Without a process group :func:`compressed_all_reduce` still encodes and decodes (with both error
feedbacks), so one process exercises the codec path the ranks run.
"""

import pytest
import torch

from robust_plugins.comm.momentum import SignMomentumAdam, check_optimizer
from robust_plugins.config import PluginConfig
from robust_plugins.errors import ConfigError, UnsupportedError

MOMENTUM = {"codec": "sign", "sign_mode": "momentum", "freeze_steps": 20}


def test_momentum_mode_config_is_accepted_and_described():
    cfg = PluginConfig.from_dict({"compression": MOMENTUM})
    assert cfg.compression.sign_mode == "momentum" and cfg.compression.freeze_steps == 20
    assert "sign_mode=momentum, freeze_steps=20" in cfg.describe()
    assert PluginConfig.from_dict({"compression": {"codec": "sign"}}).compression.sign_mode == "gradient"


@pytest.mark.parametrize("block,words", [
    ({"codec": "sign", "sign_mode": "momentun"}, ["sign_mode", "Did you mean 'momentum'"]),
    ({"codec": "sign", "sign_mode": 1}, ["sign_mode", "a string"]),
    ({"codec": "int8", "sign_mode": "momentum", "freeze_steps": 5}, ["needs codec = 'sign'", "'int8'"]),
    ({"codec": "sign", "sign_mode": "momentum"}, ["freeze_steps = 0", ">= 1"]),
    ({"codec": "sign", "sign_mode": "momentum", "freeze_steps": -3}, ["freeze_steps = -3"]),
    ({"codec": "sign", "sign_mode": "momentum", "freeze_steps": 2.5}, ["freeze_steps", "an integer"]),
    ({"codec": "sign", "freeze_steps": 5}, ["applies only to sign_mode = 'momentum'"]),
    ({**MOMENTUM, "warmup_steps": 3}, ["warmup_steps (3)", "use freeze_steps"]),
    ({**MOMENTUM, "min_numel": 10}, ["min_numel (10)"]),
])
def test_momentum_mode_config_errors(block, words):
    with pytest.raises(ConfigError) as e:
        PluginConfig.from_dict({"compression": block})
    for w in words:
        assert w in str(e.value)


def test_momentum_mode_refuses_hierarchical_topology():
    with pytest.raises(ConfigError, match="hierarchical does not combine"):
        PluginConfig.from_dict({"compression": MOMENTUM, "topology": {"hierarchical": True}})


def test_env_codec_override_is_checked_against_the_mode(monkeypatch):
    monkeypatch.setenv("ROBUST_CODEC", "none")
    with pytest.raises(ConfigError, match="ROBUST_CODEC"):
        PluginConfig.from_dict({"compression": MOMENTUM})


def _params(n=1000, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype))]


@pytest.mark.parametrize("make,words", [
    (lambda: torch.optim.SGD(_params(), lr=0.1), ["torch.optim.Adam", "SGD"]),
    (lambda: torch.optim.Adam(_params(), amsgrad=True), ["amsgrad"]),
    (lambda: torch.optim.AdamW(_params(), maximize=True), ["maximize"]),
    (lambda: torch.optim.AdamW(_params(dtype=torch.bfloat16)), ["fp32", "bfloat16"]),
])
def test_optimizers_the_mode_cannot_follow_are_refused(make, words):
    with pytest.raises(UnsupportedError) as e:
        check_optimizer(make())
    for w in words:
        assert w in str(e.value)


def _freeze(opt, params, grad, steps):
    for _ in range(steps):
        params[0].grad = grad.clone()
        opt.step()


def test_step_before_any_adam_step_is_refused():
    params = _params()
    onebit = SignMomentumAdam(torch.optim.AdamW(params), freeze_steps=3)
    params[0].grad = torch.ones(1000)
    with pytest.raises(UnsupportedError, match="no Adam state"):
        onebit.step()


@pytest.mark.parametrize("cls,wd", [(torch.optim.AdamW, 0.1), (torch.optim.Adam, 0.0)])
def test_step_equals_adam_with_frozen_v_when_the_codes_are_exact(cls, wd):
    # A gradient of +-c in every element is exactly representable in sign codes (mean-|x| scale),
    # and so is b1 * m + (1 - b1) * g when m is a multiple of it: the 1-bit step must then be
    # Adam's update with v frozen at the freeze step, to the last bit of fp32 arithmetic.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1024))]
    opt = cls(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=wd)
    g = torch.where(torch.rand(1024) < 0.5, -0.3, 0.3)
    freeze = 5
    _freeze(opt, params, g, freeze)
    st = opt.state[params[0]]
    v, m0, p0 = st["exp_avg_sq"].clone(), st["exp_avg"].clone(), params[0].detach().clone()
    onebit = SignMomentumAdam(opt, freeze_steps=freeze)
    params[0].grad = g.clone()
    onebit.step()
    m = 0.9 * m0 + 0.1 * g
    t = freeze + 1
    expect = p0 * (1 - 1e-2 * wd) - 1e-2 / (1 - 0.9 ** t) * m / (v.sqrt() / (1 - 0.95 ** freeze) ** 0.5 + 1e-8)
    assert torch.equal(st["exp_avg_sq"], v), "the second moment moved after the freeze"
    assert int(st["step"]) == t
    torch.testing.assert_close(st["exp_avg"], m, rtol=1e-6, atol=0)
    torch.testing.assert_close(params[0].detach(), expect, rtol=1e-6, atol=1e-7)


def test_momentum_of_a_gaussian_gradient_converges_through_error_feedback():
    # One 1-bit momentum is far off the gradient (one sign per element, one scale per block), but
    # with both error feedbacks what the parameters integrate, the momentum summed over steps,
    # approaches the true gradient: its error shrinks as the steps grow (measured: 0.33 after
    # 100 steps, 0.18 after 400, 0.09 after 1600).
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(4096))]
    opt = torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), weight_decay=0.0)  # lr 0: p fixed
    g = torch.randn(4096)
    _freeze(opt, params, g, 5)
    onebit = SignMomentumAdam(opt, freeze_steps=5)
    total, errors, first_err = torch.zeros(4096), {}, None
    for i in range(1, 1601):
        params[0].grad = g.clone()
        onebit.step()
        m = opt.state[params[0]]["exp_avg"]
        first_err = first_err if first_err is not None else ((m - g).norm() / g.norm()).item()
        total += m
        if i in (100, 400, 1600):
            errors[i] = ((total / i - g).norm() / g.norm()).item()
    assert first_err > 0.1, "the codes were exact: this test would not show error feedback"
    assert errors[400] < 0.7 * errors[100] and errors[1600] < 0.7 * errors[400], errors
    assert errors[1600] < 0.12, errors


def test_state_dict_round_trip_and_freeze_mismatch():
    from robust_plugins.errors import CheckpointError

    params = _params()
    opt = torch.optim.AdamW(params)
    _freeze(opt, params, torch.randn(1000), 2)
    a = SignMomentumAdam(opt, freeze_steps=2)
    params[0].grad = torch.randn(1000)
    a.step()
    sd = a.state_dict()
    b = SignMomentumAdam(opt, freeze_steps=2)
    b.load_state_dict(sd)
    assert b.state_dict()["residuals"].keys() == sd["residuals"].keys()
    with pytest.raises(CheckpointError, match="freeze_steps"):
        SignMomentumAdam(opt, freeze_steps=3).load_state_dict(sd)


@pytest.mark.parametrize("extra,expect", [
    ({"zero_optimization": {"stage": 0}}, "fp32 Adam for 20 steps"),
    ({"zero_optimization": {"stage": 1}}, "ERROR: compression.sign_mode = 'momentum' (1-bit Adam) needs ZeRO stage 0"),
    ({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}, "fp16/bf16 on"),
])
def test_check_config_says_what_the_momentum_mode_needs(tmp_path, extra, expect):
    import json

    from robust_plugins.cli import check_config

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "robust_plugins": {"compression": MOMENTUM}, **extra}))
    assert expect in "\n".join(check_config.check(str(p)))


def test_megatron_refuses_the_momentum_mode():
    from types import SimpleNamespace

    from robust_plugins.patches import megatron as patch

    ddp = SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=False))
    with pytest.raises(UnsupportedError, match="sign_mode = 'momentum' .* wired for DeepSpeed ZeRO 0 only"):
        patch._refuse_config(patch._as_plugin_config({"compression": MOMENTUM}), ddp)
    patch._refuse_config(patch._as_plugin_config({"compression": {"codec": "sign"}}), ddp)  # gradient mode is served

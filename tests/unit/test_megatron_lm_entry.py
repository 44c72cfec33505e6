"""``python -m robust_plugins.megatron_lm``'s pure parts: argument split, block file, refusal of
Megatron-LM's own fault tolerance, the version guard, and the CPU redirects' views (no checkout)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from robust_plugins import megatron_lm as entry
from robust_plugins.errors import ConfigError, HostVersionError, UnsupportedError
from robust_plugins.patches import megatron_lm as hooks


def test_parse_argv_splits_entry_options_from_the_script_and_its_args():
    assert entry.parse_argv(["--robust-config", "b.json", "pretrain_gpt.py", "--lr", "1"]) == \
        ("b.json", "pretrain_gpt.py", ["--lr", "1"])
    assert entry.parse_argv(["--robust-config=b.json", "p.py"]) == ("b.json", "p.py", [])
    # an option after the script is the script's, even one named like the entry's
    assert entry.parse_argv(["p.py", "--robust-config", "x"]) == (None, "p.py", ["--robust-config", "x"])


@pytest.mark.parametrize("argv, needle", [([], "got nothing"), (["--lr", "1"], "got --lr"),
                                          (["--robust-config"], "needs a file name"),
                                          (["--robust-config=", "p.py"], "got an empty one")])
def test_parse_argv_names_what_is_wrong(argv, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        entry.parse_argv(argv)
    assert "usage: python -m robust_plugins.megatron_lm" in str(err.value)


def test_load_block_from_option_or_environment_bare_or_wrapped(tmp_path):
    bare, wrapped = tmp_path / "bare.json", tmp_path / "wrapped.json"
    bare.write_text(json.dumps({"compression": {"codec": "int8"}}))
    wrapped.write_text(json.dumps({"robust_plugins": {"compression": {"codec": "none"}}}))
    assert entry.load_block(str(bare), environ={}) == {"compression": {"codec": "int8"}}
    assert entry.load_block(None, environ={"ROBUST_PLUGINS_CONFIG": str(wrapped)}) == \
        {"compression": {"codec": "none"}}
    assert entry.load_block(str(bare), environ={"ROBUST_PLUGINS_CONFIG": str(wrapped)})["compression"] == \
        {"codec": "int8"}  # the option wins
    assert entry.load_block(None, environ={}) is None


def test_load_block_refuses_missing_and_non_object_files(tmp_path):
    with pytest.raises(ConfigError, match="ROBUST_PLUGINS_CONFIG"):
        entry.load_block(None, environ={"ROBUST_PLUGINS_CONFIG": str(tmp_path / "nope.json")})
    with pytest.raises(ConfigError, match="--robust-config"):
        entry.load_block(str(tmp_path / "nope.json"), environ={})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"robust_plugins": [1]}))
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        entry.load_block(str(bad), environ={})


def test_argv_flags_read_both_spellings():
    assert entry.argv_flags(["--lr", "1"]) == {"enable_ft_package": False, "non_persistent_ckpt_type": None}
    assert entry.argv_flags(["--enable-ft-package", "--non-persistent-ckpt-type", "local"]) == \
        {"enable_ft_package": True, "non_persistent_ckpt_type": "local"}
    assert entry.argv_flags(["--non-persistent-ckpt-type=global"])["non_persistent_ckpt_type"] == "global"


def test_megatron_lm_fault_tolerance_is_refused_naming_the_flag():
    assert hooks.ft_refusal({"enable_ft_package": False, "non_persistent_ckpt_type": "global"}) is None
    assert "--enable-ft-package" in hooks.ft_refusal({"enable_ft_package": True})
    why = hooks.ft_refusal(argparse.Namespace(enable_ft_package=False, non_persistent_ckpt_type="local"))
    assert "--non-persistent-ckpt-type local" in why and "allowed: global" in why


def test_checkpoint_keys_megatron_lm_does_itself_are_refused():
    from robust_plugins.config import PluginConfig

    ok = PluginConfig.from_dict({"checkpoint": {"memory_every": 1, "peer_backup": True}})
    assert hooks.checkpoint_refusal(ok) is None and hooks.checkpoint_refusal(PluginConfig()) is None
    why = hooks.checkpoint_refusal(PluginConfig.from_dict({"checkpoint": {"dir": "ckpt", "memory_every": 1}}))
    assert "checkpoint.dir is not used" in why and "--save" in why and "Allowed here: memory_every" in why


def test_main_refuses_ft_package_before_running_anything(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('must not run')\n")
    with pytest.raises(ConfigError, match="--enable-ft-package"):
        entry.main([str(script), "--enable-ft-package"])


def _checkout(tmp_path, major=0, minor=16, patch=1):
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n"
                                          "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    return str(script)


def test_version_guard_reads_the_checkout_and_names_what_is_allowed(tmp_path):
    assert entry.checkout_version(_checkout(tmp_path)) == "0.16.1"
    entry.check_versions("0.16.1", "0.16.1")
    with pytest.raises(HostVersionError, match="core_v0.16.1"):
        entry.check_versions("0.15.0", "0.15.0")
    with pytest.raises(HostVersionError, match="pip install 'megatron-core==0.16.1'"):
        entry.check_versions("0.16.1", "0.16.0")
    with pytest.raises(HostVersionError, match="not in a Megatron-LM checkout"):
        entry.checkout_version(str(tmp_path / "elsewhere" / "pretrain_gpt.py"))


def test_cpu_views_redirect_cuda_factories_and_streams_only():
    from robust_plugins.patches import megatron_lm_cpu as cpu

    view = cpu._TorchView(gpu_like=False)
    assert view.zeros(2, device="cuda").device.type == "cpu"
    assert view.tensor([1], device=torch.device("cuda:0")).device.type == "cpu"
    assert view.float32 is torch.float32 and view.nn is torch.nn  # everything else is torch's own
    with view.cuda.stream(view.cuda.Stream()):
        view.cuda.current_stream().wait_stream(None)
    assert view.cuda.device_count() == torch.cuda.device_count()
    init = cpu._TorchView(gpu_like=True)  # initialize.py: model-parallel groups and RNG seeding run
    assert init.cuda.device_count() == 1 and init.cuda.is_available()
    state = init.cuda.get_rng_state()
    assert torch.equal(state, torch.get_rng_state())


def test_cpu_shim_refuses_where_cuda_is(monkeypatch):
    from robust_plugins.patches import megatron_lm_cpu as cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UnsupportedError, match="CUDA is available"):
        cpu.install()
    assert not cpu.active()

"""The robust_plugins block schema: every user mistake names the key, the value and what is allowed."""

import json

import pytest

from robust_plugins.config import CODECS, CompressionConfig, PluginConfig
from robust_plugins.errors import ConfigError, RobustPluginsError

ISSUE_BLOCK = {"compression": {"codec": "int8", "block_size": 256, "error_feedback": True,
                               "warmup_steps": 0, "min_numel": 0}}


def test_issue_example_block_parses():
    cfg = PluginConfig.from_dict(ISSUE_BLOCK)
    assert cfg.active
    assert cfg.compression == CompressionConfig(codec="int8", block_size=256)
    assert "codec=int8" in cfg.describe()


def test_no_block_is_inactive():
    assert not PluginConfig.from_ds_config({"train_batch_size": 8}).active
    assert not PluginConfig.from_dict({}).active


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_accepted(codec):
    assert PluginConfig.from_dict({"compression": {"codec": codec}}).compression.codec == codec


@pytest.mark.parametrize(
    "block, needles",
    [
        ({"compresion": {}}, ["robust_plugins.compresion", "Did you mean 'compression'"]),
        ({"compression": {"codecs": "int8"}}, ["compression.codecs", "Did you mean 'codec'", "block_size"]),
        ({"compression": {"codec": 8}}, ["compression.codec", "must be a string", "8"]),
        ({"compression": {"codec": "int3"}}, ["'int3'", "Allowed: none, bf16, int8, int4, sign"]),
        ({"compression": {"codec": "int8", "block_size": 300}}, ["block_size = 300", "power of two", "32", "4096"]),
        ({"compression": {"codec": "int8", "block_size": 8192}}, ["block_size = 8192", "between 32 and 4096"]),
        ({"compression": {"codec": "int8", "block_size": 16}}, ["block_size = 16"]),
        ({"compression": {"codec": "int8", "block_size": "256"}}, ["block_size", "must be an integer", "'256'"]),
        ({"compression": {"codec": "sign", "error_feedback": False}}, ["'sign' requires error_feedback = true"]),
        ({"compression": {"codec": "int8", "error_feedback": "yes"}}, ["error_feedback", "true or false"]),
        ({"compression": {"codec": "int8", "warmup_steps": -1}}, ["warmup_steps = -1", ">= 0"]),
        ({"compression": {"codec": "int8", "warmup_steps": True}}, ["warmup_steps", "boolean"]),
        ({"compression": {"codec": "int8", "min_numel": -5}}, ["min_numel = -5", ">= 0"]),
        ({"compression": "int8"}, ["robust_plugins.compression must be a JSON object"]),
    ],
)
def test_bad_block_rejected_with_clear_message(block, needles):
    with pytest.raises(ConfigError) as info:
        PluginConfig.from_dict(block)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert isinstance(info.value, RobustPluginsError)


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("ROBUST_CODEC", "int4")
    assert PluginConfig.from_ds_config({"robust_plugins": ISSUE_BLOCK}).compression.codec == "int4"
    monkeypatch.setenv("ROBUST_CODEC", "int5")
    with pytest.raises(ConfigError, match="int5"):
        PluginConfig.from_ds_config({"robust_plugins": ISSUE_BLOCK})
    monkeypatch.delenv("ROBUST_CODEC")
    monkeypatch.setenv("ROBUST_DISABLE", "1")
    assert not PluginConfig.from_ds_config({"robust_plugins": ISSUE_BLOCK}).active


def test_json_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"robust_plugins": {"compression": {"codec": "int8",}}}')
    with pytest.raises(ConfigError, match=r"ds.json is not valid JSON.*line 1"):
        PluginConfig.from_ds_config(str(bad))
    with pytest.raises(ConfigError, match="Cannot read config file"):
        PluginConfig.from_ds_config(str(tmp_path / "missing.json"))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"robust_plugins": ISSUE_BLOCK}))
    assert PluginConfig.from_ds_config(good).compression.block_size == 256

"""The pydantic schema: JSON Schema export, docs/config.md kept in step, errors only as ConfigError."""

import json
import subprocess
import sys

import pytest

from robust_plugins.errors import ConfigError
from robust_plugins.schema import docs
from robust_plugins.schema.common import AUTO_CODEC, CODECS
from robust_plugins.schema.compression import CompressionConfig
from robust_plugins.schema.plugin import PluginConfig

SECTIONS = ["compression", "watchdog", "checkpoint", "telemetry", "topology"]


def _models():
    seen, todo = [], [PluginConfig]
    while todo:
        model = todo.pop()
        seen.append(model)
        for info in model.model_fields.values():
            todo += [a for a in getattr(info.annotation, "__args__", ()) if hasattr(a, "model_fields")]
    return seen


def test_docs_config_md_is_generated_from_the_schema():
    # CI check: a field, default or description changed without regenerating the reference.
    assert docs.DOCS_PATH.read_text() == docs.render_markdown(), (
        "docs/config.md is out of date: run `python -m robust_plugins.schema.docs`")


def test_every_field_has_a_description():
    models = _models()
    assert len(models) == 7  # the block, five sub-blocks, telemetry.wandb
    missing = [f"{m.__name__}.{n}" for m in models for n, i in m.model_fields.items() if not i.description]
    assert missing == []


def test_check_config_schema_prints_the_json_schema():
    out = subprocess.run([sys.executable, "-m", "robust_plugins.cli.main", "check-config", "--schema"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    assert schema["$schema"].startswith("https://json-schema.org/") and schema["additionalProperties"] is False
    assert list(schema["properties"]) == SECTIONS
    comp = schema["$defs"]["CompressionConfig"]
    assert comp["additionalProperties"] is False
    assert comp["properties"]["codec"]["enum"] == [*CODECS, AUTO_CODEC]
    assert comp["properties"]["block_size"]["minimum"] == 32 and comp["properties"]["block_size"]["maximum"] == 4096
    assert "``" not in out.stdout  # descriptions are Markdown for editors' hovers
    nothing = subprocess.run([sys.executable, "-m", "robust_plugins.cli.main", "check-config"],
                             capture_output=True, text=True, timeout=120)
    assert nothing.returncode == 2 and "or --schema" in nothing.stderr


def test_errors_are_one_config_error_naming_every_bad_key():
    with pytest.raises(ConfigError) as info:
        PluginConfig.from_dict({"compression": {"codec": "int3", "block_size": "256", "warmup_step": 1},
                                "watchdog": {"hang_factor": True}})
    text = str(info.value)
    assert info.value.__suppress_context__ and "pydantic" not in text.lower()
    assert text.splitlines() == [
        "robust_plugins.compression.codec = 'int3' is not allowed. Did you mean 'int8'? "
        "Allowed: none, bf16, int8, int4, sign, auto.",
        "robust_plugins.compression.block_size must be an integer, got str: '256'.",
        "Unknown key robust_plugins.compression.warmup_step. Did you mean 'warmup_steps'? Allowed keys: "
        + ", ".join(CompressionConfig.model_fields) + ".",
        "robust_plugins.watchdog.hang_factor must be a number, got a boolean: True.",
    ]
    with pytest.raises(ConfigError, match=r"^robust_plugins.compression.min_numel = -1 must be >= 0\.$"):
        CompressionConfig(min_numel=-1)  # built on its own: the same key path
    with pytest.raises(ConfigError, match=r"Unknown key robust_plugins.telemetry.wandb.2: keys must be strings"):
        PluginConfig.from_dict({"telemetry": {"wandb": {2: "x"}}})  # pydantic-core: a bare TypeError


def test_frozen_replace_and_as_dict():
    cfg = PluginConfig.from_dict({"compression": {"codec": "int8"}})
    with pytest.raises(AttributeError, match="frozen.*replace"):
        cfg.compression.codec = "int4"
    changed = cfg.compression.replace(codec="int4")
    assert changed.codec == "int4" and cfg.compression.codec == "int8"
    with pytest.raises(ConfigError, match="block_size = 100"):
        cfg.compression.replace(block_size=100)
    assert cfg.replace(topology={"file": "t.json"}).raw == cfg.raw == {"compression": {"codec": "int8"}}
    assert cfg.as_dict()["compression"]["block_size"] == 256 and cfg.as_dict()["watchdog"] is None
    assert cfg == PluginConfig.from_dict({"compression": {"codec": "int8", "block_size": 256}})
    assert len({cfg, PluginConfig.from_dict({"compression": {}})}) == 1


def test_import_robust_plugins_does_not_import_pydantic():
    code = "import sys, robust_plugins, robust_plugins.config; print('pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

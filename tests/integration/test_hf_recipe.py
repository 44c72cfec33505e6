"""``recipes/hf_trainer``: the two configs differ only by the block, ship in the package, and the
comparison measures both runs the same way (no processes: the training script itself runs in
test_hf_trainer.py)."""

from __future__ import annotations

import json

import pytest

from robust_plugins.errors import ConfigError
from robust_plugins.recipes.hf_trainer import compare


def test_baseline_and_plugin_differ_only_by_the_block():
    base = json.loads((compare.HERE / "baseline.json").read_text())
    plug = json.loads((compare.HERE / "plugin.json").read_text())
    assert "robust_plugins" not in base
    assert {k: v for k, v in plug.items() if k != "robust_plugins"} == base
    assert plug["robust_plugins"]["compression"]["codec"] == "int8"
    # CPU-sized ZeRO buckets (HOSTS.md: DeepSpeed's 5e8 default costs ~2 s a step on CPU).
    assert base["zero_optimization"]["reduce_bucket_size"] == 5_000_000


def test_compare_adds_telemetry_to_both_and_replaces_only_the_plugin_codec(tmp_path):
    base = compare.config_for("baseline", tmp_path / "b", 5, codec="int4")
    plug = compare.config_for("plugin", tmp_path / "p", 5, codec="int4")
    assert base["robust_plugins"] == {"telemetry": {"dir": str(tmp_path / "b"), "log_every": 5}}
    assert plug["robust_plugins"]["compression"]["codec"] == "int4"
    assert plug["robust_plugins"]["telemetry"]["dir"] == str(tmp_path / "p")


def test_summary_reads_the_trainer_log_and_the_telemetry(tmp_path):
    (tmp_path / "telemetry").mkdir()
    steps = [{"kind": "step", "step": s, "step_time_s": 0.01 * s, "grad_bytes_per_step_rank0": 100.0}
             for s in (5, 10)]
    (tmp_path / "telemetry" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    log = [{"loss": float(x), "step": x} for x in range(1, 11)] + [{"train_loss": 5.5}]
    (tmp_path / "result.json").write_text(json.dumps({"log_history": log, "digest": "d"}))
    s = compare.summary("plugin", tmp_path)
    assert s["final_loss"] == 8.0 and s["grad_bytes_per_step"] == 100.0 and s["step_time_s"] == pytest.approx(0.075)
    with pytest.raises(ConfigError, match="--steps 3 must be >= --log-every 5"):
        compare.compare(out_dir=tmp_path / "x", steps=3, log_every=5)

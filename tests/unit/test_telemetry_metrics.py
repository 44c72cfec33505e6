"""Telemetry arithmetic: aggregation of rank rows, MFU, compression ratio, ETTR, the JSONL sink."""

import json

import pytest

from robust_plugins.config import PluginConfig
from robust_plugins.errors import ConfigError, RobustPluginsError
from robust_plugins.telemetry import metrics
from robust_plugins.telemetry.sinks import JsonlSink, read_records


def row(**kw):
    r = [0.0] * len(metrics.FIELDS)
    for k, v in kw.items():
        r[metrics.INDEX[k]] = v
    return r


def test_aggregate_two_ranks():
    a = row(steps=10, step_s=2.0, step_s_max=0.3, loss_sum=30.0, loss_n=10, tokens=1000, grad_bytes=4000,
            grad_comm_s=0.5, grad_ref_bytes=16000, mem_bytes=100, residual_sq=9.0, grad_norm=1.5)
    b = row(steps=10, step_s=4.0, step_s_max=0.9, loss_sum=10.0, loss_n=10, tokens=1000, grad_bytes=4000,
            grad_comm_s=1.5, grad_ref_bytes=16000, mem_bytes=300, residual_sq=16.0, grad_norm=1.5)
    r = metrics.aggregate([a, b], window_s=4.0, flops_per_token=6.0, peak_flops=1000.0)
    assert r["loss"] == pytest.approx(2.0)
    assert r["step_time_s"] == pytest.approx(0.3)
    assert r["step_time_max_s"] == 0.9 and r["slowest_rank"] == 1
    assert r["tokens_per_s"] == pytest.approx(500.0)
    assert r["mfu"] == pytest.approx(250.0 * 6.0 / 1000.0)
    assert r["grad_bytes_per_step"] == pytest.approx(800.0)
    assert r["grad_bytes_per_step_rank0"] == pytest.approx(400.0)
    assert r["compression_ratio"] == pytest.approx(0.25)
    assert r["grad_bandwidth_Bps"] == pytest.approx(4000.0)
    assert r["residual_norm"] == pytest.approx(5.0)
    assert r["mem_bytes_max"] == 300 and r["grad_norm"] == 1.5


def test_aggregate_unknowns_stay_empty():
    r = metrics.aggregate([row(steps=1, step_s=1.0, grad_norm=float("nan"))], window_s=1.0,
                          flops_per_token=None, peak_flops=None)
    assert r["mfu"] is None and r["tokens_per_s"] is None and r["grad_norm"] is None
    assert r["compression_ratio"] is None and r["loss"] is None
    with pytest.raises(ValueError, match="expected 12"):
        metrics.aggregate([[1.0, 2.0]], window_s=1.0, flops_per_token=None, peak_flops=None)


def test_peak_flops_table_and_override():
    assert metrics.peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.peak_flops_for("NVIDIA A100-SXM4-40GB") == 312e12
    assert metrics.peak_flops_for(None) is None
    assert metrics.peak_flops_for("cpu", override=2e11) == 2e11


def test_ring_reference_bytes():
    assert metrics.ring_allreduce_bytes(1000, 4, 4) == 6000.0
    assert metrics.ring_allreduce_bytes(1000, 4, 1) == 0.0


def test_ettr_counts_redone_steps_once():
    recs = [
        {"kind": "start", "time": 0.0},
        {"kind": "step", "time": 10.0, "step": 10, "steps_in_window": 10, "window_s": 10.0},
        {"kind": "step", "time": 20.0, "step": 20, "steps_in_window": 10, "window_s": 10.0},
        # crash at ~25 s; the restart (start at 40 s) resumes from step 10 and redoes 11..20
        {"kind": "fault", "time": 25.0},
        {"kind": "start", "time": 40.0},
        {"kind": "step", "time": 50.0, "step": 20, "steps_in_window": 10, "window_s": 10.0},
        {"kind": "step", "time": 60.0, "step": 30, "steps_in_window": 10, "window_s": 10.0},
    ]
    e = metrics.ettr(recs)
    assert e["wall_s"] == 60.0 and e["productive_s"] == pytest.approx(30.0)
    assert e["ettr"] == pytest.approx(0.5)
    assert metrics.ettr([])["ettr"] is None


def test_jsonl_roundtrip_nan_and_torn_line(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.write({"kind": "step", "step": 1, "loss": float("nan")})
    sink.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "st')  # a process killed mid-write
    recs = read_records(tmp_path)
    assert recs == [{"kind": "step", "step": 1, "loss": None}]
    (tmp_path / "metrics.jsonl").write_text('garbage\n{"kind": "end"}\n')
    with pytest.raises(RobustPluginsError, match="line 1"):
        read_records(tmp_path)
    with pytest.raises(RobustPluginsError, match="No telemetry file"):
        read_records(tmp_path / "nowhere")


def test_config_block():
    cfg = PluginConfig.from_dict({"telemetry": {"wandb": {"project": "p", "group": "g"}, "log_every": 5}})
    assert cfg.active and cfg.telemetry.wandb.mode == "offline" and cfg.telemetry.log_every == 5
    assert "telemetry(" in cfg.describe()
    with pytest.raises(ConfigError, match="Did you mean 'offline'"):
        PluginConfig.from_dict({"telemetry": {"wandb": {"mode": "ofline"}}})
    with pytest.raises(ConfigError, match="log_every = 0"):
        PluginConfig.from_dict({"telemetry": {"log_every": 0}})
    with pytest.raises(ConfigError, match="peak_flops"):
        PluginConfig.from_dict({"telemetry": {"peak_flops": -1}})
    with pytest.raises(ConfigError, match="wandb must be a JSON object"):
        PluginConfig.from_dict({"telemetry": {"wandb": "yes"}})
    json.dumps(cfg.raw)  # the run config W&B gets is plain JSON

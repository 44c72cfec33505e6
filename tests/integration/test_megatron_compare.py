"""``robust recipe compare megatron_gpt --preset cpu-tiny``: baseline and plugin runs, then the report.

Two torchrun launches of 2 CPU ranks, 10 steps each (and of 4 ranks for ``--preset cpu-3d``). The
report page names both runs; the plugin run's telemetry shows int8's gradient bytes (~0.25x of the
baseline's, counted on the wire), both runs learn, and an unknown recipe is refused with the allowed
names.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from robust_plugins.telemetry.sinks import read_records

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]


def _robust(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "robust_plugins.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_compare_runs_baseline_and_plugin_and_writes_the_report(tmp_path):
    out = tmp_path / "cmp"
    proc = _robust("recipe", "compare", "megatron_gpt", "--preset", "cpu-tiny", "--nproc", "2", "--steps", "10",
                   "--log-every", "5", "--out-dir", str(out), "--timeout", "150", timeout=190)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plugin / baseline: gradient bytes" in proc.stdout
    html = (out / "report.html").read_text()
    assert "baseline" in html and "plugin" in html and "<img" in html
    recs = {name: [r for r in read_records(out / name / "telemetry") if r.get("kind") == "step"]
            for name in ("baseline", "plugin")}
    assert [r["step"] for r in recs["baseline"]] == [5, 10] == [r["step"] for r in recs["plugin"]]
    base, plug = (recs[n][-1]["grad_bytes_per_step_rank0"] for n in ("baseline", "plugin"))
    assert base > 0 and 0.2 < plug / base < 0.35, (base, plug)
    assert recs["plugin"][-1]["codec_share"] == {"int8": 1.0}
    for name in recs:
        assert recs[name][-1]["loss"] < recs[name][0]["loss"] + 0.5


def test_compare_refuses_an_unknown_recipe():
    proc = _robust("recipe", "compare", "nope", timeout=60)
    assert proc.returncode == 2 and "unknown recipe 'nope'; allowed: megatron_gpt" in proc.stderr


@pytest.mark.timeout(240)
def test_compare_cpu_3d_counts_only_the_data_parallel_sync(tmp_path):
    """``--preset cpu-3d``: 4 ranks by default (PP 2 x DP 2, bf16, megatron's DistributedOptimizer,
    tied embeddings). The telemetry's gradient bytes are each rank's reduce-scatter alone, checked
    against an independent count from the recipe's own bucket sizes: (dp-1)/dp x 4 bytes x fp32
    gradient elements; pipeline p2p and the tied-embedding all-reduce would add bytes. Tokens are
    counted once per sample (first stage, TP rank 0): dp x micro-batches x micro batch x seq."""
    out = tmp_path / "cmp3d"
    proc = _robust("recipe", "compare", "megatron_gpt", "--preset", "cpu-3d", "--steps", "10", "--log-every", "5",
                   "--out-dir", str(out), "--timeout", "200", timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--nproc-per-node 4" in proc.stdout and (out / "report.html").is_file()
    result = {n: json.loads((out / n / "result.json").read_text()) for n in ("baseline", "plugin")}
    assert (result["baseline"]["pp"], result["baseline"]["dp"], result["baseline"]["distopt"]) == (2, 2, True)
    recs = {name: [r for r in read_records(out / name / "telemetry") if r.get("kind") == "step"]
            for name in ("baseline", "plugin")}
    base, plug = recs["baseline"][-1], recs["plugin"][-1]
    assert base["grad_bytes_per_step_by_rank"] == [0.5 * 4 * n for n in result["baseline"]["grad_elements_by_rank"]]
    for b, p in zip(base["grad_bytes_per_step_by_rank"], plug["grad_bytes_per_step_by_rank"]):
        assert 0.25 <= p / b < 0.27, (b, p)  # int8 codes + one fp32 scale per 256
    tokens = base["tokens_per_s"] * base["window_s"] / base["steps_in_window"]
    assert abs(tokens - 2 * 4 * 2 * 64) < 1e-6 * tokens, tokens
    assert plug["codec_share"] == {"int8": 1.0}
    assert abs(base["loss"] - plug["loss"]) < 0.05 and base["loss"] < recs["baseline"][0]["loss"] + 0.5

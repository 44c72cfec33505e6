"""``robust recipe compare megatron_gpt --preset cpu-tiny``: baseline and plugin runs, then the report.

Two torchrun launches of 2 CPU ranks, 10 steps each. The report page names both runs; the plugin
run's telemetry shows int8's gradient bytes (~0.25x of the baseline's, counted on the wire), both
runs learn, and an unknown recipe is refused with the allowed names.
"""

from __future__ import annotations

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

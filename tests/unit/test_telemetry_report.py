"""Convergence forecast and the HTML report built from telemetry files (the browser check of a
report from real runs is in tests/integration/test_telemetry_deepspeed.py)."""

import base64
import json
import math
import random
import re

import pytest

from robust_plugins.cli.main import main as robust_main
from robust_plugins.errors import RobustPluginsError
from robust_plugins.telemetry.forecast import fit_power_law
from robust_plugins.telemetry.report import CHART_IDS, build, load_run
from robust_plugins.telemetry.sinks import JsonlSink


def test_power_law_recovered_and_interval_covers_truth():
    steps = list(range(10, 410, 10))
    exact = [5.0 * s ** -0.3 for s in steps]
    fit = fit_power_law(steps, exact)
    assert fit.slope == pytest.approx(-0.3, abs=1e-9)
    mean, lo, hi = fit.predict(800)
    assert mean == pytest.approx(5.0 * 800 ** -0.3, rel=1e-9) and lo <= mean <= hi
    rng = random.Random(0)
    covered = 0
    for _ in range(50):
        noisy = [v * math.exp(rng.gauss(0, 0.03)) for v in exact]
        f = fit_power_law(steps, noisy)
        m, lo, hi = f.predict(800)
        truth = 5.0 * 800 ** -0.3
        covered += lo <= truth <= hi
        assert hi > lo
    assert covered >= 40  # a 95 % interval; a broken one covers far less or is degenerate
    assert fit_power_law([1, 2, 3], [3.0, 2.0, 1.0]) is None  # too few points


def _fake_run(tmp_path, name, ratio, faults=0):
    d = tmp_path / name / "telemetry"
    sink = JsonlSink(d)
    t = 1000.0
    sink.write({"kind": "start", "time": t, "config": {"telemetry": {}}})
    for s in range(10, 110, 10):
        sink.write({"kind": "step", "step": s, "time": t + s, "loss": 5.0 * s ** -0.2, "step_time_s": 0.1,
                    "step_time_max_s": 0.2, "tokens_per_s": 1000.0, "grad_bytes_per_step_rank0": 1e6 * ratio,
                    "compression_ratio": ratio, "ettr": 0.9, "steps_in_window": 10, "window_s": 1.0})
        if faults and s == 50:
            sink.write({"kind": "fault", "fault_kind": "crash", "step": 45, "time": t + 52})
    sink.close()
    return tmp_path / name


def test_report_has_every_chart_and_table(tmp_path, capsys):
    a = _fake_run(tmp_path, "baseline", 1.0)
    b = _fake_run(tmp_path, "plugin", 0.25, faults=1)
    out = tmp_path / "r.html"
    assert robust_main(["report", str(a), str(b), "--out", str(out), "--target-step", "500"]) == 0
    assert str(out) in capsys.readouterr().out
    page = out.read_text()
    for cid in CHART_IDS:
        m = re.search(rf"id='{cid}'[^>]*src='data:image/png;base64,([^']+)'", page)
        assert m, cid
        assert base64.b64decode(m.group(1))[:4] == b"\x89PNG"
    assert "<table id='summary'>" in page and "<table id='faults'>" in page
    assert page.count("<tr><td>baseline</td>") == 1 and "crash" in page
    meta = json.loads(out.with_suffix(".json").read_text())
    fc = {f["run"]: f for f in meta["forecasts"]}
    assert fc["plugin"]["forecast"] == pytest.approx(5.0 * 500 ** -0.2, rel=1e-6)
    assert load_run(b).faults[0]["fault_kind"] == "crash"


def test_report_errors_name_the_problem(tmp_path):
    with pytest.raises(RobustPluginsError, match="no metrics.jsonl"):
        build([tmp_path], tmp_path / "r.html")
    d = tmp_path / "empty"
    sink = JsonlSink(d)
    sink.write({"kind": "start", "time": 1.0})
    sink.close()
    with pytest.raises(RobustPluginsError, match="no step records"):
        build([d], tmp_path / "r.html")

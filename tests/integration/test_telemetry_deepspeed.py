"""Telemetry on a real 2-rank DeepSpeed run (no script change: only the config's block), read back
from metrics.jsonl and from the W&B offline run files, checked against the recipe's own byte counts
and against the bytes computed by hand from the parameter count, block size and world size; then the HTML report built from those runs, loaded in headless Chromium."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

from robust_plugins.cli._runs import RECIPE_MODULE, recipe_config
from robust_plugins.config import load_json
from _dist import run_script
from robust_plugins.telemetry import read_records
from robust_plugins.telemetry.report import CHART_IDS, build

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _browser import load  # noqa: E402
from _wandb_offline import read_run  # noqa: E402

pytest.importorskip("deepspeed")
pytest.importorskip("wandb")
pytestmark = [pytest.mark.integration]

STEPS, EVERY = 20, 5


def _config(src: str, out: Path, name: str, heatmap: bool, **compression) -> str:
    cfg = load_json(recipe_config(src))
    block = cfg.setdefault("robust_plugins", {})
    block.get("compression", {}).update(compression)
    block["telemetry"] = {"dir": str(out / name), "log_every": EVERY, "heatmap_at_start": heatmap,
                          "heatmap_bytes": 1 << 16,
                          "wandb": {"project": "robust-test", "group": "cmp", "mode": "offline"}}
    path = out / f"{name}.ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("telemetry")
    plan = {"runs": [{"name": "baseline", "config": _config("baseline.json", out, "baseline", False)},
                     {"name": "plugin", "config": _config("plugin.json", out, "plugin", True)},
                     # codec auto told a slow link: it compresses, with one residual state a codec
                     {"name": "auto", "config": _config("plugin.json", out, "auto", False, codec="auto",
                                                        auto_candidates=["int8", "int4"], auto_link_gbit=0.1)}]}
    (out / "plan.json").write_text(json.dumps(plan))
    run_script(RECIPE_MODULE, ["--plan", str(out / "plan.json"), "--out-dir", str(out), "--steps", str(STEPS),
                                 "--preset", "tiny"], nproc=2, timeout_s=200, log_path=out / "launch.log")
    return out


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in read_records(run_dir) if r["kind"] == "step"]


def _grad_bytes_by_hand(name: str, n_params: int, world: int = 2, block: int = 256) -> int:
    """Bytes one rank sends a step for the gradients, from the parameter count alone (not from a
    WireCounter): ZeRO-1's fp32 ring all-reduce (2 (W-1)/W x 4 bytes an element), or the plugin's
    two-phase int8 (the bucket padded to W x 256-element blocks and cut into W chunks; a chunk's
    row is 1 byte an element plus one fp32 scale a block; W-1 rows out in the all-to-all, the
    reduced row to the W-1 others in the all-gather)."""
    if name == "baseline":
        return 2 * (world - 1) * n_params * 4 // world
    chunk = -(-n_params // (world * block)) * block
    return 2 * (world - 1) * (chunk + 4 * (chunk // block))


@pytest.mark.parametrize("name", ["baseline", "plugin"])
def test_metrics_agree_with_the_recipes_own_counts(runs, name):
    result = json.loads((runs / f"{name}.json").read_text())
    recs = read_records(runs / name)
    assert [r["kind"] for r in recs][0] == "start" and recs[-1]["kind"] == "end"
    steps = _steps(runs / name)
    assert [r["step"] for r in steps] == list(range(EVERY, STEPS + 1, EVERY))
    counted = result["wire"]["rank0_grad_bytes_per_step"]  # the recipe's WireCounter, per step
    by_hand = _grad_bytes_by_hand(name, result["n_params"])
    losses = result["losses"]  # mean over ranks, per step
    for r in steps:
        window = slice(r["step"] - EVERY, r["step"])
        assert r["grad_bytes_per_step_rank0"] == pytest.approx(statistics.fmean(counted[window]), rel=1e-12)
        assert r["grad_bytes_per_step_rank0"] == by_hand, (r["grad_bytes_per_step_rank0"], by_hand)
        assert r["loss"] == pytest.approx(statistics.fmean(losses[window]), rel=1e-5)
        # ratio = all ranks' bytes over an fp32 ring all-reduce of every trainable gradient
        ref = 2 * (2 - 1) / 2 * result["n_params"] * 4
        assert r["compression_ratio"] == pytest.approx(r["grad_bytes_per_step"] / 2 / ref, rel=1e-9)
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["mem_bytes_max"] > 50e6
        assert r["grad_norm"] > 0 and r["world_size"] == 2 and 0 < r["ettr"] <= 1
        assert r["mfu"] is None  # no peak FLOP/s for a CPU unless configured
    if name == "plugin":
        assert all(0.2 < r["compression_ratio"] < 0.3 for r in steps)  # int8 + scales, two-phase
        assert all(r["residual_norm"] > 0 for r in steps)
        assert all(r["codec_share"] == {"int8": 1.0} for r in steps)
    else:
        assert all(r["residual_norm"] == 0 and "codec_share" not in r for r in steps)
        assert all(r["compression_ratio"] == pytest.approx(1.0) for r in steps)  # ZeRO-1's own all-reduce


def test_codec_auto_reports_its_codecs_and_every_candidates_residuals(runs):
    steps = _steps(runs / "auto")
    assert [r["step"] for r in steps] == list(range(EVERY, STEPS + 1, EVERY))
    for r in steps:
        assert sum(r["codec_share"].values()) == pytest.approx(1.0), r["codec_share"]
        assert set(r["codec_share"]) & {"int8", "int4"}, r["codec_share"]  # a slow link: compressed
        assert r["residual_norm"] > 0 and r["compression_ratio"] < 0.6, r


def test_wandb_offline_run_carries_config_and_values(runs):
    for name in ("baseline", "plugin"):
        run_dirs = list((runs / name / "wandb").glob("offline-run-*"))
        assert len(run_dirs) == 1, run_dirs
        wb = read_run(run_dirs[0])
        assert wb["project"] == "robust-test" and wb["group"] == "cmp"
        block = wb["config"]["robust_plugins"]
        assert block["telemetry"]["log_every"] == EVERY and block["telemetry"]["wandb"]["group"] == "cmp"
        assert ("compression" in block) == (name == "plugin")
        by_step = {h["_step"]: h for h in wb["history"] if "compression_ratio" in h}
        for r in _steps(runs / name):
            h = by_step[r["step"]]
            for key in ("compression_ratio", "grad_bytes_per_step", "loss", "tokens_per_s", "ettr"):
                assert h[key] == pytest.approx(r[key], rel=1e-12), key
    plugin = read_run(next((runs / "plugin" / "wandb").glob("offline-run-*")))
    images = [h for h in plugin["history"] if h.get("comm/heatmap/_type") == "image-file"]
    assert images, "the heat map image was not logged"


def test_heatmap_at_start(runs):
    heat = [r for r in read_records(runs / "plugin") if r["kind"] == "heatmap"]
    assert len(heat) == 1 and Path(heat[0]["png"]).is_file()
    data = json.loads(Path(heat[0]["file"]).read_text())
    assert data["bw"][0][1] > 0 and data["bw"][1][0] > 0 and data["lat"][0][1] > 0


def test_report_in_headless_chromium(runs):
    page = build([runs / "baseline", runs / "plugin"], runs / "report.html")
    dom, console = load(page)
    assert console == []
    expected = int(re.search(r'data-charts-expected="(\d+)"', dom).group(1))
    assert expected == len(CHART_IDS) + 1  # + the plugin run's heat map
    assert f'data-charts-ok="{expected}"' in dom  # every chart decoded in the browser
    for cid in (*CHART_IDS, "chart-heatmap-1", "summary"):
        assert f'id="{cid}"' in dom, cid
    assert dom.count("<tr><td>baseline</td>") == 1 and dom.count("<tr><td>plugin</td>") == 1


def test_browser_check_catches_a_broken_page(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    _, console = load(bad)
    assert any("undefinedFunction" in line for line in console)

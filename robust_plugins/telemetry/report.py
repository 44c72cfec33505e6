"""``robust report``: one self-contained HTML page comparing runs from their ``metrics.jsonl``.

Charts are PNGs drawn with matplotlib and embedded as ``data:`` URIs (the page is one file that can
be mailed or attached to an issue; nothing is fetched from the network). Each chart is an
``<img>`` with a fixed ``id`` (:data:`CHART_IDS`, plus ``chart-heatmap-<i>`` for each run with a
heat map) so a headless browser test can check that every chart is present and decodes.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from robust_plugins.errors import RobustPluginsError
from robust_plugins.telemetry.forecast import fit_power_law
from robust_plugins.telemetry.sinks import METRICS_FILE, read_records

CHART_IDS = ("chart-loss", "chart-throughput", "chart-wire", "chart-ettr")


@dataclass
class RunData:
    """What the report needs from one run directory."""

    name: str
    path: Path
    steps: list[dict[str, Any]]
    """Step records, one per step (a step redone after a rollback keeps its last record)."""
    timeline: list[tuple[float, float | None]]
    """(seconds since the first start, ETTR) for every step record, in file order."""
    faults: list[dict[str, Any]]
    fault_times: list[float]
    heatmap_png: Path | None
    heatmap_summary: str | None
    starts: int
    config: dict[str, Any] = field(default_factory=dict)


def find_metrics(path: str | Path) -> Path:
    """``path/metrics.jsonl`` or ``path/telemetry/metrics.jsonl`` (a ``robust run`` directory)."""
    p = Path(path)
    for cand in (p, p / METRICS_FILE, p / "telemetry" / METRICS_FILE):
        if cand.is_file():
            return cand
    raise RobustPluginsError(
        f"{p}: no {METRICS_FILE} here or in {p / 'telemetry'}. Give a run directory of a run "
        f"trained with a 'telemetry' block (robust_plugins.telemetry)."
    )


def load_run(path: str | Path) -> RunData:
    """Read one run's records."""
    metrics_path = find_metrics(path)
    recs = read_records(metrics_path)
    run_dir = metrics_path.parent
    name = run_dir.parent.name if run_dir.name == "telemetry" else run_dir.name
    starts = [r for r in recs if r.get("kind") == "start"]
    if not starts:
        raise RobustPluginsError(f"{metrics_path} has no 'start' record; it is not a telemetry file.")
    t0 = min(float(r["time"]) for r in starts)
    by_step: dict[int, dict[str, Any]] = {}
    timeline = []
    for r in recs:
        if r.get("kind") == "step":
            by_step[int(r["step"])] = r
            timeline.append((float(r["time"]) - t0, r.get("ettr")))
    faults = [r for r in recs if r.get("kind") == "fault"]
    heat = [r for r in recs if r.get("kind") == "heatmap"]
    png = None
    if heat and heat[-1].get("png"):
        cand = Path(heat[-1]["png"])
        png = cand if cand.is_file() else (run_dir / cand.name if (run_dir / cand.name).is_file() else None)
    return RunData(
        name=name, path=run_dir, steps=[by_step[s] for s in sorted(by_step)], timeline=timeline,
        faults=faults, fault_times=[float(f["time"]) - t0 for f in faults], heatmap_png=png,
        heatmap_summary=(heat[-1].get("outliers") or {}).get("summary") if heat else None,
        starts=len(starts), config=starts[0].get("config") or {},
    )


def _series(run: RunData, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in run.steps:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RobustPluginsError(
            f"robust report draws its charts with matplotlib, which is not installed ({exc}). "
            f"pip install 'robust_plugins[telemetry]'."
        ) from exc
    return plt


def chart_loss(runs: Sequence[RunData], target_step: int) -> tuple[str, list[dict[str, Any]]]:
    """Loss curves overlaid, each with its power-law forecast and 95 % interval up to ``target_step``."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    forecasts = []
    for i, run in enumerate(runs):
        xs, ys = _series(run, "loss")
        color = f"C{i}"
        # Later runs thinner, so that curves which coincide (a lossless plugin) stay visible.
        ax.plot(xs, ys, color=color, label=run.name, lw=max(2.6 - 0.8 * i, 0.8))
        fit = fit_power_law(xs, ys)
        fc = {"run": run.name, "target_step": target_step, "forecast": None, "low": None, "high": None}
        if fit is not None and xs:
            grid = [xs[-1] + (target_step - xs[-1]) * k / 40 for k in range(41)] if target_step > xs[-1] else [xs[-1]]
            pred = [fit.predict(g) for g in grid]
            ax.plot(grid, [p[0] for p in pred], "--", color=color, alpha=0.8)
            ax.fill_between(grid, [p[1] for p in pred], [p[2] for p in pred], color=color, alpha=0.15)
            mean, lo, hi = fit.predict(target_step)
            fc.update(forecast=mean, low=lo, high=hi)
        forecasts.append(fc)
        for ft in run.faults:
            if ft.get("step") is not None:
                ax.axvline(ft["step"], color=color, ls=":", alpha=0.6)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(f"loss (dashed: power-law forecast to step {target_step}, band: 95 % interval; dotted: faults)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig), forecasts


def chart_throughput(runs: Sequence[RunData]) -> str:
    """Step time (mean over ranks, and slowest rank) and tokens/s."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, run in enumerate(runs):
        xs, ys = _series(run, "step_time_s")
        a1.plot(xs, [y * 1e3 for y in ys], color=f"C{i}", label=run.name)
        xs, ys = _series(run, "step_time_max_s")
        a1.plot(xs, [y * 1e3 for y in ys], color=f"C{i}", ls=":", alpha=0.6)
        xs, ys = _series(run, "tokens_per_s")
        a2.plot(xs, ys, color=f"C{i}", label=run.name)
    a1.set_title("step time, ms (dotted: slowest single step)", fontsize=9)
    a2.set_title("tokens / s (all ranks)", fontsize=9)
    for a in (a1, a2):
        a.set_xlabel("optimizer step")
        a.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def chart_wire(runs: Sequence[RunData]) -> str:
    """Gradient bytes each rank sends per step, and the compression ratio."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, run in enumerate(runs):
        xs, ys = _series(run, "grad_bytes_per_step_rank0")
        a1.plot(xs, [y / 1e6 for y in ys], color=f"C{i}", label=run.name, marker=".")
        xs, ys = _series(run, "compression_ratio")
        a2.plot(xs, ys, color=f"C{i}", label=run.name, marker=".")
    a1.set_title("gradient MB sent per step (rank 0)", fontsize=9)
    a2.set_title("bytes on the wire / fp32 ring all-reduce", fontsize=9)
    a1.set_ylim(bottom=0)
    a2.set_ylim(bottom=0)
    for a in (a1, a2):
        a.set_xlabel("optimizer step")
        a.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def chart_ettr(runs: Sequence[RunData]) -> str:
    """ETTR against wall time with a marker (and label) at every fault."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, run in enumerate(runs):
        pts = [(t, e) for t, e in run.timeline if e is not None]
        ax.plot([t for t, _ in pts], [e for _, e in pts], color=f"C{i}", label=run.name, marker=".")
        for ft, f in zip(run.fault_times, run.faults):
            ax.axvline(ft, color=f"C{i}", ls="--", alpha=0.7)
            ax.text(ft, 1.02, f.get("fault_kind") or "fault", rotation=90, fontsize=7, color=f"C{i}",
                    va="bottom", ha="right")
    ax.set_ylim(0, 1.15)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("ETTR")
    ax.set_title("effective training time ratio (dashed: faults)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def _median(run: RunData, key: str) -> float | None:
    _, ys = _series(run, key)
    return statistics.median(ys) if ys else None


def _fmt(v: Any, spec: str = ".4g", scale: float = 1.0, unit: str = "") -> str:
    if v is None:
        return "n/a"
    return f"{v * scale:{spec}}{unit}"


def summary_rows(runs: Sequence[RunData], forecasts: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The summary table (one row a run)."""
    rows = []
    for run, fc in zip(runs, forecasts):
        last = run.steps[-1] if run.steps else {}
        forecast = ("n/a" if fc["forecast"] is None else
                    f"{fc['forecast']:.3f} [{fc['low']:.3f}, {fc['high']:.3f}] @ {fc['target_step']}")
        rows.append([
            run.name, str(last.get("step", "n/a")), _fmt(last.get("loss")), forecast,
            _fmt(_median(run, "step_time_s"), ".1f", 1e3, " ms"), _fmt(_median(run, "tokens_per_s"), ".0f"),
            _fmt(_median(run, "grad_bytes_per_step_rank0"), ".3f", 1e-6, " MB"),
            _fmt(_median(run, "compression_ratio"), ".3f", 1.0, "x"), _fmt(_median(run, "mfu"), ".2%"),
            _fmt(last.get("ettr"), ".3f"), str(len(run.faults)), str(run.starts),
        ])
    return rows


SUMMARY_HEADERS = ["run", "last step", "loss", "forecast [95 %]", "median step", "tokens/s",
                   "grad bytes/step (rank 0)", "compression", "MFU", "ETTR", "faults", "incarnations"]


def build(run_dirs: Sequence[str | Path], out: str | Path, target_step: int | None = None) -> Path:
    """Write the HTML report for ``run_dirs`` to ``out`` and return its path."""
    if not run_dirs:
        raise RobustPluginsError("robust report needs at least one run directory.")
    runs = [load_run(d) for d in run_dirs]
    empty = [r.name for r in runs if not r.steps]
    if empty:
        raise RobustPluginsError(
            f"run(s) {', '.join(empty)} have no step records yet (fewer steps than telemetry.log_every?)."
        )
    last = max(r.steps[-1]["step"] for r in runs)
    target = target_step or 2 * last
    if target < 1:
        raise RobustPluginsError(f"--target-step {target} must be >= 1.")
    loss_png, forecasts = chart_loss(runs, target)
    charts = [
        ("chart-loss", "Loss and convergence forecast", loss_png),
        ("chart-throughput", "Step time and throughput", chart_throughput(runs)),
        ("chart-wire", "Bytes on the wire", chart_wire(runs)),
        ("chart-ettr", "ETTR timeline and faults", chart_ettr(runs)),
    ]
    for i, run in enumerate(runs):
        if run.heatmap_png is not None:
            data = base64.b64encode(run.heatmap_png.read_bytes()).decode()
            charts.append((f"chart-heatmap-{i}", f"Communication heat map: {run.name}"
                           f" ({run.heatmap_summary or 'no outliers'})", data))
    rows = summary_rows(runs, forecasts)
    faults = [(run.name, f) for run in runs for f in run.faults]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_html(runs, charts, rows, faults, target), encoding="utf-8")
    (out.with_suffix(".json")).write_text(json.dumps({"runs": [str(r.path) for r in runs], "forecasts": forecasts,
                                                      "charts": [c[0] for c in charts]}, indent=1) + "\n")
    return out


def _html(runs, charts, rows, faults, target) -> str:
    esc = html.escape
    table = "<table id='summary'><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in SUMMARY_HEADERS)
    table += "</tr></thead><tbody>" + "".join(
        "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows) + "</tbody></table>"
    fault_rows = "".join(
        f"<tr><td>{esc(n)}</td><td>{esc(str(f.get('fault_kind')))}</td><td>{esc(str(f.get('step')))}</td>"
        f"<td>{esc(str(f.get('suspect_ranks')))}</td><td>{esc(', '.join(f.get('suspect_hosts') or []))}</td>"
        f"<td>{esc(str(f.get('detected_after_s')))}</td>"
        f"<td>{esc(str(f.get('resumed_at_step')))}</td><td>{esc(str(f.get('lost_steps')))}</td></tr>"
        for n, f in faults)
    fault_table = ("<table id='faults'><thead><tr><th>run</th><th>fault</th><th>step</th><th>suspect ranks</th>"
                   "<th>hosts</th><th>detected after (s)</th><th>resumed at step</th><th>lost steps</th></tr></thead>"
                   f"<tbody>{fault_rows}</tbody></table>" if faults else "<p id='faults'>No faults recorded.</p>")
    figures = "".join(
        f"<figure><figcaption>{esc(title)}</figcaption><img id='{cid}' class='chart' alt='{esc(title)}' "
        f"src='data:image/png;base64,{data}'></figure>" for cid, title, data in charts)
    sources = "".join(f"<li>{esc(r.name)}: {esc(str(r.path))}</li>" for r in runs)
    # The script only checks that every chart decoded and records it in the DOM (for a headless
    # browser check and for a reader whose viewer blocks data: images).
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>robust_plugins report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} figcaption {{ font-weight: bold; margin-bottom: 0.4em; }}
img.chart {{ max-width: 100%; border: 1px solid #eee; }}
</style></head>
<body data-charts-expected="{len(charts)}">
<h1>robust_plugins: run comparison</h1>
<p>Generated {esc(time.strftime('%Y-%m-%d %H:%M:%S %Z'))} by <code>robust report</code>. Forecast: a power law
fitted to the second half of each loss curve, 95 % prediction interval at step {target}.</p>
<h2>Summary</h2>{table}
<h2>Faults</h2>{fault_table}
<h2>Charts</h2>{figures}
<h2>Sources</h2><ul>{sources}</ul>
<script>
window.addEventListener("load", function () {{
  var imgs = document.querySelectorAll("img.chart"), ok = 0;
  imgs.forEach(function (im) {{ if (im.complete && im.naturalWidth > 0) ok++; }});
  document.body.setAttribute("data-charts-ok", String(ok));
}});
</script>
</body></html>
"""

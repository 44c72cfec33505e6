"""What every recipe's ``compare`` shares: a finished run's summary from its telemetry, and the
side-by-side table printed after :func:`robust_plugins.telemetry.report.build` wrote the report.

A run that wrote no telemetry step record is refused (``ConfigError``): its step time and bytes
would otherwise be missing from the table without a word.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from robust_plugins.errors import ConfigError


def run_summary(name: str, run_dir: Path, losses: list[float], digest: str) -> dict[str, Any]:
    """Final loss (mean of the last 5 of ``losses``), median step time and rank 0's gradient bytes
    per step of the run whose telemetry is in ``run_dir / "telemetry"``."""
    from robust_plugins.telemetry.sinks import read_records

    steps = [r for r in read_records(run_dir / "telemetry") if r.get("kind") == "step"]
    if not steps:
        raise ConfigError(f"run {name} wrote no telemetry step records in {run_dir}; raise --steps above "
                          f"--log-every.")
    return {"name": name, "final_loss": statistics.fmean(losses[-5:]),
            "step_time_s": statistics.median(r["step_time_s"] for r in steps),
            "grad_bytes_per_step": statistics.median(r["grad_bytes_per_step_rank0"] for r in steps),
            "digest": digest}


def report_and_table(out: Path, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``out / "report.html"`` from both runs' telemetry, print the table, return the result
    ``compare`` returns: both summaries, the bytes ratio (``None`` when the baseline sent none), the
    report's path."""
    from robust_plugins.telemetry.report import build

    report = build([out / "baseline" / "telemetry", out / "plugin" / "telemetry"], out / "report.html")
    base, plug = summaries
    ratio = plug["grad_bytes_per_step"] / base["grad_bytes_per_step"] if base["grad_bytes_per_step"] else None
    print(f"{'run':<10}{'final loss':>12}{'step time (median)':>20}{'grad bytes/step rank0':>24}")
    for s in summaries:
        print(f"{s['name']:<10}{s['final_loss']:>12.4f}{s['step_time_s'] * 1e3:>17.1f} ms{s['grad_bytes_per_step']:>24.0f}")
    if ratio is not None:
        print(f"plugin / baseline: gradient bytes {ratio:.3f}x, step time "
              f"{plug['step_time_s'] / base['step_time_s']:.2f}x, final loss {plug['final_loss'] / base['final_loss']:.4f}x")
    print(f"report: {report.resolve()}")
    return {"baseline": base, "plugin": plug, "bytes_ratio": ratio, "report": str(report)}

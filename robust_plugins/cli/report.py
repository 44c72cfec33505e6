"""``robust report RUN_DIR [RUN_DIR ...]``: an HTML page comparing runs (robust_plugins.telemetry.report)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``robust report``."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="directory holding metrics.jsonl (or a robust run directory with telemetry/)")
    parser.add_argument("--out", default="report.html", help="HTML file to write (default report.html)")
    parser.add_argument("--target-step", type=int,
                        help="step at which to forecast the loss (default: twice the last step)")


def run(args: argparse.Namespace) -> int:
    """Build the page and print its path."""
    from robust_plugins.telemetry.report import build

    out = build(args.run_dirs, args.out, target_step=args.target_step)
    print(f"report: {out.resolve()}")
    return 0

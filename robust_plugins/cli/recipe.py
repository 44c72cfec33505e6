"""``robust recipe compare RECIPE``: run a recipe's baseline and plugin configs and write the report."""

from __future__ import annotations

import argparse
import datetime

#: Recipes ``robust recipe compare`` can run. DeepSpeed's comparison is ``robust demo``.
COMPARABLE = ("megatron_gpt", "hf_trainer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``robust recipe``."""
    parser.add_argument("action", choices=("compare",), help="compare: baseline vs plugin, then the report")
    parser.add_argument("recipe", help=f"recipe to run: {', '.join(COMPARABLE)}")
    parser.add_argument("--preset", default="cpu-tiny", help="recipe preset (default cpu-tiny)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (default: the preset's layout, e.g. 4 for megatron_gpt's cpu-3d; else 2)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    parser.add_argument("--codec", help="the plugin run's codec (default: the recipe's plugin.json, int8)")
    parser.add_argument("--log-every", type=int, default=5, help="telemetry record every N steps (default 5)")
    parser.add_argument("--out-dir", help="default runs/compare-<recipe>-<date>-<time>")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")


def run(args: argparse.Namespace) -> int:
    """Run the comparison."""
    from robust_plugins.errors import ConfigError

    if args.recipe not in COMPARABLE:
        raise ConfigError(f"robust recipe compare: unknown recipe {args.recipe!r}; allowed: {', '.join(COMPARABLE)} "
                          f"(for deepspeed_gpt, `robust demo` runs the comparison).")
    import importlib

    compare = importlib.import_module(f"robust_plugins.recipes.{args.recipe}.compare").compare
    out = args.out_dir or f"runs/compare-{args.recipe}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    nproc = {} if args.nproc is None else {"nproc": args.nproc}
    compare(out_dir=out, preset=args.preset, steps=args.steps, codec=args.codec, log_every=args.log_every,
            timeout_s=args.timeout, **nproc)
    return 0

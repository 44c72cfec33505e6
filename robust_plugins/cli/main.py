"""``robust``: the command-line entry point. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module under robust_plugins.cli, one-line help). Modules are imported only when their
# command runs, so `robust check-config` never pays for importing DeepSpeed.
COMMANDS = {
    "check-config": ("check_config", "validate a DeepSpeed JSON config's robust_plugins block"),
    "demo": ("demo", "train a small GPT on 4 CPU ranks without and with the plugin; print a table"),
    "bench": ("bench.command", "run a benchmark and optionally write its rows into BENCHMARKS.md"),
    "run": ("run", "torchrun with a fault watchdog, working restarts on gloo and fault injection"),
    "recipe": ("recipe", "run a recipe's baseline and plugin configs side by side, then the report"),
    "report": ("report", "an HTML page comparing runs: loss + forecast, throughput, bytes, ETTR, heat map"),
    "topo": ("topo", "print the discovered (or simulated) topology and the planned process groups"),
    "sim": ("sim", "run a command on a simulated multi-node cluster (network namespaces, rate-limited links)"),
    "plan": ("plan", "project ETTR and the best snapshot/persist intervals for 1k-100k GPUs"),
    "prebuild": ("prebuild", "build DeepSpeed's CPU comm extension once (used by make install)"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser. Only the ``selected`` command's module is imported (all if None)."""
    parser = argparse.ArgumentParser(prog="robust", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if selected in (None, name):
            mod = importlib.import_module(f"robust_plugins.cli.{module}")
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the CLI is an application
    argv = sys.argv[1:] if argv is None else argv
    selected = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(selected).parse_args(argv)
    from robust_plugins.errors import RobustPluginsError

    try:
        return int(args._run(args) or 0)
    except RobustPluginsError as exc:
        print(f"robust {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

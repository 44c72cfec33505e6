"""``robust bench <name>``: the command; one sub-command a benchmark module."""

from __future__ import annotations

import argparse

from robust_plugins.cli.bench import checkpoint, comm, compression, kernels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``robust bench`` takes a benchmark name as a sub-command."""
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for bench in (compression, kernels, comm, checkpoint):
        bench.add_parser(sub)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen benchmark."""
    return args._bench(args)

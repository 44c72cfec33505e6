"""``robust sim``: run a command on a simulated multi-node cluster, or remove leftover namespaces.

``robust sim run --nodes 2 --ranks-per-node 2 --rate 200mbit --timeout 300 -- python train.py``
starts one process per rank inside network namespaces joined by rate-limited links (see
:mod:`robust_plugins.sim.netns`), prints each rank's output and exits with the worst exit code.
``robust sim cleanup`` deletes ``rpsim-*`` namespaces whose creator died (``--all``: every one).
Needs root and iproute2; without them it says which is missing and exits 2.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands ``run`` and ``cleanup``."""
    sub = parser.add_subparsers(dest="sim_command", metavar="ACTION", required=True)
    run = sub.add_parser("run", help="run COMMAND once per rank on a simulated cluster")
    run.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    run.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    run.add_argument("--rate", default="10gbit", help="inter-node link rate, e.g. 200mbit, 10gbit (default 10gbit)")
    run.add_argument("--timeout", type=float, default=600.0, help="kill every rank after this many seconds (600)")
    run.add_argument("--master-port", type=int, default=29500)
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="after --: the program and its args")
    clean = sub.add_parser("cleanup", help="delete simulator namespaces left by processes that died")
    clean.add_argument("--all", action="store_true", help="also those of live processes (stops their runs)")


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; returns the exit code."""
    from robust_plugins.errors import ConfigError
    from robust_plugins.sim import SimCluster, cleanup_leftovers, require_netns

    require_netns()
    if args.sim_command == "cleanup":
        for ns in cleanup_leftovers(everything=args.all):
            print(f"deleted {ns}")
        return 0
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ConfigError("robust sim run needs a command after `--`, e.g. `-- python train.py`.")
    with SimCluster(args.nodes, args.ranks_per_node, args.rate) as cluster:
        results = cluster.run(argv, timeout_s=args.timeout, master_port=args.master_port, check=False)
    for r in results:
        for stream, text in ((sys.stdout, r.stdout), (sys.stderr, r.stderr)):
            for line in text.splitlines():
                print(f"[node {r.node} rank {r.rank}] {line}", file=stream)
    codes = [r.returncode for r in results]
    return 0 if all(c == 0 for c in codes) else max((abs(c) for c in codes if c), default=1)

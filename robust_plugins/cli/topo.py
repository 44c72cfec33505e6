"""``robust topo``: print the topology (discovered, simulated or from a file) and the planned groups.

Needs no process group: ``--sim 2x4`` (or ``ROBUST_TOPOLOGY_SIM``) or ``--file topo.json`` with
ranks listed describes the whole job; otherwise it shows this host as a world of one.
"""

from __future__ import annotations

import argparse
import json
import os

from robust_plugins.topology import SIM_ENV, UnevenTopologyError, discover, megatron_rank_order, plan_groups


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--file``, ``--sim``, ``--tp``, ``--megatron`` with ``--pp/--cp/--ep``, ``--json``."""
    parser.add_argument("--file", help="topology file (JSON, or YAML with PyYAML) keyed by host name")
    parser.add_argument("--sim", metavar="NxM", help=f"simulated layout, N nodes x M ranks (overrides {SIM_ENV})")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size that must fit in a node (default 1)")
    parser.add_argument(
        "--megatron", action="store_true", help="also print megatron_rank_order for --tp/--pp/--cp/--ep"
    )
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (with --megatron)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (with --megatron)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --megatron)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def report(args: argparse.Namespace) -> dict:
    """The topology and plan as a JSON-ready dict (raises TopologyError on a bad layout)."""
    env = dict(os.environ)
    if args.sim:
        env[SIM_ENV] = args.sim
    topo = discover(args.file, env=env)
    out: dict = {"source": topo.source, "world_size": len(topo.records), "ranks": [r.to_dict() for r in topo.records]}
    try:
        plan = plan_groups(topo.records, tp=args.tp)
    except UnevenTopologyError as exc:
        out["uneven"] = str(exc)
        return out
    out["groups"] = {
        "intra": [{"name": n, "ranks": list(g)} for n, g in zip(plan.domain_names, plan.intra)],
        "rail": [{"name": str(k), "ranks": list(g)} for k, g in enumerate(plan.rails)],
    }
    for t, (names, tier) in enumerate(zip(plan.switch_names, plan.switch_tiers)):
        out["groups"][f"switch{t}"] = [{"name": n, "ranks": list(g)} for n, g in zip(names, tier)]
    if args.megatron:
        out["megatron_rank_order"] = list(
            megatron_rank_order(topo.records, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)
        )
    return out


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def run(args: argparse.Namespace) -> int:
    """Print the report; exit 0 (an uneven layout is reported, not an error: collectives fall back)."""
    data = report(args)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"topology: {data['world_size']} ranks, source {data['source']}")
    rows = [["rank", "host", "nvlink_domain", "rail", "switches"]]
    rows += [[str(r["rank"]), r["host"], r["nvlink_domain"], str(r["local_index"]), ",".join(r["switches"]) or "-"]
             for r in data["ranks"]]
    print("\n".join(_table(rows)))
    if "uneven" in data:
        print(f"\nno hierarchy: {data['uneven']} Hierarchical collectives fall back to flat.")
        return 0
    print()
    rows = [["group", "name", "size", "ranks"]]
    for kind, groups in data["groups"].items():
        rows += [[kind, g["name"], str(len(g["ranks"])), _ranks(g["ranks"])] for g in groups]
    print("\n".join(_table(rows)))
    if "megatron_rank_order" in data:
        order = _ranks(data["megatron_rank_order"])
        print(f"\nmegatron rank order (order[m] = process to run megatron rank m): {order}")
    return 0


def _ranks(ranks: list[int], n: int = 16) -> str:
    return " ".join(map(str, ranks[:n])) + (f" ... ({len(ranks)})" if len(ranks) > n else "")

"""Rank program of ``robust bench comm``: time each all-reduce method on one gradient bucket.

Started once per rank inside the simulator (``python -m robust_plugins.cli.bench.comm_worker``).
Every method reduces the same per-rank input (a seeded normal tensor of ``--mbytes`` MB of fp32),
first once untimed (gloo connects pairs lazily; error-feedback buffers are allocated), then
``--repeats`` times between two barriers. Rank 0 prints one JSON line with every method's times
and its relative error against the flat fp32 all-reduce.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from typing import Callable

import torch
import torch.distributed as dist

#: Methods in table order. ``flat bf16`` is what DeepSpeed's ``communication_data_type: bf16``
#: does (cast, all-reduce in bf16, cast back); the others are this package's collectives. The
#: ``auto`` rows are GradientSync with ``codec: auto`` (``hier``: and ``topology.hierarchical``),
#: what the DeepSpeed integration runs: the untimed first call measures the link and decides.
METHODS = ("flat fp32", "flat bf16", "flat int8", "flat int4", "flat auto", "hier fp32", "hier int8", "hier int4",
           "hier auto")


def _method(name: str, groups, block_size: int) -> Callable[[torch.Tensor], object]:
    """The callable that reduces (sums) a tensor in place with method ``name``."""
    from robust_plugins.comm import CompressionState, compressed_all_reduce
    from robust_plugins.topology import hierarchical_all_reduce

    if name == "flat fp32":
        return lambda t: dist.all_reduce(t)
    if name.endswith("auto"):
        from robust_plugins.comm.gradient_sync import GradientSync
        from robust_plugins.config import CompressionConfig, TopologyConfig

        sync = GradientSync(CompressionConfig(codec="auto", block_size=block_size, auto_recheck_steps=0),
                            step_fn=lambda: 0, topology=TopologyConfig(hierarchical=name.startswith("hier")))

        def auto(t: torch.Tensor) -> None:
            sync.all_reduce_sum(t, None, "bench")
        auto.sync = sync
        return auto
    if name == "flat bf16":
        def bf16(t: torch.Tensor) -> None:
            half = t.to(torch.bfloat16)
            dist.all_reduce(half)
            t.copy_(half)
        return bf16
    layout, codec = name.split()
    codec = "none" if codec == "fp32" else codec
    state = CompressionState(codec=codec, block_size=block_size) if codec != "none" else None
    if layout == "flat":
        return lambda t: compressed_all_reduce(t, codec=codec, op="sum", state=state, key="bench")
    return lambda t: hierarchical_all_reduce(t, groups, codec=codec, op="sum", state=state, key="bench")


def main() -> int:
    """Time the methods; rank 0 prints the JSON result."""
    from robust_plugins.topology import build_groups, discover

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mbytes", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    groups = build_groups(discover().records)
    numel = int(args.mbytes * 1e6) // 4
    source = torch.randn(numel, generator=torch.Generator().manual_seed(1234 + rank))
    reference = source.clone()
    dist.all_reduce(reference)
    out: dict = {"world_size": dist.get_world_size(), "numel": numel, "methods": {}}
    tensor = torch.empty_like(source)
    for name in args.methods:
        op = _method(name, groups, args.block_size)
        times = []
        for i in range(args.repeats + 1):
            tensor.copy_(source)
            dist.barrier()
            start = time.perf_counter()
            op(tensor)
            dist.barrier()
            if i == 0:  # the untimed first call; its result is the one checked
                err = float((tensor - reference).norm() / reference.norm())
            else:
                times.append(time.perf_counter() - start)
        out["methods"][name] = {"times_s": times, "rel_error": err}
        if hasattr(op, "sync"):
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, op.sync.stats.auto_decisions)
            out["methods"][name]["choice"] = "/".join(sorted({d.get("route", d["codec"]) for ds in everyone
                                                               for d in ds}))
            out["methods"][name]["decisions"] = everyone
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

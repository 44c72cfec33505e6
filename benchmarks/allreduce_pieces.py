"""How big should the pieces of the pipelined compressed all-reduce be? A sweep on the simulator.

:func:`robust_plugins.comm.compressed_all_reduce` cuts each rank's chunk into pieces of at most
``collectives.PIECE_NUMEL`` elements and sends piece ``p`` while ``p + 1`` is encoded. This script
times the hierarchical int8 all-reduce of one fp32 bucket on a simulated 2 x 2 cluster (as in
``robust bench comm``) with several piece sizes, side by side in one launch, next to DeepSpeed's
bf16 all-reduce (``communication_data_type: bf16``, the issue's baseline), and checks that every
piece size gives the first call's result bit for bit as one piece does. Needs root and iproute2.

Run (about 1.5 min on 2 CPU cores)::

    python benchmarks/allreduce_pieces.py --rate 200mbit --mbytes 64 --repeats 4 \\
        --pieces 1073741824 2097152 1048576 524288 262144

It prints one markdown table: median and range of the timed calls (barrier to barrier, rank 0),
the ratio flat bf16 / piece size, and whether the result equals the one-piece result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time


def worker(args: argparse.Namespace) -> None:
    """One rank: time flat bf16 and the hierarchical int8 all-reduce per piece size."""
    import torch
    import torch.distributed as dist

    from robust_plugins.comm import CompressionState, collectives
    from robust_plugins.topology import build_groups, discover, hierarchical_all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    groups = build_groups(discover().records)
    numel = int(args.mbytes * 1e6) // 4
    source = torch.randn(numel, generator=torch.Generator().manual_seed(1234 + dist.get_rank()))
    tensor = torch.empty_like(source)
    times, first = {}, {}

    def bf16(t):
        half = t.to(torch.bfloat16)
        dist.all_reduce(half)
        t.copy_(half)

    methods = [("flat bf16", None, bf16)]
    for piece in args.pieces:
        state = CompressionState(codec="int8", block_size=256)
        methods.append((f"hier int8, pieces {piece}", piece,
                        lambda t, s=state: hierarchical_all_reduce(t, groups, codec="int8", op="sum", state=s,
                                                                   key="bench")))
    for name, piece, op in methods:
        if piece is not None:
            collectives.PIECE_NUMEL = piece
        times[name] = []
        for i in range(args.repeats + 1):  # the first call is untimed (gloo connects lazily)
            tensor.copy_(source)
            dist.barrier()
            start = time.perf_counter()
            op(tensor)
            dist.barrier()
            if i == 0:
                first[name] = tensor.clone()
            else:
                times[name].append(time.perf_counter() - start)
    hier = [n for n in first if n != "flat bf16"]
    equal = {n: bool(torch.equal(first[n].view(torch.int32), first[hier[0]].view(torch.int32))) for n in hier}
    if dist.get_rank() == 0:
        print(json.dumps({"times_s": times, "equal_to_first": equal}), flush=True)
    dist.destroy_process_group()


def main() -> int:
    """Launch the sweep on a simulated cluster and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="200mbit", help="inter-node link rate (default 200mbit)")
    parser.add_argument("--mbytes", type=float, default=64.0, help="fp32 bucket size in MB (default 64)")
    parser.add_argument("--repeats", type=int, default=4, help="timed calls per method (default 4)")
    parser.add_argument("--pieces", type=int, nargs="+", default=[1 << 30, 1 << 21, 1 << 20, 1 << 19, 1 << 18],
                        help="PIECE_NUMEL values; the first is the reference for bitwise equality")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on the launch, seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.repeats < 1 or min(args.pieces) < 1:
        parser.error(f"--repeats ({args.repeats}) and every --pieces value ({args.pieces}) must be >= 1")
    from robust_plugins.sim import SimCluster, require_netns

    require_netns()
    argv = [sys.executable, __file__, "--worker", "--mbytes", str(args.mbytes), "--repeats", str(args.repeats),
            "--timeout", str(args.timeout), "--pieces", *map(str, args.pieces)]
    with SimCluster(2, 2, args.rate) as cluster:
        ranks = cluster.run(argv, timeout_s=args.timeout + 30)
    result = json.loads(ranks[0].stdout.strip().splitlines()[-1])
    base = statistics.median(result["times_s"]["flat bf16"])
    print(f"2 x 2 simulated ranks, {args.rate}, {args.mbytes:g} MB fp32 bucket, median of {args.repeats} calls")
    print("| method | median ms | range ms | flat bf16 / this | bitwise = first piece size |")
    print("|---|---|---|---|---|")
    for name, ts in result["times_s"].items():
        med = statistics.median(ts)
        same = result["equal_to_first"].get(name)
        print(f"| {name} | {med * 1e3:.0f} | {min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f} | {base / med:.2f}x | "
              f"{'-' if same is None else 'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

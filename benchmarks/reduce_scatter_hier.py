"""Bytes across nodes of a gradient reduce-scatter: flat int8 vs hierarchical int8, 4 ranks as 2 x 2.

The reduce-scatter of megatron-core's distributed optimizer and DeepSpeed ZeRO-3, one bucket of
``--mbytes`` fp32 a rank per step, on 4 gloo ranks laid out as 2 simulated nodes x 2 ranks
(``ROBUST_TOPOLOGY_SIM=2x2``; one machine, loopback, no rate limit). Rows: DeepSpeed's / megatron's
own fp32 ``reduce_scatter_tensor``, the flat compressed one
(:func:`robust_plugins.comm.compressed_reduce_scatter`, int8 with error feedback) and the
hierarchical one (:func:`robust_plugins.topology.hierarchical_reduce_scatter`, int8 on the rail).

Bytes are counted by :class:`robust_plugins.comm.WireCounter` per group: the hierarchy's rail group
is all inter-node and its node group all intra-node. A flat collective's group spans both nodes;
its ring / all-to-all sends each peer an equal share, so its inter-node bytes are the counted bytes
x (W - ranks per node) / (W - 1) (here 2/3). Times are per step, barrier to barrier, rank 0
(loopback on shared cores: they say what the codec and the staging cost here, not what a slow link
costs). Run (about 30 s on 2 CPU cores)::

    python benchmarks/reduce_scatter_hier.py --mbytes 16 --steps 7

It prints one markdown table: per rank and step, bytes across nodes, inside nodes, the ratio of
bytes across nodes to flat int8's, the median and range of the step time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


def _rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from robust_plugins.comm import CompressionState, WireCounter, compressed_reduce_scatter
    from robust_plugins.topology import build_groups, discover, hierarchical_reduce_scatter

    os.environ["ROBUST_TOPOLOGY_SIM"] = f"{NODES}x{PER_NODE}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    groups = build_groups(discover().records)
    numel = int(args.mbytes * 1e6) // 4 // WORLD * WORLD
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(1234 + rank))
    shard = numel // WORLD
    flat_state = CompressionState(codec="int8", block_size=256)
    hier_state = CompressionState(codec="int8", block_size=256)
    rows = {
        "flat fp32 (host's reduce_scatter_tensor)":
            lambda out, t: dist.reduce_scatter_tensor(out, t),
        "flat int8 (compressed_reduce_scatter)":
            lambda out, t: compressed_reduce_scatter(out, t, state=flat_state, key="bucket"),
        "hier int8 (hierarchical_reduce_scatter)":
            lambda out, t: hierarchical_reduce_scatter(out, t, groups, state=hier_state, key="bucket"),
    }
    result = {}
    for name, op in rows.items():
        times, across, inside = [], [], []
        for step in range(args.steps + 1):  # the first step is untimed (gloo connects lazily)
            out, t = torch.empty(shard), grad.clone()
            dist.barrier()
            with WireCounter() as every, WireCounter(groups.rail) as rail, WireCounter(groups.intra) as intra:
                start = time.perf_counter()
                op(out, t)
                dist.barrier()
                elapsed = time.perf_counter() - start
            if step == 0:
                continue
            times.append(elapsed)
            if name.startswith("hier"):
                across.append(rail.bytes_sent)
                inside.append(intra.bytes_sent)
            else:  # every peer gets an equal share: 2 of the 3 peers are on the other node
                across.append(every.bytes_sent * (WORLD - PER_NODE) // (WORLD - 1))
                inside.append(every.bytes_sent - across[-1])
        result[name] = {"across": statistics.median(across), "inside": statistics.median(inside),
                        "time_median": statistics.median(times), "time_min": min(times), "time_max": max(times)}
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=float, default=16.0, help="fp32 bucket a rank reduce-scatters per step (MB)")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per row (medians)")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from robust_plugins.cli._runs import human_bytes

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join()
    flat_int8 = result["flat int8 (compressed_reduce_scatter)"]["across"]
    print(f"reduce-scatter of {args.mbytes:g} MB fp32 a rank per step, {NODES} nodes x {PER_NODE} ranks "
          f"(simulated, loopback), {args.steps} steps, rank 0\n")
    print("| route | bytes across nodes / rank / step | bytes inside the node | across vs flat int8 "
          "| step time median (range) |")
    print("|---|---|---|---|---|")
    for name, r in result.items():
        print(f"| {name} | {human_bytes(r['across'])} | {human_bytes(r['inside'])} | {r['across'] / flat_int8:.3f}x "
              f"| {r['time_median'] * 1e3:.1f} ms ({r['time_min'] * 1e3:.1f}-{r['time_max'] * 1e3:.1f}) |")


if __name__ == "__main__":
    main()

"""ZeRO-3 on the simulated 2-node cluster: vanilla vs the int8 / int4 reduce-scatter.

    python benchmarks/zero3_bench.py --rate 200mbit --out zero3_200mbit.json   # as root

Two nodes x two gloo ranks (``robust_plugins.sim.netns``, the inter-node link limited to
``--rate``), one set of rank processes runs every variant on the same model and data: vanilla
ZeRO-3 (no block), ``codec: int8`` and ``codec: int4`` (block 256, error feedback), ``hier-int8``
(``topology.hierarchical``: fp32 inside the node, int8 across), ``auto`` (hierarchical, the link
measured by its probes) and vanilla with in-memory snapshots every step (``snapshots``). Per
variant: median step time after ``--warmup`` steps, rank 0's bytes per step by collective
(parameter all-gathers in forward and backward, the gradient reduce-scatter), of those the bytes
on groups that span both nodes (``cross_node_bytes_per_step_rank0``; bus model, so a flat
collective's bytes count whole), the mean loss of the last 5 steps, and for ``snapshots``
the median time each snapshot blocked the loop (``blocking_s``: its part in the step plus the wait
at the next step for the background copy). DeepSpeed's own qgZ / qwZ (``zero_quantized_gradients`` / ``zero_quantized_weights``) are
not in the table: DeepSpeed 0.19.8 has no CPU implementation of their quantizer op
("This op had not been implemented on CPU backend").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

VARIANTS = {
    "vanilla": None,
    "int8": {"compression": {"codec": "int8", "block_size": 256, "min_numel": 0, "warmup_steps": 0}},
    "int4": {"compression": {"codec": "int4", "block_size": 256, "min_numel": 0, "warmup_steps": 0}},
    "hier-int8": {"compression": {"codec": "int8", "block_size": 256, "min_numel": 0, "warmup_steps": 0},
                  "topology": {"hierarchical": True}},
    "auto": {"compression": {"codec": "auto", "min_numel": 0, "warmup_steps": 0}, "topology": {"hierarchical": True}},
    "snapshots": {"checkpoint": {"memory_every": 1}},
}


def _spans_nodes(per_node: int):
    """``filter_group`` for WireCounter: True for a process group with ranks on two nodes."""
    import torch.distributed as dist

    def spans(group) -> bool:
        return len({r // per_node for r in dist.get_process_group_ranks(group)}) > 1

    return spans


def _worker(args) -> None:
    import robust_plugins  # noqa: F401  (installs the DeepSpeed patch)

    import deepspeed
    import torch
    import torch.distributed as dist

    from robust_plugins.comm import WireCounter
    from robust_plugins.workloads.gpt import GPTConfig, build_gpt
    from robust_plugins.workloads.text import get_batch, load_corpus

    torch.set_num_threads(1)
    os.environ.setdefault("ROBUST_JOB_ID", f"zero3-bench-{os.getppid()}")  # the snapshots' job key
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = GPTConfig(n_layer=args.layers, n_head=4, d_model=args.width, seq_len=64)
    corpus = load_corpus(max_bytes=400_000)
    spans = _spans_nodes(int(os.environ.get("LOCAL_WORLD_SIZE", "2")))
    out = {}
    for name in args.variants.split(","):
        block = VARIANTS[name]
        model = build_gpt(shape, seed=1)
        cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7}}
        if block is not None:
            cfg["robust_plugins"] = block
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=cfg)
        times, losses, by_op, cross = [], [], [], []
        for step in range(args.steps):
            x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world, micro_batch=4,
                             seq_len=64)
            dist.barrier()
            t0 = time.perf_counter()
            with WireCounter() as wire, WireCounter(filter_group=spans) as wide:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            times.append(time.perf_counter() - t0)
            cross.append(dict(wide.by_op))
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
            by_op.append(dict(wire.by_op))
        steady = times[args.warmup:]
        out[name] = {"median_step_s": statistics.median(steady), "step_s": steady,
                     "bytes_per_step_rank0": by_op[-1],
                     "cross_node_bytes_per_step_rank0": cross[-1], "loss_last5": statistics.fmean(losses[-5:]),
                     "params": sum(p.ds_numel for p in engine.module.parameters())}
        plugin = getattr(engine, "robust_plugins", None)
        sync = getattr(plugin, "sync", None)
        if sync is not None:
            out[name]["by_route"] = dict(sync.stats.by_route)
            out[name]["by_codec"] = dict(sync.stats.by_codec)
        memory = getattr(plugin, "memory", None)
        if memory is not None:
            memory.finish_pending()
            out[name]["snapshot_blocking_s"] = statistics.median(memory.blocking_s[args.warmup:])
            memory.close(remove=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"rate": args.rate, "world": world, **out}, f, indent=1)
    dist.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--out", required=True)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    if args.worker:
        _worker(args)
        return 0
    from robust_plugins.sim.netns import SimCluster

    args.out = os.path.abspath(args.out)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--rate", args.rate, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--width", str(args.width), "--layers", str(args.layers), "--variants", args.variants, "--out", args.out]
    with SimCluster(2, 2, args.rate) as cluster:
        cluster.run(argv, timeout_s=1200, env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    with open(args.out) as f:
        res = json.load(f)
    for name in args.variants.split(","):
        r = res[name]
        blocking = (f"  snapshot blocking {r['snapshot_blocking_s'] * 1e3:.1f} ms"
                    if "snapshot_blocking_s" in r else "")
        route = f"  route {r['by_route']}" if r.get("by_route") else ""
        print(f"{args.rate} {name:9s} step {r['median_step_s'] * 1e3:8.1f} ms  loss {r['loss_last5']:.4f}  "
              f"bytes/step rank0 {r['bytes_per_step_rank0']}  cross-node {r['cross_node_bytes_per_step_rank0']}"
              f"{route}{blocking}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

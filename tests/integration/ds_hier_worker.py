"""DeepSpeed on 4 CPU ranks as a simulated 2 nodes x 2 ranks (``ROBUST_TOPOLOGY_SIM=2x2``).

Run as ``torchrun --nproc-per-node 4 ds_hier_worker.py --out DIR``. For ZeRO 0, 1 and 2 it takes one
SGD(lr=1) step (the update is the averaged gradient) with plain DeepSpeed and with
``"topology": {"hierarchical": true}`` under codecs none, int8 and auto (told a very slow and a
very fast link), counting the bytes each rank sends on its rail (inter-node) group and its
intra-node group; then trains ZeRO-1 hierarchical int8 and vanilla for a few steps. ZeRO-3 (its
gradient reduce-scatter, node first): one SGD(lr=1) step of each rank's partition, vanilla vs
hierarchical int8 and ``auto`` told a slow link, with the largest local gradient of the plain model
for the codec's bound, then a few AdamW steps vanilla vs hierarchical int8. Rank 0 writes
``DIR/results.json``; ``test_deepspeed_hierarchical.py`` asserts on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import robust_plugins  # noqa: F401  (installs the patch before deepspeed.initialize)

import deepspeed
import torch
import torch.distributed as dist

from ds_worker import MICRO_BATCH, SEED, SEQ_LEN, all_digests, load_corpus, make_engine, train, val_loss
from robust_plugins.workloads.gpt import build_gpt
from robust_plugins.workloads.text import get_batch
from robust_plugins.comm import WireCounter
from _exit import leave_without_teardown

SCENARIOS = {
    "hier_none": {"compression": {"codec": "none"}, "topology": {"hierarchical": True}},
    "hier_int8": {"compression": {"codec": "int8"}, "topology": {"hierarchical": True}},
    "flat_int8": {"compression": {"codec": "int8"}},
    "auto_slow": {"compression": {"codec": "auto", "auto_link_gbit": 0.001}, "topology": {"hierarchical": True}},
    "auto_fast": {"compression": {"codec": "auto", "auto_link_gbit": 1000.0}, "topology": {"hierarchical": True}},
}


def one_step(stage: int, block: dict | None, corpus) -> dict:
    engine = make_engine(stage, block, vanilla=block is None, sgd=True)
    before = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
    plugin = getattr(engine, "robust_plugins", None)
    counters = {}
    if plugin is not None and plugin.config.topology is not None:
        # Groups are built at the first bucket; build them now so the counters can filter on them.
        groups = plugin.sync._hierarchy(None)
        counters = {"rail": WireCounter(groups.rail), "intra": WireCounter(groups.intra)}
    counters["all"] = WireCounter()
    _train_counted(engine, corpus, counters)
    update = before - torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    out = {"update": update, "bytes": {k: c.bytes_sent for k, c in counters.items()},
           "calls": {k: dict(c.calls) for k, c in counters.items()}}
    if plugin is not None:
        s = plugin.sync.stats
        out["stats"] = {"hierarchical_elements": s.hierarchical_elements, "by_codec": dict(s.by_codec),
                        "compressed_elements": s.compressed_elements, "auto_decisions": s.auto_decisions,
                        "by_route": dict(s.by_route)}
        if plugin.sync._hierarchies:  # one data-parallel group: one hierarchy
            (g,) = plugin.sync._hierarchies.values()
            out["intra_ranks"], out["rail_ranks"] = g.intra_ranks, g.rail_ranks
    return out


def _train_counted(engine, corpus, counters: dict) -> None:
    """One training step with every wire counter in ``counters`` open."""
    with contextlib.ExitStack() as stack:
        for c in counters.values():
            stack.enter_context(c)
        train(engine, 1, corpus)


ZERO3 = {"stage3_param_persistence_threshold": 1000}  # the matrices partitioned, the small ones persistent


def zero3_step(block: dict | None, corpus) -> dict:
    """One SGD(lr=1) ZeRO-3 step: this rank's partition update (the reduced gradient), its bytes."""
    engine = make_engine(3, block, vanilla=block is None, sgd=True, zero_extra=ZERO3)
    params = list(engine.module.parameters())
    before = [p.ds_tensor.detach().float().clone() for p in params]
    plugin = getattr(engine, "robust_plugins", None)
    counters = {"all": WireCounter()}
    if plugin is not None and plugin.config.topology is not None:
        groups = plugin.sync._hierarchy(None)
        counters |= {"rail": WireCounter(groups.rail), "intra": WireCounter(groups.intra)}
    _train_counted(engine, corpus, counters)
    update = torch.cat([(b - p.ds_tensor.detach().float()).reshape(-1) for b, p in zip(before, params)])
    out = {"update": update, "bytes": {k: c.bytes_sent for k, c in counters.items()},
           "shard": sum(-(-p.ds_numel // dist.get_world_size()) for p in params)}
    if plugin is not None:
        s = plugin.sync.stats
        out["stats"] = {"hierarchical_elements": s.hierarchical_elements, "by_codec": dict(s.by_codec),
                        "by_route": dict(s.by_route), "collectives": [d["collective"] for d in s.auto_decisions]}
    return out


def zero3(corpus, steps: int) -> dict:
    """ZeRO-3 scenarios (module docstring); this rank's view gathered on every rank."""
    x, y = get_batch(corpus, "train", seed=SEED, step=0, rank=dist.get_rank(), world_size=dist.get_world_size(),
                     micro_batch=MICRO_BATCH, seq_len=SEQ_LEN)
    model = build_gpt("tiny", seed=SEED)
    model(x, y).backward()  # the plain model's local gradient: what each rank's sender quantizes, / world
    absmax = torch.tensor([max(float(p.grad.abs().max()) for p in model.parameters())])
    dist.all_reduce(absmax, op=dist.ReduceOp.MAX)
    exact = zero3_step(None, corpus)
    res: dict = {"absmax": float(absmax), "shard": exact["shard"]}
    for name in ("hier_int8", "auto_slow"):
        got = zero3_step(SCENARIOS[name], corpus)
        diff = got["update"] - exact["update"]
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, {"bytes": got["bytes"], "stats": got["stats"],
                                          "max_abs": float(diff.abs().max()),
                                          "rel_error": float(diff.norm() / exact["update"].norm())})
        res[name] = per_rank
    for name, block in (("vanilla", None), ("hier_int8", SCENARIOS["hier_int8"])):
        engine = make_engine(3, block, vanilla=block is None, zero_extra=ZERO3)
        losses, _ = train(engine, steps, corpus)
        res[f"train_{name}"] = {"losses": losses}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--zero3-steps", type=int, default=4)
    args = ap.parse_args()
    launched = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.use_deterministic_algorithms(True)
    corpus = load_corpus()
    rank = dist.get_rank()
    results: dict = {"world_size": dist.get_world_size()}
    for stage in (0, 1, 2):
        exact = one_step(stage, None, corpus)
        res = {"n_params": exact["update"].numel(), "vanilla_bytes": exact["bytes"]["all"]}
        updates = {}
        for name, block in SCENARIOS.items():
            got = one_step(stage, block, corpus)
            diff = got["update"] - exact["update"]
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, {k: got.get(k) for k in ("bytes", "calls", "intra_ranks", "rail_ranks",
                                                                        "stats")})
            res[name] = {"rel_error": float(diff.norm() / exact["update"].norm()),
                         "max_abs": float(diff.abs().max()), "max_ref": float(exact["update"].abs().max()),
                         "ranks": per_rank}
            updates[name] = got["update"]
        results[f"zero{stage}"] = res
    # Training: ZeRO-1, vanilla vs hierarchical int8 vs auto (told slow), same data and seed.
    for name, block in (("vanilla", None), ("hier_int8", SCENARIOS["hier_int8"]), ("auto_slow", SCENARIOS["auto_slow"])):
        engine = make_engine(1, block, vanilla=block is None)
        losses, _ = train(engine, args.steps, corpus)
        results[f"train_{name}"] = {"losses": losses, "digests": all_digests(engine), "val_loss": val_loss(engine, corpus)}
    start = time.perf_counter()
    results["zero3"] = zero3(corpus, args.zero3_steps)
    results["zero3"]["seconds"] = time.perf_counter() - start  # its share of the launch (test cost)
    results["seconds_before_zero3"] = start - launched
    if rank == 0:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()  # the results are written; see _exit.py

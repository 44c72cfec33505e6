"""DeepSpeed ZeRO 0 with ``compression.overlap`` on and off, 2 CPU ranks (one launch).

Run as ``torchrun --nproc-per-node 2 ds_overlap_worker.py --out DIR`` with
``ROBUST_TOPOLOGY_SIM=2x1`` (two simulated nodes of one rank, so that ``topology.hierarchical``
has a rail). Each scenario trains the tiny GPT with gradient accumulation 2 (the hooks must act on
the boundary micro-step only) and small buckets (several per step), overlap on and off, and
records every rank's parameter digest, the losses and the order of the bucket events (``flush``:
DeepSpeed's reduction point starts; ``dispatch``: a bucket was handed over; ``start``: the sync
thread began reducing it). With overlap, the hook that hands over the last bucket waits (bounded)
until the sync thread has started the first one: proof that the thread reduces while backward
still runs, without depending on how fast the scheduler wakes it. Rank 0 writes ``DIR/results.json``; ``test_deepspeed_overlap.py``
asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import threading

import robust_plugins  # noqa: F401  (installs the patch before deepspeed.initialize)

import deepspeed
import torch
import torch.distributed as dist

from ds_worker import SEED, all_digests, load_corpus
from robust_plugins.errors import UnsupportedError
from robust_plugins.workloads.gpt import build_gpt
from robust_plugins.workloads.text import get_batch
from _exit import leave_without_teardown

MICRO_BATCH = 2
SEQ_LEN = 64
GAS = 2
#: About 10k elements a bucket: the tiny GPT (~0.1M parameters) gives a dozen buckets.
BUCKET_MB = 0.04
BLOCKS = {
    # warmup_steps 1: step 1's buckets go through DeepSpeed's own all-reduce (on the thread, too).
    "flat_int8": {"compression": {"codec": "int8", "warmup_steps": 1, "bucket_mb": BUCKET_MB}},
    "hier_int8": {"compression": {"codec": "int8", "bucket_mb": BUCKET_MB}, "topology": {"hierarchical": True}},
}


def make_engine(block: dict | None, stage: int = 0, sgd: bool = False):
    model = build_gpt("tiny", seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=1.0) if sgd else torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GAS,
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6}}
    if block is not None:
        cfg["robust_plugins"] = block
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


#: codec auto on a link it is told is fast (1000 Gbit/s: the model decides, no trial runs, so the
#: choice is deterministic): the uncompressed flat all-reduce for every bucket, so the engine hands
#: the reduction back to DeepSpeed until the re-check at step AUTO_RECHECK.
AUTO_RECHECK = 3
AUTO_BLOCK = {"compression": {"codec": "auto", "auto_link_gbit": 1000, "auto_recheck_steps": AUTO_RECHECK,
                              "bucket_mb": BUCKET_MB}}


def train(engine, steps: int, corpus, before_micro=None, after_micro=None) -> list:
    """Train ``steps`` optimizer steps; the losses of every micro-step. ``before_micro()`` and
    ``after_micro(micro)`` run around each micro-step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, micro = [], 0
    while engine.global_steps < steps:
        if before_micro is not None:
            before_micro()
        x, y = get_batch(corpus, "train", seed=SEED, step=micro, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=SEQ_LEN)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        micro += 1
        if after_micro is not None:
            after_micro(micro)
    return losses


def plain_run(steps: int, corpus, bf16_steps: tuple = ()) -> dict:
    """DeepSpeed alone (no robust_plugins block): the reference of the hand-back; its
    ``communication_data_type`` (a public property) is bf16 at ``bf16_steps``, else fp32."""
    engine = make_engine(None)

    def set_wire() -> None:
        engine.communication_data_type = torch.bfloat16 if engine.global_steps in bf16_steps else torch.float32

    losses = train(engine, steps, corpus, before_micro=set_wire)
    return {"digests": all_digests(engine), "losses": losses}


def bf16_steps(wires: list) -> tuple:
    """The steps the hand-back sent in bf16 (``wires[i]``: the wire of step ``i + 1``)."""
    return tuple(i + 1 for i, w in enumerate(wires) if w == "bf16")


def run(block: dict, overlap: bool, steps: int, corpus, host_wire: str | None = None) -> dict:
    block = {**block, "compression": {**block["compression"], "overlap": overlap}}
    engine = make_engine(block)
    reduction = engine.robust_plugins.buckets
    wires: list = []
    if host_wire is not None:
        # The timed choice depends on this machine; the test of each wire's reduction fixes it.
        reduction._choose_host_wire = lambda: (host_wire, "fixed by the test")
    events: list = []
    lock = threading.Lock()
    first_started = threading.Event()
    early: list = []
    last = f"b{len(reduction.plan) - 1}"

    def observe(event: str, name: str) -> None:
        with lock:
            events.append([engine.global_steps, event, name])
        if event == "start" and name == "b0":
            first_started.set()
        if overlap and event == "dispatch" and name == last:
            # Still inside backward (the hook of the last bucket's last gradient): the sync thread
            # must be able to start the first bucket now, before DeepSpeed's reduction point.
            early.append(first_started.wait(20))
            first_started.clear()

    reduction.observers.append(observe)

    def record_wire(micro: int) -> None:
        if micro % GAS == 0:  # after each optimizer step: is the next one handed back, and how
            wires.append(reduction.host_wire if reduction.host_reduces() else None)

    losses = train(engine, steps, corpus, after_micro=record_wire)
    s = engine.robust_plugins.sync.stats
    return {"digests": all_digests(engine), "losses": losses, "events": events, "early": early,
            "buckets": len(reduction.plan),
            "threaded": reduction.thread is not None, "compressed_elements": s.compressed_elements,
            "passthrough_elements": s.passthrough_elements, "by_codec": dict(s.by_codec),
            "by_reason": dict(s.by_reason), "by_route": dict(s.by_route), "wires": wires,
            "host_choices": reduction.host_choices,
            "n_params": sum(p.numel() for p in engine.module.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.use_deterministic_algorithms(True)
    corpus = load_corpus()
    results: dict = {}
    for name, block in BLOCKS.items():
        results[name] = {"on": run(block, True, args.steps, corpus), "off": run(block, False, args.steps, corpus)}
    auto_steps = 2 * AUTO_RECHECK
    results["auto_fast"] = {"on": run(AUTO_BLOCK, True, auto_steps, corpus),
                            "off": run(AUTO_BLOCK, False, auto_steps, corpus),
                            "bf16": run(AUTO_BLOCK, True, auto_steps, corpus, host_wire="bf16"),
                            "deepspeed": run(AUTO_BLOCK, True, auto_steps, corpus, host_wire="deepspeed"),
                            "plain": plain_run(auto_steps, corpus),
                            # DeepSpeed's bf16 all-reduce where the hand-back sends bf16 (not at
                            # the deciding steps 0 and 3)
                            "plain_bf16": plain_run(auto_steps, corpus, bf16_steps=(1, 2, 4, 5))}
    for mode in ("on", "off"):
        # A timed choice that changed at the re-check has a reference of its own: DeepSpeed alone
        # with bf16 at exactly the steps the hand-back sent bf16 (the choices are group-agreed).
        bf16 = bf16_steps(results["auto_fast"][mode]["wires"])
        if bf16 not in ((), (1, 2, 4, 5)):
            results["auto_fast"][f"plain_{mode}"] = plain_run(auto_steps, corpus, bf16_steps=bf16)
    refusals = {}
    for what, stage, comp in (("zero1_overlap_true", 1, {"codec": "int8", "overlap": True}),):
        try:
            make_engine({"compression": comp}, stage=stage)
            refusals[what] = None
        except UnsupportedError as exc:
            refusals[what] = str(exc)
    results["refusals"] = refusals
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()  # the results are written; see _exit.py

"""DeepSpeed ZeRO 1 on 2 CPU ranks with ``memory_copy: background``: the optimizer step waits for
a snapshot copy in flight, and a parameter changed outside the step is caught.

Run as ``torchrun --nproc-per-node 2 ds_memory_overlap_worker.py --out DIR``; rank 0 writes
``DIR/results.json`` for ``test_deepspeed_memory_overlap.py``. The copy of one chosen step is held
on the snapshot thread (``SnapshotStore.before_deferred_copy``) while the next step runs.
"""

from __future__ import annotations

import robust_plugins  # noqa: F401,I001  (installs the DeepSpeed patch before deepspeed is used)

import argparse
import json
import os
import threading
import uuid
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from robust_plugins.checkpoint import memory
from robust_plugins.errors import CheckpointError
from robust_plugins.workloads import build_gpt, get_batch, load_corpus
from _exit import leave_without_teardown

MICRO_BATCH = 4


def same(xs: list, ys: list) -> bool:
    """Two equally long, non-empty lists of bitwise equal tensors (an empty or short snapshot
    must not compare equal)."""
    return len(xs) == len(ys) > 0 and all(a is not None and b is not None and torch.equal(a, b)
                                          for a, b in zip(xs, ys))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    job = [uuid.uuid4().hex]
    dist.broadcast_object_list(job, src=0)
    os.environ[memory.ENV_JOB] = f"overlap-{job[0]}"
    model = build_gpt("tiny", 0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
        "robust_plugins": {"checkpoint": {"memory_every": 1, "timeout_s": 60}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    mem = engine.robust_plugins.memory
    corpus = load_corpus(max_bytes=200_000)
    hold, release, reached = {"step": None}, threading.Event(), threading.Event()

    def gate(step):
        if step == hold["step"]:
            reached.set()
            if not release.wait(60):
                raise RuntimeError("test gate never released")

    mem.store.before_deferred_copy = gate

    def fwd_bwd():
        step = engine.global_steps + 1
        x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=model.cfg.seq_len)
        engine.backward(engine(x, y))

    def state_now():
        fp32 = engine.optimizer.single_partition_of_fp32_groups
        return {"params": [t.detach().clone() for t in engine.module.parameters()],
                "fp32": [t.detach().clone() for t in fp32]}

    # step 1 as usual; the copy of step 2 is held while step 3's forward, backward and step run
    fwd_bwd()
    engine.step()
    hold["step"] = 2
    fwd_bwd()
    engine.step()
    assert reached.wait(60)
    before = state_now()
    in_flight = [s.step for s in mem.store.own_snapshots()]  # step 2 not committed yet
    fwd_bwd()
    unchanged_after_backward = same(before["params"], state_now()["params"])
    threading.Timer(1.0, release.set).start()
    engine.step()  # waits in its first line until step 2's copy is committed
    after = state_now()
    mem.settle()
    slots = {s.step: s.slot for s in mem.store.own_snapshots()}
    snap = mem.store.load(slots[2])[1]
    snap_params = [snap["module"].get(n) for n, _ in engine.module.named_parameters()]
    snap_fp32 = snap["optimizer"]["single_partition_of_fp32_groups"]
    result = {
        "in_flight_committed": in_flight,
        "unchanged_after_backward": unchanged_after_backward,
        "snapshot_is_step2": same(snap_params, before["params"]) and same(snap_fp32, before["fp32"]),
        "step3_changed_params": not same(after["params"], before["params"]),
        "committed_after": sorted(slots),
        "wait_s": list(mem.wait_s), "blocking_s": list(mem.blocking_s),
    }
    # a parameter changed in place by the training loop while step 4's copy is in flight
    hold["step"] = 4
    release.clear()
    reached.clear()
    fwd_bwd()
    engine.step()
    assert reached.wait(60)
    name, prm = next(iter(engine.module.named_parameters()))
    with torch.no_grad():
        prm.mul_(0.5)
    release.set()
    try:
        mem.settle()
        result["torn_error"] = None
    except CheckpointError as exc:
        result["torn_error"] = str(exc)
    result["param_name"] = name
    result["committed_after_torn"] = sorted(s.step for s in mem.store.own_snapshots())
    out = [None] * world
    dist.all_gather_object(out, result)
    if rank == 0:
        Path(args.out, "results.json").write_text(json.dumps(out, indent=1))
    dist.barrier()
    mem.store.close(remove=True)
    memory.remove_job(memory.job_key())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()  # the results are written; see _exit.py

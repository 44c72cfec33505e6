"""Where an in-memory snapshot's blocking time goes (issue 4), one DeepSpeed rank, no peers.

Run: ``DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 1 benchmarks/snapshot_profile.py``

Builds the ``robust bench checkpoint`` model (text GPT ``small``, ZeRO 1, ``memory_every: 1``),
trains 10 steps, then times each part of ``SnapshotStore.save`` on the live state, median of
``--repeats`` calls: building the state dict (``capture``), walking it into a tensor list and a
schema (``flat.flatten``), JSON-encoding the schema, and the raw tensor copy into a shared-memory
slot (warm: the same slot again and again; alternating: the two slots in turn, as ``save`` does),
next to ``save`` itself and to the crc32 the background thread computes. Prints one JSON object.
"""

from __future__ import annotations

import robust_plugins  # noqa: F401,I001

import argparse
import json
import os
import statistics
import time
import uuid

import deepspeed
import torch
import torch.distributed as dist

from robust_plugins.checkpoint import flat, memory
from robust_plugins.workloads import build_gpt, get_batch, load_corpus


def _ms(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return round(statistics.median(out) * 1e3, 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    os.environ[memory.ENV_JOB] = f"profile-{uuid.uuid4().hex[:12]}"
    model = build_gpt("small", 0)
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
           "robust_plugins": {"checkpoint": {"memory_every": 1}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    corpus = load_corpus(max_bytes=400_000)
    steps = []
    for step in range(1, 11):
        x, y = get_batch(corpus, "train", seed=0, step=step, rank=0, world_size=1, micro_batch=8,
                         seq_len=model.cfg.seq_len)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        steps.append(time.perf_counter() - t0)
    mem = engine.robust_plugins.memory
    store = mem.store
    store.flush()
    state = mem.capture()
    schema, tensors = flat.flatten(state, store.allowed)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    bufs = [s.bytes() for s in store.slots]

    def copy_into(buf):
        off = 1 << 16
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
            off += n

    turn = [0]

    def alternating():
        turn[0] ^= 1
        copy_into(bufs[turn[0]])

    saves = []
    for i in range(args.repeats):
        saves.append(store.save(1000 + i, state))
        store.flush()  # the background commit is not what is measured here
    res = {
        "tensors": len(tensors), "bytes": nbytes,
        "step_ms": round(statistics.median(steps[2:]) * 1e3, 3),
        "blocking_during_training_ms": round(statistics.median(mem.blocking_s[2:]) * 1e3, 3),
        "save_ms": round(statistics.median(saves) * 1e3, 3),
        "capture_ms": _ms(mem.capture, args.repeats),
        "flatten_ms": _ms(lambda: flat.flatten(state, store.allowed), args.repeats),
        "json_ms": _ms(lambda: json.dumps(schema, separators=(",", ":")).encode(), args.repeats),
        "copy_warm_ms": _ms(lambda: copy_into(bufs[0]), args.repeats),
        "copy_alternating_ms": _ms(alternating, args.repeats),
        "crc32_background_ms": _ms(lambda: memory._crc(store.slots[0].buf, memory.HEADER_SIZE,
                                                       store.slots[0].header().total), 10),
    }
    print(json.dumps(res, indent=1))
    store.close(remove=True)
    memory.remove_job(memory.job_key())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

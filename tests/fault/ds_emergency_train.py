"""A DeepSpeed loop with no checkpoint code at all: the ``robust_plugins`` block does it.

The block's ``"checkpoint": {"dir": ..., "resume": true, "persist_every": N}`` makes
``deepspeed.initialize`` load the newest valid checkpoint (so the loop starts at
``engine.global_steps + 1``), saves every N steps, and, under ``robust run``, registers the
emergency save (``patches/deepspeed_emergency.py``). Batches are indexed by step. Rank 0 writes
where it started, the final loss (mean over ranks) and a hash of the parameters to ``--out``.
"""

from __future__ import annotations

import robust_plugins  # noqa: F401,I001  (installs the DeepSpeed patch before deepspeed is used)

import argparse
import hashlib
import json
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from robust_plugins.workloads import build_gpt, get_batch, load_corpus

MICRO_BATCH = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--persist-every", type=int, default=100)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_gpt("tiny", 0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        # CPU: DeepSpeed's 5e8-element default buckets cost seconds a step (HOSTS.md).
        "zero_optimization": {"stage": args.zero, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
        "robust_plugins": {"checkpoint": {"dir": args.ckpt_dir, "resume": True,
                                          "persist_every": args.persist_every}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    start = engine.global_steps + 1
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus(max_bytes=200_000)
    loss_value = None
    for step in range(start, args.steps + 1):
        x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=model.cfg.seq_len)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loss_value = float(mean) / world
    h = hashlib.sha256()
    for _, prm in sorted(engine.module.named_parameters()):
        h.update(prm.detach().contiguous().numpy().tobytes())
    if rank == 0:
        Path(args.out).write_text(json.dumps({"started_at": start, "final_loss": loss_value,
                                              "params_hash": h.hexdigest()}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

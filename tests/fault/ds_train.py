"""A DeepSpeed training script that follows the resume contract of ``robust run``.

On start it loads the newest checkpoint (``engine.load_checkpoint``; none on a first start) and
continues at ``engine.global_steps + 1``; batches are indexed by step; it checkpoints every
``--save-every`` steps (``engine.save_checkpoint``) and reports each step with
``robust_plugins.watchdog.step_end``. Rank 0 writes the final loss and a parameter hash.
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

from robust_plugins import watchdog
from robust_plugins.workloads import build_gpt, get_batch, load_corpus

MICRO_BATCH = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10)
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
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if (Path(args.ckpt_dir) / "latest").exists():
        engine.load_checkpoint(args.ckpt_dir)
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
        watchdog.step_end(step, loss=loss_value)
        # save_checkpoint is collective: every rank gets the same answer from the node monitor.
        if step % args.save_every == 0 and watchdog.ok_to_save(step):
            engine.save_checkpoint(args.ckpt_dir)
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

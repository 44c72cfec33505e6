"""A DeepSpeed training script that never calls the watchdog: with a ``robust_plugins`` block the
engine reports its steps (and asks before saving) by itself under ``robust run``.

It follows the resume contract (load the newest checkpoint, continue at ``global_steps + 1``,
batches indexed by step). Rank 0 writes the final loss, a parameter hash and the steps' losses.
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--block", default='{"watchdog": {}}', help="the robust_plugins block (JSON)")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_gpt("tiny", 0)
    micro = 4
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": args.gas,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
        "robust_plugins": json.loads(args.block),
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if (Path(args.ckpt_dir) / "latest").exists():
        engine.load_checkpoint(args.ckpt_dir)
    start = engine.global_steps + 1
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus(max_bytes=200_000)
    loss_value, losses = None, {}
    for step in range(start, args.steps + 1):
        total = 0.0
        for micro_step in range(args.gas):
            x, y = get_batch(corpus, "train", seed=micro_step, step=step, rank=rank, world_size=world,
                             micro_batch=micro, seq_len=model.cfg.seq_len)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss)
        losses[step] = total / args.gas  # this rank's mean micro-batch loss, as the engine reports it
        mean = torch.tensor([losses[step]])
        dist.all_reduce(mean)
        loss_value = float(mean) / world
        if step % args.save_every == 0:
            engine.save_checkpoint(args.ckpt_dir)
    h = hashlib.sha256()
    for _, prm in sorted(engine.module.named_parameters()):
        h.update(prm.detach().contiguous().numpy().tobytes())
    info = getattr(engine.robust_plugins, "watchdog", None)
    latest = info.latest if info is not None else None
    Path(f"{args.out}.rank{rank}").write_text(json.dumps({
        "losses": losses, "latest": None if latest is None else latest.__dict__}) + "\n")
    if rank == 0:
        Path(args.out).write_text(json.dumps({"started_at": start, "final_loss": loss_value,
                                              "params_hash": h.hexdigest()}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

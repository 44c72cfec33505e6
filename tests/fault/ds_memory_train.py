"""A DeepSpeed script with in-memory snapshots every step and peer backup, for ``robust run``.

Follows the resume contract (FORMAT.md) with one difference: it calls ``engine.load_checkpoint``
on every start, because the newest state is usually in shared memory, not on disk (``--load never``:
no call, the resume inside ``deepspeed.initialize`` alone, ``docs/recovery.md``). Disk
checkpoints are written every ``--persist-every`` steps by the plugin itself. Rank 0 writes the
final loss and a hash of the parameters and optimizer state.
"""

from __future__ import annotations

import robust_plugins  # noqa: F401,I001  (installs the DeepSpeed patch before deepspeed is used)

import argparse
import hashlib
import json
import os
import random
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from robust_plugins import watchdog
from robust_plugins.checkpoint import memory
from robust_plugins.workloads import build_gpt, get_batch, load_corpus

MICRO_BATCH = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--persist-every", type=int, default=8)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--lose-node", default="",
                   help="comma-separated ranks whose shared memory (own snapshots and the copies they "
                        "keep) is wiped before a restarted incarnation restores: a lost node")
    p.add_argument("--load", choices=("always", "never"), default="always",
                   help="never: no engine.load_checkpoint call (the resume inside deepspeed.initialize, "
                        "on by default under robust run, is all there is)")
    p.add_argument("--resume", choices=("unset", "true", "false"), default="unset",
                   help="checkpoint.resume in the block (unset: the default)")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    lost = {int(r) for r in args.lose_node.split(",") if r}
    if int(os.environ.get("ROBUST_INCARNATION", "0")) > 0 and int(os.environ["RANK"]) in lost:
        # Before anything maps them: each rank deletes only its own files (own slots, and the
        # copies it keeps), which is what a node that came back empty looks like.
        job, rank = memory.job_key(), int(os.environ["RANK"])
        for path in memory.job_files(job):
            name = os.path.basename(path)
            if f".r{rank:05d}.s" in name or f".at{rank:05d}." in name:
                os.remove(path)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_gpt("tiny", 0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        # CPU: DeepSpeed's 5e8-element default buckets cost seconds a step (HOSTS.md).
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
        "robust_plugins": {"checkpoint": {"dir": args.ckpt_dir, "memory_every": 1, "peer_backup": True,
                                          "persist_every": args.persist_every, "timeout_s": 60}},
    }
    if args.resume != "unset":
        config["robust_plugins"]["checkpoint"]["resume"] = args.resume == "true"
    # torch, numpy and Python RNG seeded per rank, the same in every incarnation: only a restore
    # (which may run inside initialize) brings a restarted rank the states of its resumed step.
    seed = 100 + int(os.environ["RANK"])
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    loaded = None
    if args.load == "always":
        loaded, _ = engine.load_checkpoint(args.ckpt_dir)  # memory -> peer copy -> disk; nothing on a first start
    start = engine.global_steps + 1
    corpus = load_corpus(max_bytes=200_000)
    loss_value = None
    for step in range(start, args.steps + 1):
        x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=model.cfg.seq_len)
        # Draws from the three RNGs scale the loss (and gradients): a resumed run ends bitwise
        # equal to the clean one only if every rank's RNG states came back.
        noise = torch.rand(()) + float(np.random.rand()) + random.random()
        loss = engine(x, y) * (1 + 0.05 * noise)
        engine.backward(loss)
        engine.step()  # the snapshot of this step is taken here
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loss_value = float(mean) / world
        watchdog.step_end(step, loss=loss_value)
    h = hashlib.sha256()
    for _, prm in sorted(engine.module.named_parameters()):
        h.update(prm.detach().contiguous().numpy().tobytes())
    opt_hashes = [None] * world
    o = hashlib.sha256()
    for t in engine.optimizer.single_partition_of_fp32_groups if args.stage else []:
        o.update(t.detach().contiguous().numpy().tobytes())
    dist.all_gather_object(opt_hashes, o.hexdigest())
    if rank == 0:
        Path(args.out).write_text(json.dumps({"started_at": start, "final_loss": loss_value, "loaded": loaded,
                                              "params_hash": h.hexdigest(), "fp32_hashes": opt_hashes}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

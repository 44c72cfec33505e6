"""A DeepSpeed ZeRO-3 (bf16) script with in-memory snapshots every step, for ``robust run``.

It never calls ``engine.load_checkpoint``: the resume inside ``deepspeed.initialize`` (on by
default under ``robust run``) is all there is. The model is initialized from a different seed in
every incarnation and every rank seeds its RNGs per incarnation too, so only a restore can make a
restarted job right. Rank 0 writes the final loss, every rank's hash of its ZeRO-3 state
(fp32 master partition, bf16 parameter partition, Adam's state) and what
``watchdog.check_params`` said (ZeRO-3 refuses it: no replicas to compare).
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
from robust_plugins.errors import UnsupportedError
from robust_plugins.workloads import build_gpt, get_batch, load_corpus

MICRO_BATCH = 4


def state_hash(engine) -> str:
    """sha256 of this rank's ZeRO-3 partitions and optimizer state."""
    opt = engine.optimizer
    h = hashlib.sha256()
    for t in list(opt.fp32_partitioned_groups_flat) + list(opt.fp16_partitioned_groups_flat):
        h.update(t.detach().float().contiguous().numpy().tobytes())
    for st in opt.optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                h.update(v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    incarnation = int(os.environ.get("ROBUST_INCARNATION", "0"))
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_gpt("tiny", 17 * incarnation)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        # Parameters under 1000 elements stay gathered (persistent), the matrices are partitioned.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000,
                              "reduce_bucket_size": 5e6, "stage3_prefetch_bucket_size": 5e6},
        "robust_plugins": {"checkpoint": {"dir": args.ckpt_dir, "memory_every": 1, "peer_backup": True,
                                          "timeout_s": 60}},
    }
    seed = 100 + int(os.environ["RANK"]) + 1000 * incarnation
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    start = engine.global_steps + 1
    try:  # ZeRO-3 has no replicas to compare: the SDC check refuses rather than hash placeholders
        watchdog.check_params(start, engine.module)
        check_params = "ran"
    except UnsupportedError as exc:
        check_params = str(exc)
    corpus = load_corpus(max_bytes=200_000)
    loss_value = None
    for step in range(start, args.steps + 1):
        x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=model.cfg.seq_len)
        # Draws from the three RNGs scale the loss: a resumed run ends bitwise equal to the clean
        # one only if every rank's RNG states came back with its partitions.
        noise = torch.rand(()) + float(np.random.rand()) + random.random()
        loss = engine(x, y) * (1 + 0.05 * noise)
        engine.backward(loss)
        engine.step()  # the snapshot of this step is taken here (the watchdog's step signal too)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        loss_value = float(mean) / world
    hashes = [None] * world
    dist.all_gather_object(hashes, state_hash(engine))
    if rank == 0:
        Path(args.out).write_text(json.dumps({"started_at": start, "final_loss": loss_value, "hashes": hashes,
                                              "restored": engine.robust_plugins.memory.restored,
                                              "check_params": check_params}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A DeepSpeed pipeline-engine script (2 stages x 2 replicas, ZeRO-1) with snapshots every step,
for ``robust run``.

The script never loads: the resume inside ``deepspeed.initialize`` (on by default under ``robust
run``) is all there is, and it continues at ``engine.global_steps + 1``. Each incarnation seeds
its layers differently, so only a restore can make a restarted job right. Rank 0 writes the final
loss and every rank's hash of its stage's parameters and its ZeRO-1 partition and Adam state.
"""

from __future__ import annotations

import robust_plugins  # noqa: F401,I001  (installs the DeepSpeed patch before deepspeed is used)

import argparse
import hashlib
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

from robust_plugins.workloads import get_batch, load_corpus

MICRO_BATCH, SEQ_LEN, WIDTH = 4, 32, 64


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(256, WIDTH)

    def forward(self, idx):
        return self.tok(idx)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    incarnation = int(os.environ.get("ROBUST_INCARNATION", "0"))
    deepspeed.init_distributed(dist_backend="gloo")
    layers = [LayerSpec(Embed), LayerSpec(Block), LayerSpec(Block), LayerSpec(nn.Linear, WIDTH, 256)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform",
                           seed_layers=True, base_seed=1234 + 17 * incarnation)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=3e-3)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 2,
              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
              "robust_plugins": {"checkpoint": {"dir": args.ckpt_dir, "memory_every": 1, "peer_backup": True,
                                                "timeout_s": 60}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    start = engine.global_steps + 1
    corpus = load_corpus(max_bytes=200_000)
    dp, dp_world = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    loss = None
    for step in range(start, args.steps + 1):
        micro = [get_batch(corpus, "train", seed=0, step=2 * step + m, rank=dp, world_size=dp_world,
                           micro_batch=MICRO_BATCH, seq_len=SEQ_LEN) for m in range(2)]
        loss = float(engine.train_batch(iter(micro)))  # the snapshot (and the step signal) after it
    h = hashlib.sha256()
    for _, q in sorted(engine.module.named_parameters()):
        h.update(q.detach().contiguous().numpy().tobytes())
    for t in engine.optimizer.single_partition_of_fp32_groups:
        h.update(t.detach().contiguous().numpy().tobytes())
    for st in engine.optimizer.optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                h.update(v.detach().float().contiguous().numpy().tobytes())
    hashes = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, h.hexdigest())
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"started_at": start, "final_loss": loss, "hashes": hashes}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

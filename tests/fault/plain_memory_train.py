"""A plain PyTorch loop (DDP or FSDP2 over gloo) with in-memory snapshots from
:class:`robust_plugins.Snapshotter`, for the fault tests.

Its loss depends on torch's RNG (dropout), numpy's and Python's (a noise term), and on a
registered data position, so a resume is bitwise only if the snapshot brings all of them back.
Rank 0 writes ``--out`` (JSON): the step it started at, every step's loss, a hash of every rank's
parameters and optimizer state (FSDP2: of every rank's shards), and where the restore came from.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import robust_plugins


def _tensor_hash(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--memory-every", type=int, default=1)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--static-buckets", action="store_true",
                   help="DDP keeps its construction-order gradient buckets (find_unused_parameters=True)")
    p.add_argument("--persist-every", type=int, help="background disk saves into --ckpt-dir every N steps")
    p.add_argument("--peer-backup", action="store_true", help="checkpoint.peer_backup")
    p.add_argument("--ckpt-dir", help="checkpoint.dir (with --persist-every)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                              torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1))
    if args.mode == "ddp":
        # DDP re-orders its gradient buckets once, after a process's first backward, so a restarted
        # process's first step sums them in construction order; over more than 2 ranks gloo's
        # sum order follows the bucket layout. find_unused_parameters=True never re-orders.
        model = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=args.static_buckets)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    torch.manual_seed(1000 + rank)  # per-rank dropout streams
    np.random.seed(rank)
    random.seed(rank)
    data = {"pos": 0}
    cfg = {"memory_every": args.memory_every, "peer_backup": args.peer_backup}
    if args.persist_every:
        cfg.update(persist_every=args.persist_every, dir=args.ckpt_dir)
    snap = robust_plugins.Snapshotter(model, optimizer, cfg, lr_scheduler=sched)
    snap.register("data", lambda: dict(data), data.update)
    start = (snap.restore() or 0) + 1
    losses = {}
    for step in range(start, args.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(8, 16, generator=g)
        y = x.sum(dim=1, keepdim=True) + float(np.random.rand()) * 0.01 + random.random() * 0.01
        loss = torch.nn.functional.mse_loss(model(x), y) * (1 + data["pos"] % 3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sched.step()
        data["pos"] += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = float(mean) / world
        snap.step_end(step, loss=losses[step])
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    mine = _tensor_hash(list(model.parameters()) + state)
    hashes = [None] * world
    dist.all_gather_object(hashes, mine)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "started_at": start, "losses": losses, "final_loss": losses.get(args.steps), "hashes": hashes,
            "restored": snap.restored, "blocking_s": sum(snap.blocking_s), "pos": data["pos"]}) + "\n")
    snap.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

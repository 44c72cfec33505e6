"""A plain PyTorch data-parallel script that follows the resume contract at any world size.

Every optimizer step trains on the same ``--global-batch`` samples whatever the world size: rank r
takes micro-batches ``r*accum .. r*accum+accum-1`` of the step, with ``accum`` from
``robust_plugins.watchdog.grad_accumulation``; gradients are summed over ranks (gloo) and divided
by the global batch. The model and optimizer are replicated, so rank 0's checkpoint (written every
step, atomically, to the shared ``--ckpt-dir``) restores any world size. Without ``WORLD_SIZE`` in
the environment it runs alone without a process group (the reference the tests compare with).

``--emergency`` registers rank-side emergency saves (``watchdog.on_emergency``) of the same
checkpoint. ``--nccl-like`` reduces the way an NCCL rank's host experiences it: the all-reduces are
launched and the host then waits for them without ever seeing an exception (a dead peer leaves an
NCCL rank blocked in ``.item()`` until torch's watchdog tears it down from C++). Rank 0 appends ``{"step", "world", "accum", "loss"}`` to ``<out>.steps.jsonl`` and writes the final
parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from robust_plugins import watchdog

DIM = 8


def sample(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100_003 + index)
    x = torch.randn(DIM, generator=g, dtype=torch.float64)
    return x, (x * torch.arange(1, DIM + 1, dtype=torch.float64)).sum(0, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--emergency", action="store_true",
                   help="register an emergency save (watchdog.on_emergency)")
    p.add_argument("--nccl-like", action="store_true",
                   help="wait for the gradient all-reduce like an NCCL host: never raise, block")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        # Bounded: a peer that vanished mid-collective must end this rank, not block it for 30 min.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = Path(args.ckpt_dir) / "latest.pt"
    start = 1
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"]) + 1
    accum = watchdog.grad_accumulation(args.global_batch, args.micro_batch, world)

    def save(step: int, tag: str = "") -> None:
        # Any rank may write: the state is replicated, and os.replace makes the file whole.
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(f".tmp{rank}")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
        os.replace(tmp, ckpt)

    if args.emergency:
        # A peer's death surfaces here inside a gradient all-reduce, before opt.step(): the
        # parameters and optimizer are then exactly those of the last reported step.
        watchdog.on_emergency(save)
    steps_log = Path(args.out + ".steps.jsonl")
    for step in range(start, args.steps + 1):
        opt.zero_grad()
        total = torch.zeros(1, dtype=torch.float64)
        for k in range(accum):
            first = (rank * accum + k) * args.micro_batch
            for i in range(first, first + args.micro_batch):
                x, y = sample(step, i)
                loss = ((model(x) - y) ** 2).sum() / args.global_batch
                loss.backward()
                total += loss.detach()
        if distributed and args.nccl_like:
            works = [dist.all_reduce(t, async_op=True) for t in [*(p.grad for p in model.parameters()), total]]
            for w in works:
                while not w.is_completed():
                    time.sleep(0.005)
                if w.exception() is not None:
                    while True:  # the NCCL host: blocked behind a kernel that never finishes
                        time.sleep(0.1)
        elif distributed:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
            dist.all_reduce(total)
        opt.step()
        watchdog.step_end(step, loss=float(total))
        if rank == 0:
            if step % args.save_every == 0:
                save(step)
            with open(steps_log, "a") as f:
                f.write(json.dumps({"step": step, "world": world, "accum": accum,
                                    "loss": float(total)}) + "\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if rank == 0:
        Path(args.out).write_text(json.dumps(
            {"params": [v.flatten().tolist() for v in model.state_dict().values()],
             "world": world, "accum": accum}))
    if distributed:
        # Leave together: a gloo rank whose peer tore its pairs down first can abort at exit.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

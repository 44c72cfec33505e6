"""Train the byte-level GPT with plain PyTorch (gloo/NCCL data parallel), restartable by ``robust run``.

The recipe is the reference for the resume contract of ``robust run`` (``watchdog/FORMAT.md``):

- every ``--save-every`` steps rank 0 writes ``<ckpt-dir>/step-NNNNNNNN.pt`` atomically (a
  temporary file, fsync, ``os.replace``), so a crash mid-save leaves the previous one intact;
- on start every rank loads the newest checkpoint, if any, and continues at the step after it
  (with the watchdog's step times, ``watchdog.state_dict()``: a relaunch keeps the learned hang
  timeout);
- batches are a pure function of the step (:func:`robust_plugins.workloads.get_batch`), so a
  resumed run sees exactly the batches the uninterrupted run would have seen;
- a step whose batch spiked again after a rollback (``robust_plugins.watchdog.skip_batch``) is
  skipped: no update, the step numbering goes on;
- with ``--memory-every N`` it also snapshots its whole state into shared memory every N steps
  (:class:`robust_plugins.Snapshotter`) and on start restores the newest snapshot every rank
  holds when it is newer than the newest disk checkpoint (a restart then loses at most one step
  with ``--memory-every 1``, not up to ``--save-every``);
- after each optimizer step it calls ``robust_plugins.watchdog.step_end(step, loss, grad_norm)``
  (through ``Snapshotter.step_end`` with ``--memory-every``)
  and ``robust_plugins.watchdog.check_params(step, model)``, and saves only when the replicas'
  parameter hashes agree and ``robust_plugins.watchdog.ok_to_save(step)`` says no fault was seen.

With ``torch.use_deterministic_algorithms`` on CPU, a run that was killed and resumed ends with
bitwise the same parameters and loss as one that never failed. Run it with::

    robust run --standalone --nproc-per-node 2 --max-restarts 2 \\
        -m robust_plugins.recipes.plain_gpt.train --steps 60 --ckpt-dir runs/ckpt --out runs/result.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from robust_plugins import watchdog
from robust_plugins.workloads import build_gpt, get_batch, load_corpus

_CKPT = re.compile(r"^step-(\d{8})\.pt$")

#: Checkpoints kept; older ones are deleted after a successful save.
KEEP = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps to reach")
    p.add_argument("--ckpt-dir", required=True, help="checkpoint directory (shared by all ranks)")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--memory-every", type=int, default=0,
                   help="in-memory snapshot every N steps (robust_plugins.Snapshotter; 0: off)")
    p.add_argument("--out", help="rank 0 writes the result JSON here at the end")
    p.add_argument("--preset", default="tiny", help="GPT size (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--corpus-bytes", type=int, default=1_000_000, help="bytes of text to read")
    p.add_argument("--pg-timeout-s", type=float, default=300.0,
                   help="process-group timeout; the watchdog usually acts long before it")
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_every < 1 or args.memory_every < 0:
        p.error(f"--steps ({args.steps}) and --save-every ({args.save_every}) must be >= 1, "
                f"--memory-every ({args.memory_every}) >= 0")
    return args


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint with the highest step in ``ckpt_dir`` (temporary files are ignored)."""
    if not ckpt_dir.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _CKPT.match(p.name)))
    return found[-1][1] if found else None


def save_checkpoint(ckpt_dir: Path, step: int, model, optimizer, loss: float) -> Path:
    """Write ``step-NNNNNNNN.pt`` atomically and keep the newest :data:`KEEP`."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step-{step:08d}.pt"
    tmp = ckpt_dir / f".{final.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save({"step": step, "loss": loss, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "watchdog": watchdog.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    old = sorted(p for p in ckpt_dir.iterdir() if _CKPT.match(p.name))[:-KEEP]
    for p in old:
        p.unlink(missing_ok=True)
    return final


def params_hash(model) -> str:
    """SHA-256 of every parameter's bytes, in name order (bitwise identity check)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    """Train, checkpointing and resuming as described in the module docstring."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", timeout=watchdog.pg_timeout(args.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_gpt(args.preset, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt_dir = Path(args.ckpt_dir)
    start = 1
    ckpt = newest_checkpoint(ckpt_dir)
    snap = None
    snap_step = None
    if args.memory_every:
        import robust_plugins

        snap = robust_plugins.Snapshotter(model, optimizer, {"memory_every": args.memory_every})
        # The snapshot when it is newer than the disk checkpoint (the same on every rank).
        snap_step = snap.restore(disk_step=int(_CKPT.match(ckpt.name).group(1)) if ckpt is not None else None)
    if snap_step is not None:
        start = snap_step + 1
        ckpt = None
        if rank == 0:
            print(f"[rank 0] resumed from memory (step {snap_step}): continuing at step {start}", flush=True)
    elif ckpt is not None:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        watchdog.load_state_dict(state.get("watchdog"))  # learned hang timeout, after a relaunch
        start = state["step"] + 1
        if rank == 0:
            print(f"[rank 0] resumed from {ckpt.name}: continuing at step {start}", flush=True)
    corpus = load_corpus(max_bytes=args.corpus_bytes)
    params = [p for p in model.parameters() if p.requires_grad]
    # The checkpoint's own loss: a job resumed from its final checkpoint still reports one.
    losses: dict[int, float] = {start - 1: state["loss"]} if ckpt is not None else {}
    t0 = time.monotonic()
    step_times: list[float] = []
    for step in range(start, args.steps + 1):
        t_step = time.perf_counter()
        if watchdog.skip_batch(step):
            if rank == 0:
                print(f"[rank 0] skipping the batch of step {step}: it spiked again after a "
                      f"rollback (robust run)", flush=True)
            (snap.step_end if snap is not None else watchdog.step_end)(step)
            continue
        x, y = get_batch(corpus, "train", seed=args.seed, step=step, rank=rank, world_size=world,
                         micro_batch=args.micro_batch, seq_len=model.cfg.seq_len)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        # One flat all-reduce for gradients and the loss: fewer collectives, same sums.
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
        mean_loss = float(flat[-1])
        grad_norm = float(torch.linalg.vector_norm(flat[:-1]))
        optimizer.step()
        losses[step] = mean_loss
        (snap.step_end if snap is not None else watchdog.step_end)(step, loss=mean_loss, grad_norm=grad_norm)
        # Compare parameter hashes across replicas (every sdc_every_steps) before saving: a
        # checkpoint written from a corrupted replica would make the corruption permanent.
        replicas_agree = watchdog.check_params(step, model)
        # ok_to_save: the monitor has seen every rank's report of this step and no fault in it.
        if step % args.save_every == 0 and rank == 0 and replicas_agree and watchdog.ok_to_save(step):
            save_checkpoint(ckpt_dir, step, model, optimizer, mean_loss)
        step_times.append(time.perf_counter() - t_step)
    dist.barrier()
    if snap is not None:
        snap.close()
    if rank == 0:
        result = {"steps": args.steps, "started_at": start, "final_loss": losses.get(args.steps),
                  "losses": {str(k): v for k, v in losses.items()}, "params_hash": params_hash(model),
                  "world_size": world, "wall_s": round(time.monotonic() - t0, 3),
                  # Rank 0's median wall time of a step in this incarnation (the watchdog benchmark).
                  "step_time_median_s": statistics.median(step_times) if step_times else None}
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"[rank 0] done: step {args.steps}, loss {result['final_loss']:.6f}, "
              f"{args.steps - start + 1} steps in {result['wall_s']:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

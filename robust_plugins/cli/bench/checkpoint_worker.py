"""One torchrun launch of ``robust bench checkpoint`` (see ``checkpoint.py``).

Trains the text GPT with ``memory_every: 1`` and ``peer_backup`` on every rank, ``--steps`` steps
with ``memory_copy: background`` and as many with ``in_step`` (alternating blocks), then, in the
same engine and process: DeepSpeed's own ``save_checkpoint`` (the class method, no plugin) and the
plugin's verified save, alternated; a restore from memory and one from disk, alternated. Rank 0
writes ``results.json``.
"""

from __future__ import annotations

import robust_plugins  # noqa: F401,I001  (installs the DeepSpeed patch before deepspeed is used)

import argparse
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from robust_plugins.checkpoint import memory
from robust_plugins.workloads import build_gpt, get_batch, load_corpus

MICRO_BATCH = 8
#: Steps in a row with one memory_copy mode before the benchmark switches to the other.
BLOCK = 5


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    job = [uuid.uuid4().hex]
    dist.broadcast_object_list(job, src=0)
    os.environ[memory.ENV_JOB] = f"bench-{job[0]}"
    out = Path(args.out)
    root, raw_root = str(out / "ckpt"), str(out / "ckpt_deepspeed")
    model = build_gpt(args.preset, 0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
        "robust_plugins": {"checkpoint": {"dir": root, "memory_every": 1, "peer_backup": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    corpus = load_corpus(max_bytes=400_000)
    mem = engine.robust_plugins.memory
    # memory_copy background (the default) and in_step side by side in one launch: blocks of
    # BLOCK steps alternate between the two, so drift in the machine's load hits both alike.
    step_s, modes = [], []
    for step in range(1, 2 * args.steps + 1):
        background = (step - 1) // BLOCK % 2 == 0
        mem.background = background
        x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=model.cfg.seq_len)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()  # includes the snapshot's part in the step and the wait for the previous copy
        step_s.append(_max_over_ranks(time.perf_counter() - t0))
        modes.append("background" if background else "in_step")
    mem.store.flush()
    # blocking_s[i]: snapshot i's part in step i plus its wait at step i+1 (the step that comes
    # after the last snapshot is not timed: its entry is dropped)
    blocking = [_max_over_ranks(b) for b in mem.blocking_s][:-1]
    waits = [_max_over_ranks(w) for w in mem.wait_s]
    by_mode = {m: {"step_s": [s for s, k in zip(step_s, modes) if k == m],
                   "blocking_s": [b for b, k in zip(blocking, modes) if k == m]} for m in ("background", "in_step")}
    snapshot_bytes = mem.store.slots[0].header().total

    ds_save, verified_save, ds_bytes, verified_bytes = [], [], 0, 0
    cls_save = type(engine).save_checkpoint  # DeepSpeed's own method, not the plugin's shadow
    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        cls_save(engine, raw_root, tag=f"raw{i}")
        ds_save.append(_max_over_ranks(time.perf_counter() - t0))
        ds_bytes = _dir_bytes(os.path.join(raw_root, f"raw{i}"))
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(root, tag=f"verified{i}")
        verified_save.append(_max_over_ranks(time.perf_counter() - t0))
        verified_bytes = _dir_bytes(os.path.join(root, f"verified{i}"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(raw_root, ignore_errors=True)

    from_memory, from_disk = [], []
    for _ in range(args.repeats):
        mem.taken_at = None  # the state is unchanged since the last step: snapshot it again
        mem.on_step()
        mem.store.flush()
        dist.barrier()
        t0 = time.perf_counter()
        path, _ = engine.load_checkpoint(root)
        from_memory.append(_max_over_ranks(time.perf_counter() - t0))
        assert path.startswith("memory://"), path
        # A lost node everywhere: no snapshot in memory, the newest verified disk checkpoint.
        mem.store.close()
        if mem.peers is not None:
            mem.peers.close()
        dist.barrier()
        if rank == 0:
            memory.remove_job(memory.job_key())
        dist.barrier()
        t0 = time.perf_counter()
        path, _ = engine.load_checkpoint(root)
        from_disk.append(_max_over_ranks(time.perf_counter() - t0))
        assert "verified" in path, path
    if rank == 0:
        (out / "results.json").write_text(json.dumps({
            "world_size": world, "preset": args.preset, "steps": args.steps,
            "step_s": by_mode["background"]["step_s"], "blocking_s": by_mode["background"]["blocking_s"],
            "in_step": by_mode["in_step"], "wait_s": waits, "snapshot_bytes": snapshot_bytes, "ds_save_s": ds_save,
            "verified_save_s": verified_save, "ds_bytes": ds_bytes, "verified_bytes": verified_bytes,
            "restore_memory_s": from_memory, "restore_disk_s": from_disk,
            "params": sum(p.numel() for p in model.parameters()),
        }, indent=1))
    dist.barrier()
    memory.remove_job(memory.job_key())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

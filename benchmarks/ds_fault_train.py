"""The text GPT under DeepSpeed, written for the recovery benchmark (``benchmarks/recovery_bench.py``).

The same script runs under ``robust run``, ``torchrun --max-restarts`` and NVIDIA's ``ft_launcher``:
- on start it loads the newest DeepSpeed checkpoint in ``--ckpt-dir`` (none on a first start) and
  continues at ``engine.global_steps + 1``; batches are indexed by step, so a resumed run sees the
  batches an uninterrupted one would;
- it saves every ``--save-every`` steps (``engine.save_checkpoint``, collective) when the replicas'
  parameter hashes agree and the node monitor saw no fault (both no-ops outside ``robust run``);
- every rank appends one JSON line per completed step to ``<step-log-dir>/steps-rank<R>.jsonl``:
  ``{"step", "t" (time.time() at the step's end), "dt" (its wall seconds), "inc" (incarnation),
  "pid", "wd" (the watchdog calls' wall seconds), "snap" (the memory snapshot's blocking in the
  step, with ``--memory``)}``; the benchmark measures recovery from these lines and ``faults.jsonl``;
- ``--kill-at R:S`` (for launchers without ``--inject``): rank R SIGKILLs itself after step S in
  the first incarnation only, after logging ``{"kill": S, "t": ...}``;
- ``--seconds T``: instead of a step count, train until T seconds after the first start (the ETTR
  run: a wall-clock budget shared by every incarnation through ``<step-log-dir>/t0``);
- every rank appends one line per incarnation to ``<step-log-dir>/phases-rank<R>.jsonl``:
  ``{"inc", "script" (time.time() when the module began), "imported", "dist" (process group
  formed), "engine" (``deepspeed.initialize`` returned, the resume from memory included)}``: where
  a restart's time goes between the hand-off and the first step;
- ``--memory``: the plugin's checkpoint block (a snapshot every ``--memory-every`` steps, persisted
  every ``--save-every``) instead of the script's own saves.
"""

from __future__ import annotations

import time as _time

#: When this module began to run: a fresh interpreter's imports come after it; a warm standby
#: imported them before it was handed its rank, so here its hand-off has just happened.
SCRIPT_T0 = _time.time()

import robust_plugins  # noqa: E402,F401,I001  (installs the DeepSpeed patch before deepspeed is used)

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from robust_plugins import watchdog
from robust_plugins.workloads import build_gpt, get_batch, load_corpus

MICRO_BATCH = 4


def incarnation() -> int:
    # robust run numbers its incarnations; torchrun and ft_launcher count restarts.
    for key in ("ROBUST_INCARNATION", "TORCHELASTIC_RESTART_COUNT"):
        if os.environ.get(key):
            return int(os.environ[key])
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seconds", type=float, default=0.0,
                   help="train until this many seconds after the first start (overrides --steps)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--step-log-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", default="", help="R:S - rank R SIGKILLs itself after step S (first incarnation)")
    p.add_argument("--emergency", action="store_true",
                   help="ZeRO 0 with the plugin's checkpoint block: verified saves, and under robust run the "
                        "emergency save of the last step when a peer dies (patches/deepspeed_emergency.py)")
    p.add_argument("--memory", action="store_true",
                   help="the plugin's checkpoint block instead of the script's own saves: a memory snapshot "
                        "every step, persisted to --ckpt-dir every --save-every steps in the background; "
                        "under robust run the engine resumes inside deepspeed.initialize")
    p.add_argument("--memory-every", type=int, default=1, help="with --memory: snapshot every this many steps")
    args = p.parse_args()
    if args.memory_every < 1 or (args.memory_every != 1 and not args.memory):
        p.error(f"--memory-every {args.memory_every}: an interval of 1 or more steps, and only with --memory")
    if args.memory and args.emergency:
        p.error("--memory and --emergency are two different checkpoint setups: pick one")
    phases = {"script": SCRIPT_T0, "imported": time.time()}
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    phases["dist"] = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    logs = Path(args.step_log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    t0_file = logs / "t0"
    if rank == 0 and not t0_file.exists():
        t0_file.write_text(f"{time.time()}\n")
    dist.barrier()
    t_first = float(t0_file.read_text())
    deadline = t_first + args.seconds if args.seconds > 0 else None
    inc = incarnation()
    kill = tuple(int(x) for x in args.kill_at.split(":")) if args.kill_at else None
    model = build_gpt(args.preset, 0)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        # CPU: DeepSpeed's 5e8-element default buckets cost seconds a step (HOSTS.md).
        "zero_optimization": {"stage": 0 if args.emergency else 1, "reduce_bucket_size": 5e6,
                              "allgather_bucket_size": 5e6},
    }
    if args.emergency:
        config["robust_plugins"] = {"checkpoint": {"dir": args.ckpt_dir, "emergency_save": True}}
    if args.memory:
        config["robust_plugins"] = {"checkpoint": {"dir": args.ckpt_dir, "memory_every": args.memory_every,
                                                   "persist_every": args.save_every}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    phases["engine"] = time.time()
    with open(logs / f"phases-rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"inc": inc, **phases}) + "\n")
    # With --memory the engine has already resumed (memory -> peer -> disk) inside initialize.
    if not args.memory and (Path(args.ckpt_dir) / "latest").exists():
        engine.load_checkpoint(args.ckpt_dir)
    start = engine.global_steps + 1
    corpus = load_corpus(max_bytes=200_000)
    snaps = engine.robust_plugins.memory if args.memory else None
    log = open(logs / f"steps-rank{rank}.jsonl", "a", buffering=1)
    loss_value = None
    wd_wall = wd_cpu = 0.0
    wd_steps = 0
    step = start
    while True:
        if deadline is None and step > args.steps:
            break
        if deadline is not None:
            # Every rank must stop at the same step: rank 0 decides, one broadcast.
            go = torch.tensor([1 if time.time() < deadline else 0])
            dist.broadcast(go, 0)
            if not go.item():
                break
        t_step = time.perf_counter()
        x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=model.cfg.seq_len)
        loss = engine(x, y)
        engine.backward(loss)
        # The snapshot's blocking in this step (the ETTR charges it): the new snapshot's part,
        # plus the wait for the previous one's background copy, which the binding adds to the
        # previous entry (patches/deepspeed_memory.py).
        n0 = len(snaps.blocking_s) if snaps is not None else 0
        last0 = snaps.blocking_s[-1] if n0 else 0.0
        engine.step()
        blk = (sum(snaps.blocking_s[n0:]) + (snaps.blocking_s[n0 - 1] - last0 if n0 else 0.0)
               if snaps is not None else 0.0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loss_value = float(mean) / world
        dt = time.perf_counter() - t_step
        if kill is not None and inc == 0 and (rank, step) == kill:
            log.write(json.dumps({"step": step, "t": time.time(), "dt": dt, "inc": inc, "pid": os.getpid()}) + "\n")
            log.write(json.dumps({"kill": step, "t": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        # What the watchdog costs this rank per step, wall and CPU (the overhead benchmark).
        # process_time() is a system call (where the kernel may switch tasks): outside the wall interval.
        c0 = time.process_time()
        w0 = time.perf_counter()
        watchdog.step_end(step, loss=loss_value)
        agree = watchdog.check_params(step, engine.module)
        wd, wd_c = time.perf_counter() - w0, time.process_time() - c0
        wd_wall += wd
        wd_cpu += wd_c
        wd_steps += 1
        log.write(json.dumps({"step": step, "t": time.time(), "dt": dt, "inc": inc, "pid": os.getpid(),
                              "wd": wd, "wd_cpu": wd_c, "snap": blk}) + "\n")
        # save_checkpoint is collective: every rank gets the same answer from the node monitor.
        if not args.memory and step % args.save_every == 0 and agree and watchdog.ok_to_save(step):
            engine.save_checkpoint(args.ckpt_dir)
        step += 1
    h = hashlib.sha256()
    for _, prm in sorted(engine.module.named_parameters()):
        h.update(prm.detach().contiguous().numpy().tobytes())
    client = watchdog.client.get_client()
    comm_calls = sum(client.comm.calls.values()) if client is not None and client.comm is not None else None
    cost = torch.tensor([wd_wall, wd_cpu, float(comm_calls or 0)], dtype=torch.float64)
    dist.all_reduce(cost)  # means over ranks
    cost /= world
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "started_at": start, "last_step": step - 1, "final_loss": loss_value, "params_hash": h.hexdigest(),
            "watchdog_wall_s_per_step": cost[0].item() / max(1, wd_steps),
            "watchdog_cpu_s_per_step": cost[1].item() / max(1, wd_steps),
            "timed_collectives_per_step": cost[2].item() / max(1, wd_steps) if comm_calls is not None else None,
        }) + "\n")
    log.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

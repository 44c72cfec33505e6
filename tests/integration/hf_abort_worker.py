"""A rank that reports completion and then aborts at exit (the Trainer+DeepSpeed exit -6).

Every incarnation appends a line to ``<run_dir>/trained.rank<R>`` (how many times it trained);
with ``--complete`` each rank writes its completion record before rank 1 calls ``os.abort()``.
"""

import argparse
import os

import torch
import torch.distributed as dist

from robust_plugins.watchdog import completion

p = argparse.ArgumentParser()
p.add_argument("--complete", action="store_true")
a, _ = p.parse_known_args()  # robust_run (tests/fault/conftest.py) adds --ckpt-dir and --out
run_dir = os.environ["ROBUST_RUN_DIR"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
with open(os.path.join(run_dir, f"trained.rank{rank}"), "a") as f:
    f.write(os.environ.get("ROBUST_INCARNATION", "0") + "\n")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
if a.complete:
    completion.record(run_dir, rank, world, host="test", step=1, max_steps=1)
if rank == 1:
    os.abort()  # SIGABRT, exit -6, as "terminate called without an active exception" ends

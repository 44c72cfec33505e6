"""A rank that records how it was started (argv, environment, cwd, ``__main__`` semantics) and
its module-level side effects, then trains nothing: ``--steps`` all-reduces with a step signal.

Run as a script or as ``-m standby_probe`` (with this directory on ``PYTHONPATH``); the
standby tests compare what a cold incarnation and a warm one (served by a standby) recorded.
"""

import argparse
import json
import os
import pickle
import sys
import time

#: True in a warm standby (it imported torch before the hand-off), False in a fresh process.
TORCH_AT_START = "torch" in sys.modules
#: OS threads when the script starts: 1 in a fresh process (OMP_NUM_THREADS=1) and in a standby.
THREADS_AT_START = len(os.listdir("/proc/self/task"))

import numpy.random  # noqa: E402  (imported before the hand-off: its global RNG must still differ per process)

NUMPY_DRAW = float(numpy.random.random())

_ARGS = argparse.ArgumentParser()
_ARGS.add_argument("--steps", type=int, default=20)
_ARGS.add_argument("--step-sleep", type=float, default=0.0)
_ARGS.add_argument("--probe-dir", required=True)
_ARGS.add_argument("--stop-file", help="every rank stops at the first step after this file exists")
_ARGS.add_argument("--ckpt-dir")
_ARGS.add_argument("--out")
ARGS = _ARGS.parse_args()

# The module-level side effect the tests count: one line per process that ran this file.
os.makedirs(ARGS.probe_dir, exist_ok=True)
with open(os.path.join(ARGS.probe_dir, "side_effects.txt"), "a") as _f:
    _f.write(f"{os.environ.get('ROBUST_INCARNATION')} {os.environ.get('RANK')} {os.getpid()}\n")


class Picklable:
    """Defined in ``__main__``: pickling it needs ``sys.modules['__main__']`` to be this module."""

    def __init__(self, x):
        self.x = x


def _record() -> dict:
    main = sys.modules["__main__"]
    return {
        "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "name": __name__,
        "file": __file__, "package": __package__, "spec": getattr(__spec__, "name", None),
        "loader": type(__loader__).__name__, "path0": sys.path[0],
        "main_is_me": main.__dict__ is globals(),
        "pickle": pickle.loads(pickle.dumps(Picklable(3))).x,
        "torch_at_start": TORCH_AT_START, "threads_at_start": THREADS_AT_START, "numpy_draw": NUMPY_DRAW,
        "pid": os.getpid(), "ppid": os.getppid(),
    }


def main() -> None:
    import torch
    import torch.distributed as dist

    from robust_plugins import watchdog

    rank, inc = int(os.environ["RANK"]), os.environ.get("ROBUST_INCARNATION")
    with open(os.path.join(ARGS.probe_dir, f"probe-inc{inc}-rank{rank}.json"), "w") as f:
        json.dump(_record(), f)
    dist.init_process_group("gloo")
    for step in range(1, ARGS.steps + 1):
        stop = torch.tensor([float(bool(ARGS.stop_file) and os.path.exists(ARGS.stop_file))])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        time.sleep(ARGS.step_sleep)
        watchdog.step_end(step, loss=1.0)
        if stop.item():
            break
    if rank == 0 and ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump({"steps": ARGS.steps, "world_size": dist.get_world_size()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

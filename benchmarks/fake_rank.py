"""A rank that trains nothing: it speaks the watchdog's step protocol at a fixed pace.

Started by ``robust run`` like a training script (``benchmarks/control_plane_scale.py`` runs
hundreds of them): it imports only ``robust_plugins.watchdog`` (no torch, no process group), meets
every rank of its incarnation at a barrier (``<state>/ready-<incarnation>/<rank>`` files), then calls
``watchdog.step_end(step, loss=1.0)`` every ``--step-s`` seconds until ``<state>/stop`` exists.
Rank 0 writes the last step to ``<state>/step`` (atomically); before the barrier it writes the
incarnation's first step (``<state>/start-<incarnation>``: the step after it), which every rank
starts from, as ranks resuming from one checkpoint would, however late its interpreter started.
Injected faults (``robust run --inject kill:...``) fire inside ``step_end``, as in a real script;
a rank whose ``<state>/hang-<rank>`` file names its incarnation stops making progress (a Python
sleep loop, as ``--inject hang`` does), which the harness sets once the incarnation has stepped
past the watchdog's warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from robust_plugins import watchdog

#: Longest wait at the barrier (hundreds of interpreters starting on two busy cores).
BARRIER_TIMEOUT_S = 900.0


def main() -> None:
    """Step until told to stop; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--state", required=True, help="directory shared by the ranks (go, stop, step)")
    p.add_argument("--step-s", type=float, default=0.2, help="seconds a step")
    args = p.parse_args()
    state = Path(args.state)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inc = os.environ.get("ROBUST_INCARNATION", "0")
    progress, first = state / "step", state / f"start-{inc}"
    ready = state / f"ready-{inc}"
    ready.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # before its ready mark: every rank reads the same first step after the barrier
        done = int(progress.read_text()) if progress.exists() else 0
        tmp = first.with_suffix(".tmp")
        tmp.write_text(str(done + 1))
        os.replace(tmp, first)
    (ready / str(rank)).touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while len(os.listdir(ready)) < world:
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: {len(os.listdir(ready))} of {world} ranks at the barrier after "
                             f"{BARRIER_TIMEOUT_S:g} s")
        time.sleep(0.05)
    start = int(first.read_text())
    with open(state / "starts.jsonl", "a") as f:  # one line a rank and incarnation (O_APPEND)
        f.write(json.dumps({"rank": rank, "inc": int(inc), "start": start, "t": time.time()}) + "\n")
    step = start
    hang = state / f"hang-{rank}"
    while not (state / "stop").exists():
        if hang.exists() and hang.read_text() == inc:
            while True:
                time.sleep(1.0)
        # A fixed sleep, no catching up: a rank held up (CPU starved) is late, as a real one is.
        time.sleep(args.step_s)
        watchdog.step_end(step, loss=1.0)
        if rank == 0:
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, progress)
        step += 1


if __name__ == "__main__":
    main()

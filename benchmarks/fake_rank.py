"""A rank that trains nothing: it speaks the watchdog's step protocol at a fixed pace.

Started by ``robust run`` like a training script (``benchmarks/control_plane_scale.py`` runs
hundreds of them): it imports only ``robust_plugins.watchdog`` (no torch, no process group), waits
for ``<state>/go`` (so that step numbers count from a moment every rank of the job has started),
then calls ``watchdog.step_end(step, loss=1.0)`` every ``--step-s`` seconds until ``<state>/stop``
exists. Rank 0 writes the last step to ``<state>/step`` (atomically) and every rank of a restarted
incarnation continues after it, as a script resuming from its checkpoint would. Injected faults
(``robust run --inject kill:...``, ``hang:...``) fire inside ``step_end``, as in a real script.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from robust_plugins import watchdog

#: Longest wait for ``go`` (the harness creates it once every rank has started).
GO_TIMEOUT_S = 600.0


def main() -> None:
    """Step until told to stop; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--state", required=True, help="directory shared by the ranks (go, stop, step)")
    p.add_argument("--step-s", type=float, default=0.2, help="seconds a step")
    args = p.parse_args()
    state = Path(args.state)
    rank = int(os.environ["RANK"])
    progress = state / "step"
    start = int(progress.read_text()) + 1 if progress.exists() else 1
    deadline = time.monotonic() + GO_TIMEOUT_S
    while not (state / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: {state / 'go'} did not appear within {GO_TIMEOUT_S:g} s")
        time.sleep(0.05)
    step = start
    next_at = time.monotonic()
    while not (state / "stop").exists():
        next_at += args.step_s
        time.sleep(max(0.0, next_at - time.monotonic()))
        watchdog.step_end(step, loss=1.0)
        if rank == 0:
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, progress)
        step += 1


if __name__ == "__main__":
    main()

"""A training loop reduced to its step signals, at the fastest step rate a loop can reach: what the
watchdog's shared-memory step ring must keep up with. Rank ``--nan-rank`` reports a NaN loss at
``--nan-step``; every other step reports loss 1.0 (no spikes). Writes ``<out>-rank<R>.json``
after its first step, saying whether the rank writes its steps into a ring."""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from robust_plugins import watchdog


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--busy-us", type=float, default=0.0, help="busy-wait per step (the 'compute')")
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--nan-step", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt-dir", help="unused (the fault tests' launcher passes it)")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    busy = args.busy_us * 1e-6
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy:
            pass
        watchdog.step_end(step, loss=math.nan if (rank, step) == (args.nan_rank, args.nan_step) else 1.0)
        if step == 1:
            c = watchdog.client.get_client()
            with open(f"{args.out}-rank{rank}.json", "w") as f:
                json.dump({"rank": rank, "ring": c is not None and c.ring is not None}, f)


if __name__ == "__main__":
    main()

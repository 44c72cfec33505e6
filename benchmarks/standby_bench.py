"""Warm standbys of one node, spawned (one interpreter and one import each) vs forked from the
node's fork server (one import, then a fork per standby): side by side, interleaved.

For ``--ranks`` standbys of ``benchmarks/ds_fault_train.py`` (its imports: torch, DeepSpeed, the
plugin, ``torch._dynamo``, DeepSpeed's Muon module, ...) under the environment ``robust run``
gives them (``OMP_NUM_THREADS=1``, DeepSpeed's CPU accelerator):

- **all ready**: from the pool's first ``tick`` to every standby ``ready`` (imports done);
- **CPU**: user + system seconds of the pool's processes (fork server included) at that moment;
- **memory**: summed RSS and PSS (``/proc/PID/smaps_rollup``; PSS splits shared pages among the
  processes sharing them) of those processes;
- **refill**: all standbys retired, then the pool refilled: time until all are ready again (what a
  restart's replacements take).

Command (``--repeats`` rounds, each spawned then forked)::

    python benchmarks/standby_bench.py --ranks 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from robust_plugins.launch import launch_env
from robust_plugins.patches import torch_elastic
from robust_plugins.launcher.standby import pool as standby

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "ds_fault_train.py")
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15)


def _memory_mb(pid: int) -> tuple[float, float]:
    values = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in ("Rss:", "Pss:"):
                values[parts[0]] = int(parts[1]) / 1024
    return values["Rss:"], values["Pss:"]


def _all_ready(pool: standby.StandbyPool, ranks: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    pool.tick(spawn=True)
    while sum(sb.ready is not None for sb in pool.standbys) < ranks:
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"standbys not ready within {timeout_s} s")
        time.sleep(0.01)
        pool.tick(spawn=True)
    return time.monotonic() - t0


def one(fork: bool, ranks: int, timeout_s: float) -> dict:
    """One pool of ``ranks`` standbys: its figures (see the module docstring)."""
    with tempfile.TemporaryDirectory() as run_dir:
        pool = standby.StandbyPool(ranks, standby.Target(SCRIPT, None, ()), Path(run_dir),
                                   per_rank=torch_elastic.is_rank_env, fork=fork)
        try:
            ready_s = _all_ready(pool, ranks, timeout_s)
            pids = [sb.proc.pid for sb in pool.standbys] + ([pool.zygote.pid] if pool.zygote else [])
            cpu = sum(_cpu_s(p) for p in pids)
            mem = [_memory_mb(p) for p in pids]
            assert pool.fork is fork, "the fork server fell back to spawning (see its warning)"
            for sb in list(pool.standbys):
                pool._retire(sb, "stopped")
            refill_s = _all_ready(pool, ranks, timeout_s)
        finally:
            pool.close()
    return {"mode": "forked" if fork else "spawned", "ready_s": round(ready_s, 2), "cpu_s": round(cpu, 2),
            "rss_mb": round(sum(r for r, _ in mem)), "pss_mb": round(sum(p for _, p in mem)),
            "refill_s": round(refill_s, 3)}


def _median(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{statistics.median(values):g} ({min(values):g}-{max(values):g})"


def main() -> None:
    """Run the rounds, print each row as JSON and a table of medians."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    os.environ.update(launch_env({}))  # what robust run's ranks (and so its standbys) import under
    rows = []
    for i in range(args.repeats):
        for fork in (False, True):
            row = one(fork, args.ranks, args.timeout)
            row.update(round=i, load1=round(os.getloadavg()[0], 1))
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{args.ranks} standbys of {Path(SCRIPT).name}, median (min-max) of {args.repeats}, "
          f"python {sys.version.split()[0]}")
    print("| standbys | all ready (s) | CPU (s) | RSS sum (MB) | PSS sum (MB) | refill (s) |")
    print("|---|---|---|---|---|---|")
    for mode in ("spawned", "forked"):
        got = [r for r in rows if r["mode"] == mode]
        print(f"| {mode} | " + " | ".join(_median(got, k) for k in ("ready_s", "cpu_s", "rss_mb", "pss_mb", "refill_s"))
              + " |")


if __name__ == "__main__":
    main()

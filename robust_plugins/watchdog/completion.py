"""Completion records: a rank says its training returned, so ``robust run`` can tell a finished job
from a failed one when a rank dies at interpreter exit.

A Trainer+DeepSpeed rank sometimes aborts after training has finished (``terminate called
without an active exception``, exit -6, in plain runs without the plugin too). Restarting then
would train again from the last restore point. Hosts that know training returned (the HF Trainer
binding, ``patches/transformers_trainer.py``) write ``<run_dir>/completed/rank<R>.json``; when
every rank of the node has one written since the agent started, the agent ends the job as
completed instead of restarting it, and says why (:func:`job_completed`, :func:`verdict`).
"""

from __future__ import annotations

import json
import os
import time

#: Folder of the records inside ``ROBUST_RUN_DIR``.
FOLDER = "completed"


def record(run_dir: str, rank: int, world_size: int, **detail) -> str:
    """Write ``<run_dir>/completed/rank<R>.json`` atomically; returns its path."""
    folder = os.path.join(run_dir, FOLDER)
    os.makedirs(folder, exist_ok=True)
    line = {"rank": rank, "world_size": world_size, "time": time.time(),
            "incarnation": int(os.environ.get("ROBUST_INCARNATION", "0") or 0), **detail}
    path = os.path.join(folder, f"rank{rank}.json")
    tmp = os.path.join(folder, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(line) + "\n")
    os.replace(tmp, path)
    return path


def job_completed(run_dir: str, ranks: list[int], world_size: int, since: float) -> list[dict] | None:
    """The records of ``ranks`` (this node's global ranks) when each wrote one for a job of
    ``world_size`` ranks at or after ``since`` (epoch seconds; older files belong to an earlier
    launch with the same run directory), else None."""
    records = []
    for rank in ranks:
        try:
            with open(os.path.join(run_dir, FOLDER, f"rank{rank}.json")) as f:
                rec = json.loads(f.read())
        except (OSError, ValueError):
            return None
        if rec.get("world_size") != world_size or rec.get("time", 0) < since:
            return None
        records.append(rec)
    return records


def verdict(records: list[dict], failures: dict[int, int | None]) -> str:
    """The line ``robust run`` prints when failed ranks had all reported completion."""
    steps = sorted({(r.get("step"), r.get("max_steps")) for r in records}, key=str)
    at = ", ".join(f"step {s} of {m}" if m is not None else f"step {s}" for s, m in steps)
    bad = ", ".join(f"rank {r} exited with {code}" for r, code in sorted(failures.items()))
    return (f"robust run: {bad} after its training had returned; all {len(records)} ranks reported "
            f"completion ({at}), so the job is complete and is not restarted.")

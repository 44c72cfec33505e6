"""The multi-GPU check: one 8-GPU node, NCCL, every feature of the block once, then a kill, a hang and
a NaN under ``robust run``: in one call, under 10 minutes.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check_multi.py --out $OUT [--gpus 8]

Each part is one ``robust run`` of the DeepSpeed GPT recipe (``torchrun``-style ranks, one a GPU,
NCCL) and writes ``$OUT/gpu_check_multi.json`` as it finishes, so a run cut short returns what it
finished; each prints one line (``part NAME: ok | FAILED | skipped (why)``). Parts:

``features``  the ``robust_plugins`` block with every sub-block once (int8 compression with
              overlap, hierarchical topology, memory snapshots and a checkpoint directory,
              telemetry) and no fault: finite losses, telemetry written, no fault recorded.
``kill``      rank 3 SIGKILLed at step 12: one ``crash`` naming rank 3, the job resumes and ends.
``hang``      rank 5 hangs at step 14: one ``hang`` whose verdict comes from the flight recorder
              (``detail.verdict.by``), naming rank 5 stuck; no other rank named.
``nan``       rank 2 reports a NaN loss at step 10: one ``nan``, a rollback, the job ends.

Without CUDA, or with fewer GPUs than ``--gpus``, every part prints its skip line and the JSON says
why (``tests/unit/test_gpu_check_multi.py`` runs it so on CPU). The judging of each part's
``faults.jsonl`` is :func:`judge`, a pure function the same test feeds made-up records.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PARTS = ("features", "kill", "hang", "nan")

#: Per part: the ``--inject`` spec and what ``faults.jsonl`` must then hold (kind, suspect ranks).
FAULTS = {
    "features": (None, []),
    "kill": ("kill:rank=3,step=12", [("crash", [3])]),
    "hang": ("hang:rank=5,step=14", [("hang", [5])]),
    "nan": ("nan:rank=2,step=10", [("nan", [2])]),
}

STEPS = 24

#: Every sub-block once. Memory snapshots every step restore the kill and the hang; the NaN rolls
#: back to the newest snapshot before it.
BLOCK = {
    "compression": {"codec": "int8", "overlap": True, "warmup_steps": 2, "min_numel": 0},
    "topology": {"hierarchical": True},
    "checkpoint": {"dir": "ckpt", "memory_every": 1},
    "telemetry": {"dir": "telemetry", "log_every": 4},
}


def ds_config(run_dir: Path) -> dict:
    """The DeepSpeed config of a part (ZeRO 0, where compression overlaps backward)."""
    block = json.loads(json.dumps(BLOCK))
    block["checkpoint"]["dir"] = str(run_dir / "ckpt")
    block["telemetry"]["dir"] = str(run_dir / "telemetry")
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": 0}, "robust_plugins": block}


def command(part: str, run_dir: Path, gpus: int) -> list[str]:
    """The ``robust run`` command line of ``part`` (pure)."""
    inject, _ = FAULTS[part]
    plan = run_dir / "plan.json"
    args = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(run_dir), "--standalone",
            "--nproc-per-node", str(gpus), "--max-restarts", "2", "--monitor-interval", "0.2",
            # A tiny model's step is milliseconds: the learned hang timeout's floor decides.
            "--watchdog", "hang_min_timeout_s=10", "--watchdog", "straggler_factor=0"]
    if inject:
        args += ["--inject", inject]
    return args + ["-m", "robust_plugins.recipes.deepspeed_gpt.train", "--plan", str(plan),
                   "--out-dir", str(run_dir / "results")]


def write_plan(run_dir: Path) -> None:
    """The recipe's plan (one resumable run) and its DeepSpeed config, into ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "ds.json").write_text(json.dumps(ds_config(run_dir), indent=1) + "\n")
    (run_dir / "plan.json").write_text(json.dumps({"runs": [
        {"name": "check", "config": "ds.json", "steps": STEPS, "save_dir": "ckpt", "save_every": 8,
         "resume": True}]}, indent=1) + "\n")


def judge(part: str, rc: int, faults: list[dict], results: list[dict], telemetry: bool) -> dict[str, bool]:
    """The checks of one part from what its run left (pure)."""
    _, want = FAULTS[part]
    stopping = [f for f in faults if f.get("kind") != "straggler"]
    checks = {"exit 0": rc == 0,
              "faults as injected": [(f.get("kind"), f.get("suspect_ranks")) for f in stopping] == want,
              "finite losses": bool(results) and all(
                  isinstance(x, (int, float)) and x == x and abs(x) != float("inf")
                  for r in results for x in r.get("losses", []))}
    if part == "features":
        checks["telemetry written"] = telemetry
    if part == "hang" and stopping:
        verdict = stopping[0].get("detail", {}).get("verdict", {})
        checks["hang verdict from the flight recorder"] = verdict.get("by") == "flight_recorder"
        checks["only the hung rank stuck"] = verdict.get("stuck") == [5]
    if part in ("kill", "hang", "nan") and stopping:
        checks["resumed"] = stopping[0].get("resumed_at_step") is not None
    return checks


def _skip_reason(gpus: int) -> str | None:
    try:
        import torch
    except ImportError as exc:
        return f"torch not importable: {exc}"
    if not torch.cuda.is_available():
        return "needs CUDA GPUs"
    if torch.cuda.device_count() < gpus:
        return f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}"
    return None


def run_part(part: str, out: Path, gpus: int, timeout_s: float) -> dict:
    """Run one part; its record (status, checks, seconds, the tail of its output)."""
    run_dir = out / part
    write_plan(run_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.pop("DS_ACCELERATOR", None)  # the GPUs' own accelerator
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command(part, run_dir, gpus), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-6000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = -1, f"timed out after {timeout_s:.0f} s: {str(exc.stdout)[-3000:]}"
    faults_path = run_dir / "faults.jsonl"
    faults = [json.loads(x) for x in faults_path.read_text().splitlines() if x.strip()] if faults_path.exists() else []
    results = [json.loads(p.read_text()) for p in sorted((run_dir / "results").glob("*.json"))] \
        if (run_dir / "results").is_dir() else []
    tel = run_dir / "telemetry"
    checks = judge(part, rc, faults, results, tel.is_dir() and any(tel.iterdir()))
    return {"status": "ok" if all(checks.values()) else "FAILED", "checks": checks, "rc": rc,
            "faults": faults, "seconds": round(time.perf_counter() - t0, 1), "tail": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check_multi.json and the runs")
    parser.add_argument("--gpus", type=int, default=8, help="ranks, one a GPU (default 8)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--part-timeout-s", type=float, default=150.0, help="bound of one part")
    parser.add_argument("--budget-s", type=float, default=570.0, help="skip the parts left after this long")
    args = parser.parse_args(argv)
    wanted = [p for p in args.parts.split(",") if p]
    bad = [p for p in wanted if p not in PARTS]
    if bad:
        parser.error(f"unknown parts {bad}; allowed: {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check_multi.json"
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpus": args.gpus,
                    "parts": {}}
    skip = _skip_reason(args.gpus)
    t_start, failed = time.monotonic(), False
    for name in wanted:
        if skip is not None:
            res = {"status": "skipped", "reason": skip}
        elif time.monotonic() - t_start > args.budget_s:
            res = {"status": "skipped", "reason": f"time budget of {args.budget_s:.0f} s spent"}
        else:
            res = run_part(name, args.out, args.gpus, args.part_timeout_s)
        failed |= res["status"] == "FAILED"
        report["parts"][name] = res
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        why = f" ({res['reason']})" if res["status"] == "skipped" else ""
        bad_checks = [k for k, v in res.get("checks", {}).items() if not v]
        print(f"part {name}: {res['status']}{why}" + (f" failed checks: {bad_checks}" if bad_checks else "")
              + (f" [{res['seconds']} s]" if "seconds" in res else ""), flush=True)
    print("GPU CHECK MULTI", "FAILED" if failed else "PASSED" if skip is None else f"SKIPPED ({skip})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

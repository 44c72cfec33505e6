"""The multi-GPU check: one node of 4 or more GPUs, NCCL, every feature of the block once, then a kill, a
hang and a NaN under ``robust run``, on DeepSpeed ZeRO 0, ZeRO-3 and megatron-core PP 2 x DP: in
one call: about a minute a part (``--parts`` picks; ``--budget-s`` skips what is left, said in the JSON).

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check_multi.py --out $OUT [--gpus 8]

Each part is one ``robust run`` of a recipe (``torchrun``-style ranks, one a GPU, NCCL) and writes
``$OUT/gpu_check_multi.json`` as it finishes, so a run cut short returns what it finished; each
prints one line (``part NAME: ok | FAILED | skipped (why)``). Parts (:data:`PARTS`):

``features``  DeepSpeed ZeRO 0, the ``robust_plugins`` block with every sub-block once (int8
              compression with overlap, hierarchical topology, memory snapshots and a checkpoint
              directory, telemetry) and no fault: finite losses, telemetry written, no fault.
``kill``      ZeRO 0, rank 3 SIGKILLed at step 12: one ``crash`` naming rank 3 (its NCCL peers'
              SIGABRTs are no evidence), the job resumes and ends.
``hang``      ZeRO 0, rank 5 (the last rank on 4 GPUs) hangs at step 14: one ``hang`` whose verdict
              comes from the flight recorder (``detail.verdict.by``), naming that rank stuck.
``nan``       ZeRO 0, rank 2 reports a NaN loss at step 10: one ``nan``, a rollback, the job ends.
``zero3``, ``zero3_faults``: DeepSpeed ZeRO-3 (int8 compressed reduce-scatter, hierarchical,
              snapshots, telemetry): no fault; then kill, hang and NaN in one run (steps 6, 12, 18).
``mcore_3d``, ``mcore_3d_faults``: the megatron recipe's ``cpu-3d`` shape on GPUs (``gpu-3d-tiny``:
              PP 2 x DP = GPUs / 2, bf16, megatron's distributed optimizer, int8, snapshots,
              telemetry): no fault; then kill, hang and NaN in one run.

Without CUDA, or with fewer GPUs than ``--gpus``, every part prints its skip line and the JSON says
why (``tests/unit/test_gpu_check_multi.py`` runs it so on CPU). ``--dry-run`` writes every part's
plan and prints its command without running it, after :func:`plan_problems` (an injected rank or
step outside the run, a layout the GPUs cannot hold) found nothing; ``--cpu`` runs the same parts on
CPU ranks over gloo (the ``cpu-3d`` preset for megatron) where a person has the minutes. The
judging of each part's ``faults.jsonl`` is :func:`judge`, a pure function the test feeds made-up
records.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STEPS = 24

#: Faults by name: the ``--inject`` spec (rank and step filled in) and the fault kind it must produce.
FAULT_KINDS = {"kill": "crash", "hang": "hang", "nan": "nan"}

#: Per part: its workload and the faults injected, as (name, rank, step); ``rank`` may be negative
#: (counted from the last rank), so the parts fit 4 GPUs as well as 8.
PART_SPECS: dict[str, tuple[str, list[tuple[str, int, int]]]] = {
    "features": ("zero0", []),
    "kill": ("zero0", [("kill", 3, 12)]),
    "hang": ("zero0", [("hang", 5, 14)]),
    "nan": ("zero0", [("nan", 2, 10)]),
    "zero3": ("zero3", []),
    "zero3_faults": ("zero3", [("kill", 3, 6), ("hang", -1, 12), ("nan", 2, 18)]),
    "mcore_3d": ("mcore_3d", []),
    "mcore_3d_faults": ("mcore_3d", [("kill", 1, 6), ("hang", -1, 12), ("nan", 2, 18)]),
}
PARTS = tuple(PART_SPECS)

#: Every sub-block once. Memory snapshots every step restore the kill and the hang; the NaN rolls
#: back to the newest snapshot before it.
BLOCK = {
    "compression": {"codec": "int8", "overlap": True, "warmup_steps": 2, "min_numel": 0},
    "topology": {"hierarchical": True},
    "checkpoint": {"dir": "ckpt", "memory_every": 1},
    "telemetry": {"dir": "telemetry", "log_every": 4},
}

#: ZeRO-3's: its reduce-scatter is compressed inside backward (``compression.overlap`` is ZeRO 0's).
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 1000, "reduce_bucket_size": 5e6,
         "stage3_prefetch_bucket_size": 5e6}


def fault_rank(rank: int, gpus: int) -> int:
    """A part's fault rank on ``gpus`` ranks (pure): negative counts from the last; 5 on fewer
    than 6 GPUs is the last rank."""
    if rank < 0:
        return gpus + rank
    return min(rank, gpus - 1)


def injects(part: str, gpus: int) -> list[tuple[str, int, int]]:
    """The faults of ``part`` on ``gpus`` ranks: (name, rank, step) (pure)."""
    return [(name, fault_rank(rank, gpus), step) for name, rank, step in PART_SPECS[part][1]]


def expected(part: str, gpus: int) -> list[tuple[str, list[int]]]:
    """The stopping faults ``faults.jsonl`` must hold, in order: (kind, suspect ranks) (pure)."""
    return [(FAULT_KINDS[name], [rank]) for name, rank, _ in injects(part, gpus)]


def plan_problems(parts: list[str], gpus: int) -> list[str]:
    """Why the parts cannot pass on ``gpus`` ranks whatever the package does (pure): a fault on a
    rank or step outside the run, two faults at one step, a pipeline layout the ranks cannot hold."""
    problems = []
    for part in parts:
        workload, _ = PART_SPECS[part]
        if workload == "mcore_3d" and (gpus < 4 or gpus % 2):
            problems.append(f"{part}: PP 2 x DP needs an even number of ranks >= 4, not {gpus}")
        steps = [step for _, _, step in injects(part, gpus)]
        if len(set(steps)) != len(steps):
            problems.append(f"{part}: two faults at one step {steps}")
        for name, rank, step in injects(part, gpus):
            if not 0 <= rank < gpus:
                problems.append(f"{part}: {name} on rank {rank} of {gpus}")
            if not 1 < step < STEPS:
                problems.append(f"{part}: {name} at step {step}, outside 2..{STEPS - 1}")
    return problems


def ds_config(run_dir: Path, workload: str = "zero0", cpu: bool = False) -> dict:
    """The DeepSpeed config of a part: ZeRO 0 (where compression overlaps backward) or ZeRO-3."""
    block = json.loads(json.dumps(BLOCK))
    block["checkpoint"]["dir"] = str(run_dir / "ckpt")
    block["telemetry"]["dir"] = str(run_dir / "telemetry")
    zero: dict = {"stage": 0}
    cfg: dict = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**9}
    if workload == "zero3":
        zero = dict(ZERO3)
        del block["compression"]["overlap"]
        cfg["zero_allow_untested_optimizer"] = True  # the recipe's client torch AdamW
    if cpu:  # HOSTS.md: DeepSpeed's default buckets cost seconds a step on CPU
        zero.setdefault("reduce_bucket_size", 5e6)
        zero.setdefault("allgather_bucket_size", 5e6)
    return {**cfg, "zero_optimization": zero, "robust_plugins": block}


def mcore_block(run_dir: Path) -> dict:
    """The megatron recipe's ``--plugin-json`` block (``--codec int8`` adds the compression)."""
    return {"telemetry": {"dir": str(run_dir / "telemetry"), "log_every": 4}}


def command(part: str, run_dir: Path, gpus: int, cpu: bool = False) -> list[str]:
    """The ``robust run`` command line of ``part`` (pure)."""
    workload, _ = PART_SPECS[part]
    args = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(run_dir), "--standalone",
            "--nproc-per-node", str(gpus), "--max-restarts", "6", "--monitor-interval", "0.2",
            # A tiny model's step is milliseconds: the learned hang timeout's floor decides; 20 s
            # holds a step with a checkpoint save on a loaded host (--cpu: megatron's first
            # dist_checkpointing save stalled two ranks 11 s). A hang 6 steps after a restart must be
            # judged on the learned timeout, not the initial one (480 s by default): 3 warm-up
            # steps, and 120 s for a start (imports, NCCL setup).
            "--watchdog", "hang_min_timeout_s=20", "--watchdog", "hang_warmup_steps=3",
            "--watchdog", "hang_initial_timeout_s=120", "--watchdog", "straggler_factor=0"]
    for name, rank, step in injects(part, gpus):
        args += ["--inject", f"{name}:rank={rank},step={step}"]
    if workload in ("zero0", "zero3"):
        return args + ["-m", "robust_plugins.recipes.deepspeed_gpt.train", "--plan", str(run_dir / "plan.json"),
                       "--out-dir", str(run_dir / "results")]
    return args + ["-m", "robust_plugins.recipes.megatron_gpt.train", "--preset", "cpu-3d" if cpu else "gpu-3d-tiny",
                   "--pp", "2", "--steps", str(STEPS), "--codec", "int8", "--plugin-json", str(run_dir / "block.json"),
                   # Memory snapshots restore the faults; no disk saves (each spawns a process).
                   "--ckpt-dir", str(run_dir / "ckpt"), "--memory-every", "1",
                   # Launcher ranks: the injected ranks are the ones megatron's groups are built on.
                   "--rank-order", "launcher", "--log-every", "4", "--out", str(run_dir / "results" / "rank0.json")]


def write_plan(run_dir: Path, part: str = "features", cpu: bool = False) -> None:
    """The part's inputs into ``run_dir``: the DeepSpeed recipe's plan (one resumable run) and
    config, or the megatron recipe's plugin block."""
    (run_dir / "results").mkdir(parents=True, exist_ok=True)
    workload, _ = PART_SPECS[part]
    if workload == "mcore_3d":
        (run_dir / "block.json").write_text(json.dumps(mcore_block(run_dir), indent=1) + "\n")
        return
    (run_dir / "ds.json").write_text(json.dumps(ds_config(run_dir, workload, cpu), indent=1) + "\n")
    (run_dir / "plan.json").write_text(json.dumps({"runs": [
        {"name": "check", "config": "ds.json", "steps": STEPS, "save_dir": "ckpt", "save_every": 8,
         "resume": True}]}, indent=1) + "\n")


def judge(part: str, rc: int, faults: list[dict], results: list[dict], telemetry: bool, gpus: int = 8,
          cpu: bool = False) -> dict[str, bool]:
    """The checks of one part from what its run left (pure). On NCCL a hang's verdict must come
    from the flight recorder; with ``cpu`` (gloo: collectives block the host) from the stacks."""
    want = expected(part, gpus)
    stopping = [f for f in faults if f.get("kind") != "straggler"]
    checks = {"exit 0": rc == 0,
              "faults as injected": [(f.get("kind"), f.get("suspect_ranks")) for f in stopping] == want,
              "finite losses": bool(results) and all(
                  isinstance(x, (int, float)) and x == x and abs(x) != float("inf")
                  for r in results for x in r.get("losses", []))}
    if not want:
        checks["telemetry written"] = telemetry
    hung = [rank for kind, (rank,) in want if kind == "hang"]
    for f in stopping:
        if f.get("kind") == "hang" and hung:
            verdict = f.get("detail", {}).get("verdict", {})
            if cpu:
                checks["hang verdict from the stacks"] = verdict.get("by") == "stacks"
            else:
                checks["hang verdict from the flight recorder"] = verdict.get("by") == "flight_recorder"
                checks["only the hung rank stuck"] = verdict.get("stuck") == hung[:1]
    if stopping:
        checks["resumed"] = all(f.get("resumed_at_step") is not None for f in stopping)
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


def run_part(part: str, out: Path, gpus: int, timeout_s: float, cpu: bool = False) -> dict:
    """Run one part; its record (status, checks, seconds, the tail of its output)."""
    run_dir = out / part
    write_plan(run_dir, part, cpu)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    else:
        env.pop("DS_ACCELERATOR", None)  # the GPUs' own accelerator
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command(part, run_dir, gpus, cpu), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-6000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = -1, f"timed out after {timeout_s:.0f} s: {str(exc.stdout)[-3000:]}"
    faults_path = run_dir / "faults.jsonl"
    faults = [json.loads(x) for x in faults_path.read_text().splitlines() if x.strip()] if faults_path.exists() else []
    results = [json.loads(p.read_text()) for p in sorted((run_dir / "results").glob("*.json"))] \
        if (run_dir / "results").is_dir() else []
    tel = run_dir / "telemetry"
    checks = judge(part, rc, faults, results, tel.is_dir() and any(tel.iterdir()), gpus, cpu)
    return {"status": "ok" if all(checks.values()) else "FAILED", "checks": checks, "rc": rc,
            "faults": faults, "seconds": round(time.perf_counter() - t0, 1), "tail": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check_multi.json and the runs")
    parser.add_argument("--gpus", type=int, default=8, help="ranks, one a GPU (default 8)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--part-timeout-s", type=float, default=150.0, help="bound of one part")
    parser.add_argument("--budget-s", type=float, default=570.0, help="skip the parts left after this long")
    parser.add_argument("--dry-run", action="store_true",
                        help="write every part's plan and print its command; run nothing")
    parser.add_argument("--cpu", action="store_true",
                        help="CPU ranks over gloo (--gpus ranks; megatron's cpu-3d preset): the parts without GPUs")
    args = parser.parse_args(argv)
    wanted = [p for p in args.parts.split(",") if p]
    bad = [p for p in wanted if p not in PARTS]
    if bad:
        parser.error(f"unknown parts {bad}; allowed: {', '.join(PARTS)}")
    problems = plan_problems(wanted, args.gpus)
    if problems:
        parser.error(f"these parts cannot pass on {args.gpus} ranks: {'; '.join(problems)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        for name in wanted:
            write_plan(args.out / name, name, args.cpu)
            print(f"part {name}: {shlex.join(command(name, args.out / name, args.gpus, args.cpu))}", flush=True)
        print("GPU CHECK MULTI DRY RUN: plans written, nothing run", flush=True)
        return 0
    path = args.out / "gpu_check_multi.json"
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpus": args.gpus,
                    "parts": {}}
    skip = None if args.cpu else _skip_reason(args.gpus)
    t_start, failed = time.monotonic(), False
    for name in wanted:
        if skip is not None:
            res = {"status": "skipped", "reason": skip}
        elif time.monotonic() - t_start > args.budget_s:
            res = {"status": "skipped", "reason": f"time budget of {args.budget_s:.0f} s spent"}
        else:
            res = run_part(name, args.out, args.gpus, args.part_timeout_s, args.cpu)
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

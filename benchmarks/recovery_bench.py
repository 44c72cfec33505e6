"""Recovery per fault kind, and ETTR: ``robust run`` vs ``torchrun --max-restarts`` vs ``ft_launcher``.

Every job trains the text GPT under DeepSpeed (ZeRO-1, gloo, CPU) with ``benchmarks/ds_fault_train.py``,
which checkpoints to disk every ``--save-every`` steps and logs every completed step of every rank
with its wall time and incarnation. From those logs and ``faults.jsonl``:

- **onset**: when the fault happened: the detection time minus ``detected_after_s`` (the monitor
  measures that from the rank's own announcement of the injected fault); for the torchrun and
  ft_launcher crash rows, the kill time the script logged just before its SIGKILL;
- **recovered after**: onset to the first step completed by the next incarnation (any rank);
- **steps lost**: the newest step any rank completed before the restart minus the step the next
  incarnation resumed from (steps done twice).

Rows (``--rows``, each one job; a job is bounded by ``--timeout``):
``crash hang nan spike straggler sdc`` under ``robust run`` with an injected fault at
``--fault-step``; ``crash_cold`` and ``crash_warm``: the crash with ``--no-standby`` and with the
default warm standby workers (each row also gives its job's own cold start, launch to the first
step, and the table ends with warm recovery / cold start); ``crash_emergency``: the crash with ZeRO 0 and the plugin's checkpoint block, whose
emergency save (``patches/deepspeed_emergency.py``) writes the last step before the restart; ``torchrun`` and ``ft_launcher``: the same script with ``--kill-at`` (the rank
kills itself; these launchers have no injection). ``ettr``: one job of ``--ettr-seconds`` with a
random fault (kill, hang, NaN, spike; at a random rank) every ``--ettr-every`` seconds.
ETTR = productive time / the job's wall time from launch to exit, where productive time sums,
over the steps kept in the final result (each step counted once, by the incarnation whose result
survived), rank 0's whole loop iteration (end of the previous step to the end of this one; its
timed part for an incarnation's first step) minus what the plugin blocked in it: the watchdog
calls and the memory snapshot's blocking, the slowest rank's (the next collective waits for it).
What the background copy threads take from the shared cores is not subtracted (steps are slower
for it; ``robust bench checkpoint`` measures it side by side). ``ettr_timed_steps``, the earlier
figure, sums the kept steps' timed part (forward to the loss all-reduce, the snapshot's blocking
inside it, the loop's other work outside it) instead.

Run under the shared lock, the recovery rows in commands under 6 minutes (BENCHMARKS.md)::

    python benchmarks/recovery_bench.py --rows crash hang nan --repeats 3
    python benchmarks/recovery_bench.py --rows spike sdc crash_emergency --repeats 3
    python benchmarks/recovery_bench.py --rows straggler torchrun ft_launcher --repeats 3 --nvrx-path DIR
    python benchmarks/recovery_bench.py --rows crash_cold crash_warm --repeats 3 --steps 40 --fault-step 25
    python benchmarks/recovery_bench.py --rows ettr --memory --ettr-seconds 600 --ettr-every 60 \
        --ettr-step-s 0.05 --save-every 50 --seed 3     # the 10-minute ETTR run (about 11 minutes)

``ft_launcher`` needs ``nvidia-resiliency-ext`` importable; ``--nvrx-path DIR[:DIR]`` is prepended
to ``PYTHONPATH`` for that row only (a throwaway ``pip install --target`` works).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from robust_plugins.launch import launch_env

SCRIPT = str(Path(__file__).with_name("ds_fault_train.py"))


def _job(cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int, str, float]:
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or launch_env(), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = -1
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the job left in its session
        except ProcessLookupError:
            pass
    return rc, out, t0


#: ``--memory``: every job's script uses the plugin's checkpoint block (set in main()).
MEMORY: list[str] = []


def _script_args(work: Path, steps: int, save_every: int, *extra: str) -> list[str]:
    return [SCRIPT, "--steps", str(steps), "--save-every", str(save_every), "--ckpt-dir", str(work / "ckpt"),
            "--step-log-dir", str(work / "steps"), "--out", str(work / "result.json"), *MEMORY, *extra]


def _step_log(work: Path) -> tuple[list[dict], list[dict]]:
    steps, kills = [], []
    for f in sorted((work / "steps").glob("steps-rank*.jsonl")):
        rank = int(f.stem.split("rank")[1])
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            rec["rank"] = rank
            (kills if "kill" in rec else steps).append(rec)
    return steps, kills


def _iso(t: str) -> float:
    return datetime.datetime.fromisoformat(t).timestamp()


#: The restart's phases, from the detection to the first step (``phases`` of a row): the agent
#: (stopping the old ranks, rendezvous, hand-off or spawn) up to the script's first line; the
#: script's own imports (nearly none for a warm standby); the process group; the engine
#: (``deepspeed.initialize`` with the resume from memory); the first step.
PHASES = ("to_script", "imports", "process_group", "engine", "first_step")


def phases_of(work: Path, inc: int, detected: float, steps: list[dict]) -> dict | None:
    """Seconds of each :data:`PHASES` of incarnation ``inc`` (each boundary: the slowest rank's)."""
    marks = []
    for f in (work / "steps").glob("phases-rank*.jsonl"):
        marks += [json.loads(x) for x in f.read_text().splitlines() if json.loads(x)["inc"] == inc]
    first = [s["t"] for s in steps if s["inc"] == inc]
    if not marks or not first:
        return None
    edge = [detected] + [max(m[k] for m in marks) for k in ("script", "imported", "dist", "engine")] + [min(first)]
    return {name: round(b - a, 3) for name, a, b in zip(PHASES, edge, edge[1:])}


def recovery(steps: list[dict], onset: float, inc_before: int) -> tuple[float | None, int | None, int | None]:
    """(seconds from onset to the first step of a later incarnation, steps lost, resumed step)."""
    before = [s["step"] for s in steps if s["inc"] <= inc_before]
    after = sorted((s for s in steps if s["inc"] > inc_before), key=lambda s: s["t"])
    if not after:
        return None, None, None
    first = after[0]
    resumed = min(s["step"] for s in steps if s["inc"] == first["inc"])
    lost = (max(before) - (resumed - 1)) if before else None
    return round(first["t"] - onset, 2), lost, resumed


def run_robust(work: Path, nproc: int, steps: int, save_every: int, inject: list[str], watchdog: list[str],
               timeout_s: float, script_extra: tuple[str, ...] = (), launcher_extra: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(work / "run"),
           "--standalone", "--nproc-per-node", str(nproc), "--monitor-interval", "0.1",
           "--max-restarts", "20", *launcher_extra]
    for w in watchdog:
        cmd += ["--watchdog", w]
    for i in inject:
        cmd += ["--inject", i]
    rc, out, t0 = _job(cmd + _script_args(work, steps, save_every, *script_extra), timeout_s)
    (work / "launcher.log").write_text(out)
    faults_path = work / "run" / "faults.jsonl"
    faults = [json.loads(x) for x in faults_path.read_text().splitlines()] if faults_path.exists() else []
    return {"rc": rc, "out": out, "t0": t0, "t_end": time.time(), "faults": faults}


def robust_row(name: str, spec: str, work: Path, args, watchdog: list[str], script_extra: tuple[str, ...] = (),
               launcher_extra: tuple[str, ...] = ()) -> dict:
    kind = name.split("_")[0]  # crash_emergency, crash_cold, crash_warm: a crash
    job = run_robust(work, args.nproc, args.steps, args.save_every, [spec], watchdog, args.timeout, script_extra,
                     launcher_extra)
    steps, _ = _step_log(work)
    fault = next((f for f in job["faults"] if f["kind"] == kind), None)
    row = {"launcher": "robust run", "fault": name, "inject": spec, "rc": job["rc"],
           "faults": [f["kind"] for f in job["faults"]]}
    if fault is None:
        row["note"] = f"no {kind} fault recorded; output tail: {job['out'][-1500:]}"
        return row
    detected = _iso(fault["time"])
    onset = detected - (fault["detected_after_s"] or 0.0)
    saves = (fault.get("detail") or {}).get("emergency_save")
    if saves:
        row["emergency_save"] = saves
    first = [s["t"] for s in steps if s["inc"] == 0]
    detail = fault.get("detail") or {}
    # The cold start of this very job: launch to the first step of its first incarnation.
    row.update(cold_start_s=round(min(first) - job["t0"], 2) if first else None,
               restart_s=detail.get("restart_s"), standby=detail.get("standby"))
    row.update(detected_after_s=fault["detected_after_s"], action=fault["action"],
               suspects=fault["suspect_ranks"], step=fault["step"],
               lost_steps_faults_jsonl=fault.get("lost_steps"), resumed_faults_jsonl=fault.get("resumed_at_step"))
    if fault["action"] == "report":
        row.update(recovered_after_s=0.0, lost_steps=0, note="report only: training went on")
    else:
        rec_s, lost, resumed = recovery(steps, onset, fault["incarnation"])
        row.update(recovered_after_s=rec_s, lost_steps=lost, resumed_at=resumed,
                   phases=phases_of(work, fault["incarnation"] + 1, detected, steps))
    return row


def baseline_row(launcher: str, work: Path, args) -> dict:
    kill = f"{args.kill_rank}:{args.fault_step}"
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        env = launch_env()
    else:
        cmd = [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher",
               "--ignore-missing-fault-tol-cfg"]
        env = launch_env()
        if args.nvrx_path:
            env["PYTHONPATH"] = os.pathsep.join([args.nvrx_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd += ["--standalone", "--nproc-per-node", str(args.nproc), "--max-restarts", "1", "--monitor-interval", "0.1",
            *_script_args(work, args.steps, args.save_every, "--kill-at", kill)]
    rc, out, t0 = _job(cmd, args.timeout, env)
    (work / "launcher.log").write_text(out)
    steps, kills = _step_log(work)
    row = {"launcher": launcher, "fault": "crash", "inject": f"--kill-at {kill}", "rc": rc,
           "completed": (work / "result.json").exists()}
    if not kills:
        row["note"] = f"the kill never happened; output tail: {out[-2500:]}"
        return row
    onset = kills[0]["t"]
    rec_s, lost, resumed = recovery(steps, onset, 0)
    row.update(recovered_after_s=rec_s, lost_steps=lost, resumed_at=resumed)
    if rec_s is None:
        errors = sorted({line.strip()[:200] for line in out.splitlines()
                         if "Error" in line and "ChildFailedError" not in line})
        row["note"] = f"no step after the restart; errors: {errors[:6]}"
    return row


def ettr_run(work: Path, args) -> dict:
    """One job of ``--ettr-seconds`` with a random fault every ``--ettr-every`` seconds."""
    # Injections fire at a step, not a time: one fault per --ettr-every seconds of training at the
    # step time --ettr-step-s (measured in the recovery rows), at a random rank.
    rng = random.Random(args.seed)
    kinds = ["kill", "hang", "nan", "spike"]
    every_steps = max(5, int(args.ettr_every / args.ettr_step_s))
    injects, step = [], 0
    n_faults = int(args.ettr_seconds // args.ettr_every)
    for i in range(n_faults):
        step += every_steps
        kind = kinds[rng.randrange(len(kinds))]
        injects.append(f"{kind}:rank={rng.randrange(args.nproc)},step={step + rng.randrange(-every_steps // 4, every_steps // 4)}")
    wd = ["straggler_factor=0", "hang_min_timeout_s=5", "hang_initial_timeout_s=60"]
    job = run_robust(work, args.nproc, 10**6, args.save_every, injects, wd, args.ettr_seconds + 60,
                     ("--seconds", str(args.ettr_seconds)))
    steps, _ = _step_log(work)
    wall = job["t_end"] - job["t0"]
    # The steps that count: for each step number, the latest incarnation that completed it (the
    # earlier completions of a replayed step were lost work). Step time: rank 0's wall time.
    kept: dict[int, dict] = {}
    blocked: dict[tuple[int, int], float] = {}  # (incarnation, step) -> the slowest rank's blocking
    prev: dict[int, dict] = {}
    for s in sorted(steps, key=lambda s: (s["rank"], s["inc"], s["t"])):
        key = (s["inc"], s["step"])
        blocked[key] = max(blocked.get(key, 0.0), s.get("wd", 0.0) + s.get("snap", 0.0))
        if s["rank"] != 0:
            continue
        p = prev.get(s["inc"])
        s["loop"] = s["t"] - p["t"] if p is not None and p["step"] == s["step"] - 1 else s["dt"]
        prev[s["inc"]] = s
        if s["step"] not in kept or s["inc"] >= kept[s["step"]]["inc"]:
            kept[s["step"]] = s
    plugin = sum(blocked[(s["inc"], s["step"])] for s in kept.values())
    productive = sum(s["loop"] for s in kept.values()) - plugin
    timed = sum(s["dt"] for s in kept.values())
    return {"injected": injects, "rc": job["rc"], "wall_s": round(wall, 1),
            "memory_every": args.memory_every if MEMORY else None,
            "faults": [(f["kind"], f["step"], f["suspect_ranks"], f["action"]) for f in job["faults"]],
            "steps_kept": len(kept), "productive_s": round(productive, 1), "plugin_blocking_s": round(plugin, 1),
            "ettr": round(productive / wall, 3), "ettr_timed_steps": round(timed / wall, 3),
            # Work done and then lost to a rollback or restart (steps trained twice).
            "retrained_s": round(sum(s["loop"] for s in steps if s["rank"] == 0)
                                 - sum(s["loop"] for s in kept.values()), 1),
            "incarnations": 1 + max((s["inc"] for s in steps), default=0),
            "first_step_after_s": round(min(s["t"] for s in steps) - job["t0"], 1) if steps else None,
            "note": "" if job["rc"] == 0 else job["out"][-2000:]}


def _spread(rows: list[dict], key: str, unit: str = "") -> str:
    """``median (min-max)`` of ``key`` over the rows that have it; ``-`` when none has."""
    vals = sorted(r[key] for r in rows if r.get(key) is not None)
    if not vals:
        return "-"
    med = statistics.median(vals)
    fmt = (lambda v: f"{v:g}") if all(isinstance(v, int) for v in vals) else (lambda v: f"{v:.2f}")
    if len(vals) == 1:
        return f"{fmt(med)}{unit}"
    return f"{fmt(med)}{unit} ({fmt(vals[0])}-{fmt(vals[-1])})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", nargs="+", required=True,
                   choices=["crash", "crash_emergency", "crash_cold", "crash_warm", "hang", "nan", "spike",
                            "straggler", "sdc", "torchrun", "ft_launcher", "ettr"])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--fault-step", type=int, default=35)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--nvrx-path", default="")
    p.add_argument("--ettr-seconds", type=float, default=300)
    p.add_argument("--ettr-every", type=float, default=60)
    p.add_argument("--ettr-step-s", type=float, default=0.25, help="expected step time (places the faults)")
    p.add_argument("--memory-every", type=int, default=1,
                   help="with --memory: a snapshot every this many steps (the recovery rows' targets assume 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="jobs per row, interleaved (row order repeated); the table gives medians and ranges")
    p.add_argument("--keep", help="keep the work directories here")
    p.add_argument("--memory", action="store_true",
                   help="robust run rows: a memory snapshot every step, persisted every --save-every steps "
                        "(ds_fault_train.py --memory) instead of the script's own disk checkpoints")
    args = p.parse_args()
    if args.memory_every < 1:
        p.error(f"--memory-every {args.memory_every}: a snapshot interval in steps, 1 or more")
    if args.memory_every != 1 and not args.memory:
        p.error(f"--memory-every {args.memory_every} needs --memory (without it there are no snapshots)")
    if args.memory:
        bad = [r for r in args.rows if r in ("crash_emergency", "torchrun", "ft_launcher")]
        if bad:
            p.error(f"--memory with --rows {' '.join(bad)}: those rows keep their own checkpoint setup; "
                    f"--memory is for crash, crash_cold, crash_warm, hang, nan, spike, straggler, sdc and ettr")
        MEMORY.extend(["--memory", "--memory-every", str(args.memory_every)])
    S = args.fault_step
    hang = ["hang_min_timeout_s=3", "hang_initial_timeout_s=60"]
    specs = {
        "crash": (f"kill:rank={args.kill_rank},step={S}", []),
        # ZeRO 0 with the checkpoint block: a live rank saves step S before the restart.
        "crash_emergency": (f"kill:rank={args.kill_rank},step={S}", []),
        "crash_cold": (f"kill:rank={args.kill_rank},step={S}", []),  # --no-standby
        "crash_warm": (f"kill:rank={args.kill_rank},step={S}", []),  # standbys (the default)
        "hang": (f"hang:rank=2,step={S}", hang),
        "nan": (f"nan:rank=1,step={S}", []),
        "spike": (f"spike:rank=3,step={S}", []),
        # a 2 s minimum: the row times detection, not the default 10 s confirmation
        "straggler": (f"slow:rank=2,step=15,seconds=0.5", ["straggler_window=10", "straggler_min_s=2"]),
        # every 5 steps: the flip at S-2 is found in the check at S
        "sdc": (f"bitflip:rank=3,step={S - 2}", ["sdc_every_steps=5"]),
    }
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    # Repeats interleaved (crash hang ... crash hang ...): load from other jobs that drifts over
    # minutes lands on every row alike instead of on one row's repeats.
    for rep in range(args.repeats):
        for name in args.rows:
            work = root / (name if args.repeats == 1 else f"{name}-{rep}")
            work.mkdir(parents=True, exist_ok=True)
            t = time.monotonic()
            if name in specs:
                spec, wd = specs[name]
                if name != "straggler":
                    wd = ["straggler_factor=0", *wd]
                row = robust_row(name, spec, work, args, wd,
                                 ("--emergency",) if name == "crash_emergency" else (),
                                 ("--no-standby",) if name == "crash_cold" else ())
            elif name in ("torchrun", "ft_launcher"):
                row = baseline_row(name, work, args)
            else:
                row = ettr_run(work, args)
            row["job_s"] = round(time.monotonic() - t, 1)
            row["repeat"] = rep
            rows.append(row)
            print(json.dumps(row), flush=True)
    saves = (f"memory snapshot every {args.memory_every} step(s), persisted every {args.save_every} steps" if args.memory
             else f"disk checkpoint every {args.save_every} steps")
    print(f"\n{args.nproc} ranks, DeepSpeed ZeRO-1 tiny GPT, {saves}, "
          f"fault at step {S}, {args.repeats} job(s) a row: median (min-max) ({root})")
    print("| launcher | fault | injected | detected after | action | recovered after (fault -> first step) | steps lost | resumed at | jobs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.rows:
        group = [r for r in rows if r.get("fault") is not None and
                 (r["fault"] == name if name in specs else r["launcher"] == name)]
        if not group:
            continue
        r = group[0]
        failed = sum(1 for g in group if g.get("recovered_after_s") is None)
        print(f"| {r['launcher']} | {r['fault']} | `{r['inject']}` | {_spread(group, 'detected_after_s', ' s')} | "
              f"{r.get('action', 'restart')} | {_spread(group, 'recovered_after_s', ' s')}"
              f"{f' ({failed} of {len(group)} never recovered)' if failed else ''} | "
              f"{_spread(group, 'lost_steps')} | {_spread(group, 'resumed_at')} | {len(group)} |")
    _warm_vs_cold(rows)
    _phase_table(rows, args.rows)
    if not args.keep:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def _phase_table(rows: list[dict], names: list[str]) -> None:
    """Where each row's restart went, detection to first step (medians over its jobs)."""
    have = [n for n in names if any(r.get("fault") == n and r.get("phases") for r in rows)]
    if not have:
        return
    print("\nrestart phases, detection -> first step, seconds (median over the jobs; each boundary is the slowest rank's)")
    print("| fault | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for name in have:
        group = [r["phases"] for r in rows if r.get("fault") == name and r.get("phases")]
        print(f"| {name} | " + " | ".join(f"{statistics.median(g[k] for g in group):.3f}" for k in PHASES) + " |")


def _warm_vs_cold(rows: list[dict]) -> None:
    """The issue-15 target: warm recovery (fault -> first step) <= 0.3 x the cold start of the same launch."""
    warm = [r for r in rows if r.get("fault") == "crash_warm" and r.get("recovered_after_s") is not None]
    cold = [r for r in rows if r.get("fault") == "crash_cold" and r.get("recovered_after_s") is not None]
    starts = [r["cold_start_s"] for r in warm + cold if r.get("cold_start_s") is not None]
    if not warm or not starts:
        return
    w, c0 = statistics.median(r["recovered_after_s"] for r in warm), statistics.median(starts)
    line = (f"\nwarm recovery {w:.2f} s (standby served {sum(bool(r.get('standby')) for r in warm)} of {len(warm)}), "
            f"cold start (launch -> first step) {c0:.2f} s: warm = {w / c0:.2f}x the cold start (target <= 0.3x)")
    if cold:
        c = statistics.median(r["recovered_after_s"] for r in cold)
        line += f"; cold recovery {c:.2f} s = {c / c0:.2f}x; warm / cold recovery = {w / c:.2f}"
    restart = {n: _spread([r for r in rows if r.get("fault") == n], "restart_s", " s") for n in ("crash_cold", "crash_warm")}
    print(line + f"; restart_s (detection -> ranks running) cold {restart['crash_cold']}, warm {restart['crash_warm']}")


if __name__ == "__main__":
    main()

"""Watchdog overhead on a fault-free run: interleaved A/B jobs, and the watchdog's own cost measured directly.

A/B: the text GPT under DeepSpeed (``benchmarks/ds_fault_train.py``, ZeRO-1, gloo, CPU), the same
steps under plain ``torchrun`` (every watchdog call returns at once there) and under ``robust run``
with the detectors at their defaults (step signals, NaN/spike, hang, the straggler detector's
collective timing, the parameter hash every ``--sdc-every`` steps), alternated A B B A A B ...
in one invocation. Per arm: the median of every rank's per-step wall times after ``--skip``
warm-up steps, pooled over the rounds; the spread is the range of the per-round ratios.

Direct cost (not limited by the noise of shared cores):
- on the ranks: wall and CPU time (``time.process_time``) inside ``watchdog.step_end`` and
  ``watchdog.check_params`` per step, measured by the script around those calls in the real job;
- the collective timing of the straggler detector: collectives per step (counted by the rank's
  timer in the real job) x the added time per call (``watchdog_bench.rank_side_cost``, in process);
- the node monitor: CPU seconds of the launcher process (``/proc/<pid>/stat`` utime + stime,
  sampled until it exits) per step, ``robust run`` minus ``torchrun`` (whose elastic agent polls too).

Run under the shared lock (about 5 minutes with the defaults)::

    python benchmarks/watchdog_overhead.py --nproc 4 --steps 150 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from robust_plugins.launch import launch_env

HERE = Path(__file__).parent
SCRIPT = str(HERE / "ds_fault_train.py")
_TICK = os.sysconf("SC_CLK_TCK")


def _own_cpu_s(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (this process, all threads)


def run_job(arm: str, work: Path, args) -> dict:
    work.mkdir(parents=True)
    script = [SCRIPT, "--steps", str(args.steps), "--save-every", str(args.steps + 1),
              "--ckpt-dir", str(work / "ckpt"), "--step-log-dir", str(work / "steps"), "--out", str(work / "result.json")]
    if arm == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run"]
    else:
        cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(work / "run"),
               "--watchdog", f"sdc_every_steps={args.sdc_every}"]
    cmd += ["--standalone", "--nproc-per-node", str(args.nproc), "--monitor-interval", "0.1", *script]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=launch_env(),
                            start_new_session=True)
    cpu = None
    deadline = time.monotonic() + args.timeout
    out = b""
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            cpu = _own_cpu_s(proc.pid) or cpu
            try:
                out += proc.communicate(timeout=0.2)[0] or b""
            except subprocess.TimeoutExpired:
                pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} job failed ({proc.returncode}): {out.decode(errors='replace')[-2000:]}")
    dts = []
    for f in (work / "steps").glob("steps-rank*.jsonl"):
        dts += [r["dt"] for r in map(json.loads, f.read_text().splitlines()) if r.get("step", 0) > args.skip]
    res = json.loads((work / "result.json").read_text())
    if arm == "robust run":
        faults = (work / "run" / "faults.jsonl")
        acting = [json.loads(x) for x in faults.read_text().splitlines()] if faults.exists() else []
        res["faults"] = [(f["kind"], f["action"]) for f in acting]
    return {"median_step_s": statistics.median(dts), "dts": dts, "launcher_cpu_s": cpu, **res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the step times")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sdc-every", type=int, default=100)
    p.add_argument("--timeout", type=float, default=180)
    args = p.parse_args()
    arms = {"torchrun": [], "robust run": []}
    with tempfile.TemporaryDirectory(prefix="wd-overhead-") as tmp:
        for r in range(args.rounds):
            order = ["torchrun", "robust run"] if r % 2 == 0 else ["robust run", "torchrun"]
            for arm in order:
                res = run_job(arm, Path(tmp) / f"{r}-{arm.replace(' ', '_')}", args)
                arms[arm].append(res)
                print(f"round {r} {arm}: median step {res['median_step_s'] * 1e3:.2f} ms, launcher CPU "
                      f"{res['launcher_cpu_s']:.2f} s, watchdog on rank {res['watchdog_wall_s_per_step'] * 1e6:.1f} us "
                      f"wall / {res['watchdog_cpu_s_per_step'] * 1e6:.1f} us CPU a step"
                      + (f", faults {res['faults']}" if res.get("faults") else ""), flush=True)
    sys.path.insert(0, str(HERE))
    from watchdog_bench import rank_side_cost

    per_call = rank_side_cost()
    timed_us = max(0.0, per_call["all_reduce_timed_us"] - per_call["all_reduce_plain_us"])
    pooled = {a: statistics.median([d for res in v for d in res["dts"]]) for a, v in arms.items()}
    ratios = [b["median_step_s"] / a["median_step_s"] for a, b in zip(arms["torchrun"], arms["robust run"])]
    base = pooled["torchrun"]
    steps_done = args.steps
    rb = arms["robust run"]
    rank_wall = statistics.median(r["watchdog_wall_s_per_step"] for r in rb)
    rank_cpu = statistics.median(r["watchdog_cpu_s_per_step"] for r in rb)
    colls = statistics.median(r["timed_collectives_per_step"] or 0 for r in rb)
    mon = (statistics.median(r["launcher_cpu_s"] for r in rb)
           - statistics.median(r["launcher_cpu_s"] for r in arms["torchrun"])) / steps_done
    print(f"\n{args.nproc} ranks, {args.steps} steps (first {args.skip} left out), {args.rounds} rounds, "
          f"sdc_every_steps={args.sdc_every}")
    print("| launcher | median step time (pooled) | per-round medians | vs torchrun |")
    print("|---|---|---|---|")
    for arm, v in arms.items():
        per_round = ", ".join(f"{r['median_step_s'] * 1e3:.2f}" for r in v)
        print(f"| {arm} | {pooled[arm] * 1e3:.2f} ms | {per_round} | "
              f"{pooled[arm] / base:.4f}x |")
    print(f"per-round ratios robust/torchrun: {', '.join(f'{x:.4f}' for x in ratios)} "
          f"(min {min(ratios):.4f}, max {max(ratios):.4f})")
    added = rank_wall + colls * timed_us * 1e-6
    print("\ndirect cost per step (robust run):")
    print(f"| rank: step_end + check_params | {rank_wall * 1e6:.1f} us wall, {rank_cpu * 1e6:.1f} us CPU | "
          f"{rank_wall / base * 100:.3f} % of the step |")
    print(f"| rank: collective timing | {colls:.1f} collectives x {timed_us:.1f} us | "
          f"{colls * timed_us * 1e-6 / base * 100:.3f} % |")
    print(f"| node monitor (launcher CPU, robust run - torchrun) | {mon * 1e6:.0f} us CPU a step | "
          f"{mon / base * 100:.3f} % of one step's wall time on one core |")
    print(f"rank-side total: {added * 1e6:.1f} us = {added / base * 100:.3f} % of the {base * 1e3:.2f} ms step")


if __name__ == "__main__":
    main()

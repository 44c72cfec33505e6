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
import threading
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
    samples: list[tuple[float, float]] = []
    deadline = time.monotonic() + args.timeout
    out = b""
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            cpu = _own_cpu_s(proc.pid) or cpu
            if cpu is not None:
                samples.append((time.time(), cpu))
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
    dts, wd, wd_check, wd_first, t_steps = [], [], [], [], {}
    for f in (work / "steps").glob("steps-rank*.jsonl"):
        recs = [r for r in map(json.loads, f.read_text().splitlines()) if "step" in r]
        dts += [r["dt"] for r in recs if r["step"] > args.skip]
        wd_first += [r["wd"] for r in recs if r["step"] == 1]
        wd += [r["wd"] for r in recs if r["step"] > 1 and r["step"] % args.sdc_every]
        wd_check += [r["wd"] for r in recs if r["step"] % args.sdc_every == 0]
        if f.name == "steps-rank0.jsonl":
            t_steps = {r["step"]: r["t"] for r in recs}
    res = json.loads((work / "result.json").read_text())
    # The launcher's CPU between the end of warm-up and the last step: its steady per-step cost,
    # without the one-time work of starting (imports, rendezvous) and stopping the job.
    t_a, t_b = t_steps[args.skip], t_steps[max(t_steps)]
    inside = [c for t, c in samples if t_a <= t <= t_b]
    res["launcher_cpu_per_step_s"] = ((inside[-1] - inside[0]) / (max(t_steps) - args.skip)
                                      if len(inside) >= 2 else None)
    res["wd_step_median_s"] = statistics.median(wd)
    res["wd_check_median_s"] = statistics.median(wd_check) if wd_check else 0.0
    res["wd_first_median_s"] = statistics.median(wd_first)
    if arm == "robust run":
        faults = (work / "run" / "faults.jsonl")
        acting = [json.loads(x) for x in faults.read_text().splitlines()] if faults.exists() else []
        res["faults"] = [(f["kind"], f["action"]) for f in acting]
    return {"median_step_s": statistics.median(dts), "dts": dts, "launcher_cpu_s": cpu, **res}


def monitor_cost(nproc: int, n: int = 2000, per_poll: int = 3) -> dict[str, float]:
    """CPU microseconds the node monitor spends (in process, ``time.process_time``): reading and
    handling one step record from a rank's ring (``per_poll`` new records a rank between polls,
    about 0.1 s of 35 ms steps), a poll that finds nothing new (the receiver thread's, every
    0.2 s), and one ``check`` of ``nproc`` ranks with full detector windows (the agent calls it
    every monitor interval)."""
    from robust_plugins.config import WatchdogConfig
    from robust_plugins.launcher.monitor import Monitor
    from robust_plugins.watchdog.ring import RingWriter

    with tempfile.TemporaryDirectory(prefix="wd-mon-") as tmp:
        mon = Monitor(WatchdogConfig(), tmp, host="bench")
        try:
            prefix = mon.worker_env(range(nproc))["ROBUST_WATCHDOG_RING"]
            mon.begin_incarnation({r: 0 for r in range(nproc)})
            writers = [RingWriter(f"{prefix}{r}") for r in range(nproc)]
            mon.transport._stop.set()
            mon.transport._thread.join(timeout=5)  # the polls below are the only ones
            # An idle stand-in for the receiver thread: check() stands down without a live one.
            idle = threading.Event()
            mon.transport._thread = threading.Thread(target=idle.wait, daemon=True)
            mon.transport._thread.start()
            spent = 0.0
            for step in range(1, n + 1):
                for w in writers:
                    w.write(step, 2.0, 1.0, 0.045, 0.02, time.monotonic())
                if step % per_poll == 0:
                    c0 = time.process_time()
                    mon.transport.drain()
                    spent += time.process_time() - c0
            per_record = spent / (n // per_poll * per_poll * nproc)
            c0 = time.process_time()
            for _ in range(n):
                mon.transport.drain()
            per_empty_poll = (time.process_time() - c0) / n
            c0 = time.process_time()
            for _ in range(n // 4):
                mon._check(will_restart=True)
            per_check = (time.process_time() - c0) / (n // 4)
            for w in writers:
                w.close()
            idle.set()
        finally:
            mon.close()
    return {"per_record_us": per_record * 1e6, "per_empty_poll_us": per_empty_poll * 1e6,
            "per_check_us": per_check * 1e6}


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
                      f"{res['launcher_cpu_s']:.2f} s ({(res['launcher_cpu_per_step_s'] or 0) * 1e6:.0f} us a "
                      f"step after warm-up), watchdog on rank: mean {res['watchdog_wall_s_per_step'] * 1e6:.1f} "
                      f"us wall / {res['watchdog_cpu_s_per_step'] * 1e6:.1f} us CPU a step; median step "
                      f"{res['wd_step_median_s'] * 1e6:.1f} us, check step {res['wd_check_median_s'] * 1e3:.2f} ms, "
                      f"first step {res['wd_first_median_s'] * 1e3:.2f} ms"
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
    mon_steady = (statistics.median(r["launcher_cpu_per_step_s"] or 0 for r in rb)
                  - statistics.median(r["launcher_cpu_per_step_s"] or 0 for r in arms["torchrun"]))
    wd_step = statistics.median(r["wd_step_median_s"] for r in rb)
    wd_check = statistics.median(r["wd_check_median_s"] for r in rb)
    wd_first = statistics.median(r["wd_first_median_s"] for r in rb)
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
    steady = wd_step + wd_check / args.sdc_every
    added = steady + colls * timed_us * 1e-6
    print("\ndirect cost per step (robust run):")
    print(f"| rank: step_end + check_params, mean over the run | {rank_wall * 1e6:.1f} us wall, {rank_cpu * 1e6:.1f} "
          f"us CPU | {rank_wall / base * 100:.3f} % of the step (includes one-time costs) |")
    print(f"| rank: of which the first step (opens the collective timer) | {wd_first * 1e3:.2f} ms once | - |")
    print(f"| rank: a plain step's step_end + check_params (median) | {wd_step * 1e6:.1f} us | "
          f"{wd_step / base * 100:.3f} % |")
    print(f"| rank: a hash-check step (every {args.sdc_every}; hash + all-gather, including waiting for peers) | "
          f"{wd_check * 1e3:.2f} ms | {wd_check / args.sdc_every / base * 100:.3f} % amortized |")
    print(f"| rank: collective timing | {colls:.1f} collectives x {timed_us:.1f} us | "
          f"{colls * timed_us * 1e-6 / base * 100:.3f} % |")
    print(f"| node monitor (launcher CPU, robust run - torchrun, whole job / steps) | {mon * 1e6:.0f} us CPU a step | "
          f"{mon / base * 100:.3f} % of one step's wall time on one core (includes start-up) |")
    print(f"| node monitor (launcher CPU after warm-up, robust run - torchrun) | {mon_steady * 1e6:.0f} us CPU a step | "
          f"{mon_steady / base * 100:.3f} % of one step's wall time on one core |")
    mc = monitor_cost(args.nproc)
    per_step_mon = (args.nproc * mc["per_record_us"] + mc["per_check_us"] * min(1.0, base / 0.1)
                    + mc["per_empty_poll_us"] * min(1.0, base / 0.2))
    print(f"| node monitor, in process: {args.nproc} step records x {mc['per_record_us']:.1f} us + one check "
          f"({args.nproc} ranks, full windows) {mc['per_check_us']:.1f} us every 0.1 s + a receiver poll "
          f"{mc['per_empty_poll_us']:.1f} us every 0.2 s | {per_step_mon:.0f} us CPU a step | "
          f"{per_step_mon * 1e-6 / base * 100:.3f} % of one step's wall time on one core |")
    print(f"rank-side steady total (plain step + amortized check + collective timing): {added * 1e6:.1f} us = "
          f"{added / base * 100:.3f} % of the {base * 1e3:.2f} ms step")


if __name__ == "__main__":
    main()

"""``robust run``'s watchdog: overhead on a fault-free run and detection latency per fault kind.

Overhead: the plain-PyTorch GPT recipe (``robust_plugins.recipes.plain_gpt.train``, gloo ranks)
under plain ``torchrun`` (every watchdog call is a no-op there) and under ``robust run`` with
every detector on (step signals, collective timing for the straggler detector, the parameter hash
every ``sdc_every_steps``), alternated ``--rounds`` times in one invocation; each run reports
the median of its own per-step wall times, and the table gives the median over rounds and the
ratio. Detection: one ``robust run`` per fault kind with an injected crash, hang and NaN, reading
``detected_after_s`` from ``faults.jsonl``; and ``--hangs N`` runs with a hang at a random rank
and step, counting those whose suspect list is exactly the hung rank.

Run (about 4 minutes on 2 CPU cores)::

    python benchmarks/watchdog_bench.py --nproc 2 --steps 150 --rounds 3 --hangs 5

Every job runs in its own session under a hard timeout and is killed with its ranks after it.
"""

from __future__ import annotations

import argparse
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

RECIPE = ["-m", "robust_plugins.recipes.plain_gpt.train"]


def _job(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=launch_env(), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the job left in its session
        except ProcessLookupError:
            pass
    return proc.returncode, out


def _recipe_args(work: Path, steps: int) -> list[str]:
    return [*RECIPE, "--steps", str(steps), "--save-every", str(steps), "--corpus-bytes", "200000",
            "--ckpt-dir", str(work / "ckpt"), "--out", str(work / "result.json")]


def run_torchrun(work: Path, nproc: int, steps: int) -> dict:
    """A fault-free run under plain torchrun; the recipe's result JSON."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *_recipe_args(work, steps)]
    rc, out = _job(cmd, 600)
    if rc != 0:
        raise RuntimeError(f"torchrun run failed ({rc}):\n{out[-2000:]}")
    return json.loads((work / "result.json").read_text())


def run_robust(work: Path, nproc: int, steps: int, *extra: str, timeout_s: float = 600) -> tuple[dict | None, list]:
    """A ``robust run`` job; (result JSON or None, faults.jsonl records)."""
    cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(work / "run"),
           "--standalone", "--nproc-per-node", str(nproc), "--monitor-interval", "0.1", *extra,
           *_recipe_args(work, steps)]
    rc, out = _job(cmd, timeout_s)
    faults_path = work / "run" / "faults.jsonl"
    faults = [json.loads(x) for x in faults_path.read_text().splitlines()] if faults_path.exists() else []
    result = json.loads((work / "result.json").read_text()) if rc == 0 else None
    if rc != 0:
        print(f"robust run exited {rc}:\n{out[-2000:]}", file=sys.stderr)
    return result, faults


def rank_side_cost(n: int = 5000) -> dict[str, float]:
    """Microseconds the watchdog adds to one rank per step, measured in this process: a
    ``step_end`` (one record into a step ring, as under ``robust run``) and the collective
    timing of the straggler detector on one small gloo all-reduce (world of 1), each the median of
    ``n`` calls against the same calls without it."""
    import socket as _socket

    import torch
    import torch.distributed as dist

    from robust_plugins.watchdog import client, protocol
    from robust_plugins.watchdog.ring import RingReader

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="wd-us-") as tmp:
        path = os.path.join(tmp, "m.sock")
        srv = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
        srv.bind(path)  # receives the hello; steps go to the ring
        ring = RingReader.create(os.path.join(tmp, "ring0"))
        os.environ.update({protocol.ENV_SOCKET: path, protocol.ENV_RING: os.path.join(tmp, "ring"),
                           protocol.ENV_STRAGGLER: "1", "RANK": "0"})
        os.environ.pop(protocol.ENV_RUN_DIR, None)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            t = torch.zeros(1024)

            def per_call(fn) -> float:
                times = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                return statistics.median(times) * 1e6

            plain = per_call(lambda: dist.all_reduce(t))
            step = iter(range(1, 10**9))
            # The first step_end opens the collective timer (WireCounter) for the process's life.
            out["step_end_us"] = per_call(lambda: client.step_end(next(step), loss=1.0, grad_norm=1.0))
            c = client.get_client()
            if c is None or c.ring is None:
                raise RuntimeError("the client did not map its step ring: step_end was not measured "
                                   "on the path robust run uses")
            timed = per_call(lambda: dist.all_reduce(t))
            out["all_reduce_plain_us"] = plain
            out["all_reduce_timed_us"] = timed
        finally:
            c = client.get_client()
            if c is not None and c.comm is not None:
                c.comm.__exit__(None, None, None)
            dist.destroy_process_group()
            srv.close()
            ring.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hangs", type=int, default=5, help="hangs at random ranks/steps (localization)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    rows: dict[str, list[float]] = {"torchrun": [], "robust run": []}
    with tempfile.TemporaryDirectory(prefix="wd-bench-") as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            rows["torchrun"].append(run_torchrun(root / f"t{r}", args.nproc, args.steps)["step_time_median_s"])
            res, faults = run_robust(root / f"r{r}", args.nproc, args.steps)
            # A straggler report changes nothing in the run (action "report"); on 2 shared cores
            # a starved rank can earn one. Anything that restarts the job spoils the comparison.
            acting = [f for f in faults if f.get("action") != "report"]
            if res is None or acting:
                raise RuntimeError(f"fault-free robust run failed or reported faults: {acting}")
            rows["robust run"].append(res["step_time_median_s"])
        cost = rank_side_cost()
        print(f"\nrank-side cost per call (median of 5000, in process): step_end "
              f"{cost['step_end_us']:.1f} us (a record into its step ring); a 4 KiB gloo all_reduce "
              f"{cost['all_reduce_plain_us']:.1f} us plain, {cost['all_reduce_timed_us']:.1f} us with "
              f"the straggler detector's collective timing")
        base = statistics.median(rows["torchrun"])
        print(f"\noverhead: {args.nproc} ranks, {args.steps} steps, {args.rounds} rounds (median of "
              f"per-run median step times)")
        print("| launcher | median step time | per round | vs torchrun |")
        print("|---|---|---|---|")
        for name, vals in rows.items():
            med = statistics.median(vals)
            print(f"| {name} | {med * 1e3:.2f} ms | {', '.join(f'{v * 1e3:.2f}' for v in vals)} | "
                  f"{med / base:.3f}x |")

        latency = []
        hang_opts = ["--watchdog", "hang_min_timeout_s=3", "--watchdog", "hang_initial_timeout_s=60"]
        for kind, spec, extra in (("crash", "kill:rank=1,step=40", []),
                                  ("nan", "nan:rank=1,step=40", []),
                                  ("hang", "hang:rank=0,step=40", hang_opts)):
            _, faults = run_robust(root / f"lat-{kind}", args.nproc, 60, "--max-restarts", "1",
                                   "--inject", spec, *extra)
            f = faults[0] if faults else {}
            latency.append((kind, spec, f.get("kind"), f.get("detected_after_s"), f.get("suspect_ranks"),
                            f.get("step"), (f.get("detail") or {}).get("timeout_s")))
        print("\ndetection latency (one run each, 60 steps)")
        print("| injected | detected as | detected after | suspects | step | hang timeout |")
        print("|---|---|---|---|---|---|")
        for kind, spec, got, after, sus, step, tmo in latency:
            print(f"| `{spec}` | {got} | {after} s | {sus} | {step} | {tmo if tmo is not None else '-'} |")

        exact = 0
        trials = []
        for h in range(args.hangs):
            rank, step = rng.randrange(args.nproc), rng.randrange(15, 55)
            _, faults = run_robust(root / f"hang{h}", args.nproc, 60, "--max-restarts", "1",
                                   "--inject", f"hang:rank={rank},step={step}", *hang_opts)
            sus = faults[0]["suspect_ranks"] if faults else None
            trials.append((rank, step, sus))
            exact += sus == [rank]
        if trials:
            print(f"\nlocalization: {exact}/{len(trials)} hangs named exactly the hung rank "
                  f"({'; '.join(f'rank {r} step {s} -> {sus}' for r, s, sus in trials)})")


if __name__ == "__main__":
    main()

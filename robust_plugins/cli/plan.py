"""``robust plan``: project ETTR and the best snapshot intervals for 1k-100k GPUs.

The model is :mod:`robust_plugins.plan` (pure); this command parses, prints and names the source
of every default. The cost defaults are this project's own measurements on a 2-core CPU machine
(``BENCHMARKS.md``); give your cluster's with the flags.
"""

from __future__ import annotations

import argparse
import json
import math

from robust_plugins import plan as model
from robust_plugins.errors import ConfigError

#: ``BENCHMARKS.md``, "Recovery per fault kind": medians of "detected after" (hang with the
#: learned floor of 3 s).
DETECT_S = {"crash": 0.20, "hang": 3.07, "nan": 0.08, "spike": 0.03, "sdc": 0.01}
#: Same table, crash row: 9.10 s from the fault to the first step, of which 0.20 s detection.
COLD_RECOVERY_S = 8.90
#: "ETTR with a fault about every minute": 8.4 s from launch to the first step.
START_S = 8.4
#: "Checkpoints: memory snapshots vs disk": snapshot blocking (median), verified atomic save, step.
SNAPSHOT_BLOCK_S, PERSIST_BLOCK_S, STEP_S = 0.00428, 0.0643, 0.2248
#: Faults memory snapshots cannot restore (a node and its peer holder lost together, a
#: relaunch): an assumption, no published figure.
DISK_SHARE = 0.05
GPUS = (1_024, 4_096, 16_384, 65_536, 100_000)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``robust plan``."""
    p.add_argument("--gpus", type=int, nargs="+", default=list(GPUS), help="cluster sizes (default: %(default)s)")
    p.add_argument("--failures-per-gpu-hour", type=float, default=model.LLAMA3_FAILURES_PER_GPU_HOUR,
                   help="default: Llama 3, 419 unexpected interruptions in 54 days on 16,384 GPUs (%(default).3g)")
    p.add_argument("--mix", default=None, help="fault kinds' shares, KIND=SHARE,... summing to 1 "
                   "(default: Llama 3's Table 5: crash 0.969, hang 0.017 (NCCL timeouts), sdc 0.014)")
    p.add_argument("--step-s", type=float, default=STEP_S,
                   help="training step time (default: BENCHMARKS.md's checkpoint bench step, %(default)s s)")
    p.add_argument("--detect", default=None, help="detection seconds per kind, KIND=S,... (default: BENCHMARKS.md "
                   "recovery table medians: " + ",".join(f"{k}={v}" for k, v in DETECT_S.items()) + ")")
    p.add_argument("--cold-recovery-s", type=float, default=COLD_RECOVERY_S,
                   help="detection to first step, full restart (default: BENCHMARKS.md crash row, %(default)s s)")
    p.add_argument("--warm-recovery-s", type=float, default=None,
                   help="the same with warm standby workers; adds a column (measured on 4 CPU ranks with "
                        "ready standbys: 0.81 s median, BENCHMARKS.md)")
    p.add_argument("--start-s", type=float, default=START_S, help="launch to first step, once (default: %(default)s s)")
    p.add_argument("--snapshot-block-s", type=float, default=SNAPSHOT_BLOCK_S,
                   help="memory snapshot blocking (default: BENCHMARKS.md, %(default)s s)")
    p.add_argument("--persist-block-s", type=float, default=PERSIST_BLOCK_S,
                   help="disk checkpoint blocking (default: BENCHMARKS.md verified save, %(default)s s)")
    p.add_argument("--disk-share", type=float, default=DISK_SHARE,
                   help="faults memory cannot restore (default: %(default)s, an assumption)")
    p.add_argument("--memory-every", type=int, default=None, help="evaluate this memory interval too (steps)")
    p.add_argument("--persist-every", type=int, default=None, help="evaluate this disk interval too (steps)")
    p.add_argument("--job-days", type=float, default=float(model.LLAMA3_DAYS),
                   help="job length, over which the start is paid once (default: %(default)g)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _pairs(flag: str, text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        kind, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{flag}: {item!r} is not KIND=SHARE (kinds: {', '.join(model.KINDS)}).")
        try:
            out[kind.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"{flag}: {value!r} for {kind} is not a number.") from None
    return out


def _row(job: model.Job, costs: model.Costs, args) -> dict:
    best = model.plan(job, costs, args.disk_share)
    row = {"ettr": round(best.ettr, 4), "memory_every": best.memory_every, "persist_every": best.persist_every,
           "fault_cost_s": round(best.fault_cost_s, 3), "stalled": best.stalled}
    if args.memory_every is not None or args.persist_every is not None:
        given = model.ettr(job, costs, args.memory_every, args.persist_every,
                           disk_share=args.disk_share if args.memory_every else 1.0)
        row["given_ettr"] = round(given.ettr, 4)
    return row


def run(args: argparse.Namespace) -> int:
    """Print the projection for every ``--gpus`` size."""
    detect = dict(DETECT_S, **(_pairs("--detect", args.detect) if args.detect else {}))
    mix = _pairs("--mix", args.mix) if args.mix is not None else dict(model.LLAMA3_MIX)
    recoveries = {"cold": args.cold_recovery_s}
    if args.warm_recovery_s is not None:
        recoveries["warm"] = args.warm_recovery_s
    rows = []
    for gpus in args.gpus:
        job = model.Job(gpus=gpus, failures_per_gpu_hour=args.failures_per_gpu_hour, step_s=args.step_s, mix=mix,
                        wall_s=args.job_days * 86_400.0)
        row = {"gpus": gpus, "mtbf_h": round(job.mtbf_s / 3600, 3) if math.isfinite(job.mtbf_s) else None}
        for name, recovery in recoveries.items():
            costs = model.Costs(detect_s=detect, recovery_s=recovery, start_s=args.start_s,
                                snapshot_block_s=args.snapshot_block_s, persist_block_s=args.persist_block_s)
            row[name] = _row(job, costs, args)
        rows.append(row)
    inputs = {"failures_per_gpu_hour": args.failures_per_gpu_hour, "mix": mix, "step_s": args.step_s,
              "detect_s": detect, "recovery_s": recoveries, "start_s": args.start_s,
              "snapshot_block_s": args.snapshot_block_s, "persist_block_s": args.persist_block_s,
              "disk_share": args.disk_share, "job_days": args.job_days}
    if args.json:
        print(json.dumps({"inputs": inputs, "rows": rows}, indent=1))
        return 0
    source = (" (default: Llama 3, 419 interruptions / 54 days / 16,384 GPUs)"
              if args.failures_per_gpu_hour == model.LLAMA3_FAILURES_PER_GPU_HOUR else " (given)")
    print(f"robust plan: ETTR projected (robust_plugins/plan.py); failure rate {args.failures_per_gpu_hour:.3g} "
          f"per GPU-hour{source}; step {args.step_s} s; "
          f"recovery {', '.join(f'{k} {v} s' for k, v in recoveries.items())}; start {args.start_s} s; "
          f"snapshot {args.snapshot_block_s} s, persist {args.persist_block_s} s blocking; "
          f"disk share {args.disk_share}; job {args.job_days:g} days")
    head = ["GPUs", "MTBF"]
    for name in recoveries:
        head += [f"ETTR {name}", f"{name}: memory_every", f"{name}: persist_every"]
        if "given_ettr" in rows[0][name]:
            head.append(f"ETTR {name}, given intervals")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        cells = [str(row["gpus"]), f"{row['mtbf_h']:.2f} h" if row["mtbf_h"] is not None else "no faults"]
        for name in recoveries:
            r = row[name]
            cells += [f"{r['ettr']:.3f}" + (" (stalled)" if r["stalled"] else ""), str(r["memory_every"]),
                      str(r["persist_every"])]
            if "given_ettr" in r:
                cells.append(f"{r['given_ettr']:.3f}")
        print("| " + " | ".join(cells) + " |")
    print("Intervals: Young-Daly, sqrt(2 x blocking x MTBF of the faults each level serves), in steps.")
    return 0

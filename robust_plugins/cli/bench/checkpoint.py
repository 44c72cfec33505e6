"""``robust bench checkpoint``: in-memory snapshots vs DeepSpeed's own checkpoints, one launch.

The text GPT trains on CPU ranks with ``checkpoint.memory_every: 1`` and ``peer_backup``. Reported,
each the median over steps or repeats of the slowest rank:

* the time a snapshot blocks the training loop, as a fraction of the step time (target <= 2 %): its
  part in the step plus the wait at the next optimizer step for the background copy
  (``memory_copy: background``), next to ``memory_copy: in_step`` in the same launch;
* DeepSpeed's own ``save_checkpoint`` (no plugin) and the plugin's verified, atomic save (temporary
  directory, fsync, sha256 manifest, rename), side by side, with the bytes each wrote;
* a restore from shared memory vs from the newest verified disk checkpoint (ratio).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from robust_plugins.cli._runs import format_table, human_bytes, timestamped_dir
from robust_plugins.cli.bench.writer import write_section
from robust_plugins.launch import launch_env, run_torchrun

SECTION = "checkpoint"
WORKER = "robust_plugins.cli.bench.checkpoint_worker"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``checkpoint`` under ``robust bench``."""
    p = sub.add_parser("checkpoint", help="memory snapshots vs DeepSpeed save_checkpoint; restore memory vs disk",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="CPU ranks (default 4)")
    p.add_argument("--preset", default="small", help="GPT size (default small)")
    p.add_argument("--steps", type=int, default=30, help="training steps with a snapshot each (default 30)")
    p.add_argument("--repeats", type=int, default=3, help="saves and restores of each kind (default 3)")
    p.add_argument("--out", help="results directory (default runs/bench-checkpoint-<time>)")
    p.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's rows in e.g. BENCHMARKS.md")
    p.add_argument("--timeout", type=float, default=600.0, help="hard limit for the launch, seconds")
    p.set_defaults(_bench=run_checkpoint)


def table(r: dict, command: str) -> str:
    """The markdown rows for ``results.json`` of one launch."""
    med = statistics.median
    step, block = med(r["step_s"]), med(r["blocking_s"])
    ds, ver = med(r["ds_save_s"]), med(r["verified_save_s"])
    mem, disk = med(r["restore_memory_s"]), med(r["restore_disk_s"])
    rows = [
        ["step time (median)", f"{step * 1e3:.1f} ms", ""],
        ["snapshot blocking (median)", f"{block * 1e3:.2f} ms", f"{block / step:.1%} of a step"],
    ]
    if r.get("wait_s"):
        rows.append(["of which waiting at the next optimizer step", f"{med(r['wait_s']) * 1e3:.3f} ms",
                     "for the background copy to commit (median)"])
    if r.get("in_step", {}).get("blocking_s"):
        alt_step, alt = med(r["in_step"]["step_s"]), med(r["in_step"]["blocking_s"])
        rows.append(["snapshot blocking, `memory_copy: in_step` (median)", f"{alt * 1e3:.2f} ms",
                     f"{alt / alt_step:.1%} of its step (median {alt_step * 1e3:.1f} ms); background is "
                     f"{block / alt:.2f}x its blocking"])
    rows += [
        ["DeepSpeed save_checkpoint (no plugin)", f"{ds * 1e3:.1f} ms", f"{human_bytes(r['ds_bytes'])}"],
        ["verified atomic save (plugin)", f"{ver * 1e3:.1f} ms",
         f"{human_bytes(r['verified_bytes'])}; {ver / ds:.2f}x DeepSpeed's time"],
        ["snapshot blocking vs DeepSpeed save", "", f"{block / ds:.3f}x ({ds / block:.0f}x less blocking)"],
        ["restore from memory", f"{mem * 1e3:.1f} ms", f"snapshot {human_bytes(r['snapshot_bytes'])} a rank"],
        ["restore from disk (newest verified)", f"{disk * 1e3:.1f} ms", f"memory is {disk / mem:.1f}x faster"],
    ]
    head = (f"{r['world_size']} CPU ranks (gloo), text GPT `{r['preset']}` ({r['params'] / 1e6:.2f}M parameters), "
            f"ZeRO 1, `memory_every: 1` + `peer_backup`, `memory_copy: background`"
            f"{' (and `in_step`, alternating blocks of steps in the same launch)' if r.get('in_step') else ''}; "
            f"medians of the slowest rank over {r['steps']} steps / "
            f"{len(r['ds_save_s'])} repeats; {platform.machine()}, a shared 2-core machine.  \n"
            f"Command: `{command}`  \n"
            f"Steps lost after a SIGKILL with `memory_every: 1`: 0 or 1 "
            f"(`tests/fault/test_memory_restore.py` asserts it for a random rank and step).\n")
    return head + "\n" + format_table(["what", "time", "note"], rows, markdown=True)


def run_checkpoint(args: argparse.Namespace) -> int:
    """Launch the worker, print the table, optionally write it into a markdown file."""
    out = Path(args.out) if args.out else Path("runs") / f"bench-checkpoint-{timestamped_dir('.').name}"
    out.mkdir(parents=True, exist_ok=True)
    run_torchrun(WORKER, ["--preset", args.preset, "--steps", str(args.steps), "--repeats", str(args.repeats),
                          "--out", str(out)], nproc=args.nproc, timeout_s=args.timeout,
                 env=launch_env(), log_path=out / "launch.log")
    r = json.loads((out / "results.json").read_text())
    command = (f"robust bench checkpoint --nproc {args.nproc} --preset {args.preset} --steps {args.steps} "
               f"--repeats {args.repeats}" + (f" --write {args.write}" if args.write else ""))
    body = table(r, command)
    print(body)
    if args.write:
        write_section(Path(args.write), SECTION, body, title="Checkpoints: memory snapshots vs disk")
    return 0

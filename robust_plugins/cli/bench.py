"""``robust bench <name>``: benchmarks whose numbers go into BENCHMARKS.md.

``robust bench compression`` trains the text GPT on CPU ranks in ONE launch: vanilla DeepSpeed
(no ``robust_plugins`` block), then the plugin with each codec, same seed, data and steps. For each
codec it reports gradient bytes on the wire relative to vanilla's fp32 all-reduce (counted by
``robust_plugins.comm.WireCounter``), the relative error of one compressed all-reduce of a real
gradient, the final loss relative to vanilla and the median step time relative to vanilla.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from robust_plugins.cli._runs import (
    format_table, human_bytes, recipe_config, run_plan, timestamped_dir, wire_bytes,
)
from robust_plugins.config import BLOCK_KEY, CODECS, load_json
from robust_plugins.errors import ConfigError
from robust_plugins.workloads import PRESETS

SECTION = "compression"


@dataclass(frozen=True)
class Target:
    """What a codec must reach against vanilla DeepSpeed."""

    max_bytes_ratio: float
    max_loss_delta: float
    """Largest allowed |final loss / vanilla - 1|."""


#: Design targets: blockwise-absmax int8 costs 8 bits + 32/256 for the scale (0.254x of fp32),
#: int4 4.125 bits (0.129x), sign 1.125 bits (0.035x); the margins allow for small uncompressed
#: buckets and the all-gather phase's framing.
TARGETS = {
    "int8": Target(0.27, 0.005),
    "int4": Target(0.14, 0.02),
    "sign": Target(0.04, 0.05),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``robust bench`` takes a benchmark name as a sub-command."""
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    p = sub.add_parser("compression", help="gradient compression codecs vs vanilla DeepSpeed",
                       description=__doc__)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps a run (default 100)")
    p.add_argument("--nproc", type=int, default=4, help="CPU ranks (default 4)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="GPT size (default small)")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS,
                   help=f"codecs to run (default: all: {' '.join(CODECS)})")
    p.add_argument("--out-dir", help="results directory (default runs/bench/compression/<timestamp>)")
    p.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in e.g. BENCHMARKS.md")
    p.add_argument("--strict", action="store_true", help="exit 1 when a codec misses its target")
    p.add_argument("--timeout", type=float, default=1800, help="hard limit for the launch, seconds")
    p.add_argument("--from-results", metavar="DIR",
                   help="do not train: rebuild the table from a previous run's results directory")
    p.set_defaults(_bench=run_compression)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen benchmark."""
    return args._bench(args)


def run_compression(args: argparse.Namespace) -> int:
    """Run vanilla + every codec in one launch; print (and maybe write) the table."""
    if args.from_results:
        out_dir = Path(args.from_results)
        missing = [n for n in ["vanilla", *args.codecs] if not (out_dir / f"{n}.json").is_file()]
        if missing:
            raise ConfigError(f"--from-results {out_dir}: no result files for {missing}; "
                              f"pass the directory a previous `robust bench compression` wrote, or --codecs.")
        results = {name: json.loads((out_dir / f"{name}.json").read_text()) for name in ["vanilla", *args.codecs]}
    else:
        out_dir = Path(args.out_dir) if args.out_dir else timestamped_dir("runs/bench/compression")
        results = run_compression_runs(args, out_dir)
    rows, misses = compression_rows(results, args.codecs)
    header = describe_setup(results["vanilla"])
    print()
    print(header)
    print(format_table(COLUMNS, rows))
    print(f"\nresults: {out_dir} (one JSON a run; log: {out_dir}/launch.log)")
    inactive = [c for c in args.codecs if not results[c]["plugin_active"]]
    if inactive:
        print(f"WARNING: the plugin was not active in runs {inactive}: they ran vanilla DeepSpeed and "
              f"their numbers say nothing about compression.")
    if args.write:
        van = results["vanilla"]
        command = f"robust bench compression --steps {van['steps']} --nproc {van['world_size']} --preset {van['preset']}"
        if list(args.codecs) != list(CODECS):
            command += " --codecs " + " ".join(args.codecs)
        command += f" --write {args.write}"
        text = "\n".join([
            f"Command: `{command}`  ",
            f"Date: {van.get('date', datetime.date.today().isoformat())[:10]}  ",
            f"Setup: {header}  ",
            f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
            f"torch {results['vanilla']['versions']['torch']}, deepspeed {results['vanilla']['versions']['deepspeed']}",
            "",
            format_table(COLUMNS, rows, markdown=True),
            "",
            NOTES,
        ])
        write_section(Path(args.write), SECTION, text)
        print(f"wrote the {SECTION} section of {args.write}")
    if misses:
        print("targets missed: " + "; ".join(misses))
    return 1 if misses and args.strict else 0


COLUMNS = ["codec", "grad bytes/step", "bytes vs vanilla", "one-bucket rel. error", "final loss",
           "loss vs vanilla", "step time vs vanilla", "target", "verdict"]

NOTES = (
    "Bytes are what rank 0 put on the wire during `engine.backward`, where ZeRO-1 reduces gradients "
    "(median over steps), counted by `robust_plugins.comm.WireCounter`; vanilla is DeepSpeed's fp32 "
    "all-reduce. ZeRO-1's parameter all-gather in `engine.step` is the same for every codec and not "
    "counted. "
    "One-bucket error: ||compressed - exact|| / ||exact|| for one all-reduce (average) of the first "
    "step's flattened gradient, without error feedback. Final loss: mean training loss of the last "
    "10 steps, averaged over ranks; a target's loss bound applies to |loss / vanilla - 1|. Step times on an oversubscribed CPU machine measure encoding "
    "cost, not network savings: see ../shared/HOSTS.md for a bandwidth-limited link."
)


def describe_setup(vanilla: dict[str, Any]) -> str:
    """One line: ranks, model, steps, engine."""
    return (f"{vanilla['world_size']} CPU ranks (gloo), {vanilla['preset']} byte-level GPT "
            f"({vanilla['n_params'] / 1e6:.2f}M params) on stdlib text, {vanilla['steps']} steps, "
            f"micro-batch {vanilla['micro_batch']}, ZeRO-{vanilla['zero_stage']}, "
            f"{vanilla['dtype'].replace('torch.', '')}, seed {vanilla['seed']}")


def compression_rows(results: dict[str, dict[str, Any]], codecs: list[str]) -> tuple[list[list[str]], list[str]]:
    """Table rows (vanilla first) and a list of missed targets, from the runs' result dicts."""
    van = results["vanilla"]
    van_bytes, van_loss, van_time = wire_bytes(van), van["final_loss_last10"], van["median_step_time_s"]
    rows = [["vanilla (fp32)", human_bytes(van_bytes), "1.000x", "-", f"{van_loss:.4f}", "0.00 %", "1.00x", "", ""]]
    misses = []
    for codec in codecs:
        r = results[codec]
        b = wire_bytes(r)
        ratio = b / van_bytes if b is not None and van_bytes else None
        delta = r["final_loss_last10"] / van_loss - 1
        err = (r.get("codec_error") or {}).get("rel_error")
        target, verdict = "", ""
        if codec == "none":
            same = r["param_sha256"] == van["param_sha256"]
            target, verdict = "bitwise = vanilla", "ok" if same else "MISS"
            if not same:
                misses.append("none: final parameters differ from vanilla")
        elif codec in TARGETS:
            t = TARGETS[codec]
            target = f"<= {t.max_bytes_ratio:.2f}x, loss within {t.max_loss_delta * 100:g} %"
            failed = []
            if ratio is None or ratio > t.max_bytes_ratio:
                failed.append("bytes")
            if abs(delta) > t.max_loss_delta:
                failed.append("loss")
            verdict = "ok" if not failed else "MISS (" + ", ".join(failed) + ")"
            if failed:
                misses.append(f"{codec}: {', '.join(failed)}")
        rows.append([
            codec, human_bytes(b), f"{ratio:.3f}x" if ratio is not None else "n/a",
            f"{err:.2e}" if err is not None else "n/a", f"{r['final_loss_last10']:.4f}",
            f"{delta * 100:+.2f} %", f"{r['median_step_time_s'] / van_time:.2f}x", target, verdict,
        ])
    return rows, misses


def run_compression_runs(args: argparse.Namespace, out_dir: Path) -> dict[str, dict[str, Any]]:
    """Write one config a codec (the recipe's plugin block with the codec swapped) and run them all."""
    cfg_dir = out_dir / "configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    baseline = load_json(recipe_config("baseline.json"))
    block = load_json(recipe_config("plugin.json")).get(BLOCK_KEY)
    if not block or "compression" not in block:
        raise ConfigError(f"{recipe_config('plugin.json')} has no {BLOCK_KEY}.compression block to vary.")
    runs = [{"name": "vanilla", "config": _write_config(cfg_dir / "vanilla.json", baseline)}]
    for codec in args.codecs:
        cfg = {**baseline, BLOCK_KEY: {**block, "compression": {**block["compression"], "codec": codec}}}
        runs.append({"name": codec, "config": _write_config(cfg_dir / f"{codec}.json", cfg), "codec_error": True})
    return run_plan(runs, out_dir, nproc=args.nproc, preset=args.preset, steps=args.steps,
                    timeout_s=args.timeout)


def _write_config(path: Path, cfg: dict[str, Any]) -> str:
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return str(path.resolve())


def write_section(path: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``.

    The markers stay; a missing file is created with a title, a missing section is appended.
    """
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    i, j = text.find(start), text.find(end)
    if (i < 0) != (j < 0) or (i >= 0 and j < i):
        raise ConfigError(f"{path}: found only one of the markers {start} / {end} (or out of order); "
                          f"fix the file by hand.")
    if i >= 0:
        text = text[:i] + block + text[j + len(end):]
    else:
        text = text.rstrip("\n") + f"\n\n## Gradient compression\n\n{block}\n"
    path.write_text(text)

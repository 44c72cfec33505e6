"""``robust bench comm``: all-reduce methods side by side on a simulated multi-node cluster.

Builds one :class:`~robust_plugins.sim.SimCluster` (``--sim-nodes`` x ``--ranks-per-node`` gloo
ranks, inter-node links limited with ``tc tbf``), then for each ``--rates`` value sets the link
rate and launches :mod:`robust_plugins.cli.bench.comm_worker` once, which times every method on
the same ``--mbytes`` MB fp32 bucket: flat fp32 ``all_reduce`` (the baseline), flat bf16 (what
DeepSpeed's ``communication_data_type: bf16`` sends), the flat two-phase int8/int4 all-reduce,
the hierarchical all-reduce with an fp32/int8/int4 rail step, and the ``auto`` codec. It reports
the median of ``--repeats`` timed calls per method and rate, the speed-up over flat fp32 at that
rate, and each method's relative error against flat fp32. Needs root and iproute2 (exits 2 and
says which is missing otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from robust_plugins.cli.bench import comm_worker, step_worker
from robust_plugins.cli.bench.writer import write_section

SECTION = "comm"
TITLE = "All-reduce on a simulated multi-node cluster"
TRAIN_SECTION = "comm-train"
TRAIN_TITLE = "Training steps on a simulated multi-node cluster"

TRAIN_NOTES = (
    "Each method trains the same GPT (same seed, same batches, AdamW lr 3e-3) for the given steps; "
    "step time is the median over the steps after the first two (of every round, with --train-rounds: "
    "each round trains every method afresh, in alternating order; barrier to barrier on rank 0: "
    "forward, backward with the gradient communication, optimizer step; `auto` runs its trial "
    "reductions in the first step, after backward); val loss is the held-out loss after the last step "
    "(8 fixed windows per rank; first round). `auto chose` lists the routes `auto` chose (a round "
    "that chose differently follows 'another round:') and, where it handed the step back to DeepSpeed's "
    "own single bucket, that bucket's wire (`deepspeed`: its fp32 all-reduce; `bf16`: its bf16 scheme, "
    "timed against fp32 on the step's gradient). `ddp` rows are PyTorch DistributedDataParallel over gloo (its own fp32 "
    "all-reduce, `fp16_compress_hook`, `powerSGD_hook` at rank 4 from iteration 2); "
    "`bf16_compress_hook` needs CUDA/NCCL. `ds` rows are DeepSpeed ZeRO-0 engines with "
    "`gradient_clipping: 0` (DeepSpeed 0.19 clips at 1.0 by default, DDP does not; so both hosts train "
    "the same math): `ds fp32` its default all-reduce, `ds bf16` its `communication_data_type: bf16`, "
    "the others this package's `robust_plugins` block (compression codec; `hier`: topology.hierarchical; "
    "`ds hier auto`: codec auto, which then also chooses flat or hierarchical), reducing in 4 MB buckets "
    "(`compression.bucket_mb`) each started during backward (`compression.overlap`, the default); "
    "`ds hier auto no-overlap` reduces the same buckets after backward. `ddp powerSGD_hook` runs in a launch "
    "of its own, bounded by --psgd-timeout: a hang there is reported in the table, not waited out."
)

#: Rates at or below this are judged by the slow-link targets, at or above FAST_MIN_BITS by the
#: fast-link ones, so one --rates value is judged only by the targets of its own kind.
SLOW_MAX_BITS = 1e9
FAST_MIN_BITS = 5e9

NOTES = (
    "Each number is the median of the timed calls of one method on one bucket, from a barrier "
    "before the call to a barrier after it, on rank 0; every method first runs once untimed. "
    "vs flat fp32 is flat fp32's median divided by the method's (above 1: faster). rel. error is "
    "||result - flat fp32 result|| / ||flat fp32 result|| of the first call (no error feedback yet), the "
    "largest over the rates (auto's choice differs by rate); "
    "hier fp32 differs from flat fp32 only by the order of the fp32 additions. The simulator's "
    "inter-node links are veth pairs between network namespaces with `tc tbf` on both ends; ranks "
    "of one node talk over loopback. All ranks share the machine's CPU cores (with other jobs: "
    "see the load average), so encode cost weighs more here than on real nodes. `auto` chooses a route "
    "(`hier auto`: flat or hierarchical, and the codec; `flat auto`: the codec) by timing the candidate "
    "routes its cost model does not rule out on the first (untimed) call; `auto chose` names the route. "
    "`flat bf16` here is DeepSpeed's `communication_data_type: bf16` (a bf16 all-reduce, bf16 sums, no "
    "error feedback); `auto`'s candidates are `bf16` (the two-phase codec, fp32 sums) and "
    "`bf16_allreduce` (this bf16 all-reduce with error feedback of the cast, flat only). A route that "
    "chose `flat none` runs the same collective as flat fp32; a 10-15 % "
    "difference on shared cores is within this machine's run-to-run spread (flat fp32 itself measured "
    "110-175 ms at 10gbit across runs)."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``comm`` under ``robust bench``."""
    p = sub.add_parser("comm", help="all-reduce methods on a simulated multi-node cluster (needs root)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim-nodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="gloo ranks per node (default 2)")
    p.add_argument("--rates", nargs="+", default=["10gbit", "200mbit"],
                   help="inter-node link rates to measure, e.g. 10gbit 200mbit (the default)")
    p.add_argument("--mbytes", type=float, default=64.0, help="fp32 bucket size in MB (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per method and rate (default 3)")
    p.add_argument("--methods", nargs="+", default=list(comm_worker.METHODS), choices=comm_worker.METHODS)
    p.add_argument("--timeout", type=float, default=300.0, help="bound on each launch, seconds (default 300)")
    p.add_argument("--train-steps", type=int,
                   help="instead of one bucket: train the text GPT under DDP for N steps per method "
                        "(bench.step_worker; section comm-train; --methods and --mbytes do not apply)")
    p.add_argument("--train-methods", nargs="+", metavar="METHOD",
                   help="with --train-steps: the methods to train (default: every ddp and ds method; "
                        "see bench.step_worker.METHODS)")
    p.add_argument("--train-rounds", type=int, default=1,
                   help="with --train-steps: train every method this many times in one launch, in alternating "
                        "order, fresh engines each time; a method's median is over all rounds' steps (default 1)")
    p.add_argument("--psgd-timeout", type=float, default=120.0,
                   help="with --train-steps: bound on the separate powerSGD_hook launch, seconds (default "
                        "120; 0 skips it)")
    p.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    p.add_argument("--from-json", metavar="PATH",
                   help="do not measure: render the table from a JSON file an earlier run wrote with --json "
                        "(give the same other flags, so the command shown is the measuring one)")
    p.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in e.g. BENCHMARKS.md")
    p.set_defaults(_bench=run_comm)


def run_comm(args: argparse.Namespace) -> int:
    """Measure, print the table, optionally write it."""
    from robust_plugins.errors import ConfigError
    from robust_plugins.sim import SimCluster, parse_rate, require_netns

    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        if set(saved.get("results", {})) != set(args.rates):
            raise ConfigError(f"--from-json {args.from_json} holds rates {sorted(saved.get('results', {}))}, "
                              f"not --rates {args.rates}; pass the flags of the run that wrote it.")
        results, meta = saved["results"], saved["meta"]
    else:
        require_netns()
        if args.repeats < 1 or args.mbytes <= 0:
            raise ConfigError(f"--repeats ({args.repeats}) must be >= 1 and --mbytes ({args.mbytes}) > 0.")
        rates = [parse_rate(r) for r in args.rates]
        results = {}
        psgd = None
        env = None
        if args.train_steps:
            methods = list(args.train_methods or step_worker.DEFAULT_METHODS)
            bad = [m for m in methods if m not in step_worker.METHODS]
            if bad:
                raise ConfigError(f"--train-methods {bad}: allowed are {', '.join(step_worker.METHODS)}.")
            if "ddp powerSGD_hook" in methods:
                methods.remove("ddp powerSGD_hook")
            if args.psgd_timeout > 0 and not args.train_methods:
                psgd = "ddp powerSGD_hook"
            if args.train_methods and "ddp powerSGD_hook" in args.train_methods:
                psgd = "ddp powerSGD_hook"
            step = [sys.executable, "-m", step_worker.__name__, "--steps", str(args.train_steps)]
            if args.train_rounds < 1:
                raise ConfigError(f"--train-rounds {args.train_rounds}: must be >= 1.")
            argv = step + ["--timeout", str(args.timeout), "--rounds", str(args.train_rounds), "--methods", *methods]
            env = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed rows: CPU accelerator, gloo
        else:
            argv = [sys.executable, "-m", comm_worker.__name__, "--mbytes", str(args.mbytes),
                    "--repeats", str(args.repeats), "--timeout", str(args.timeout), "--methods", *args.methods]
        with SimCluster(args.sim_nodes, args.ranks_per_node, rates[0]) as cluster:
            for text, bits in zip(args.rates, rates):
                cluster.set_rate(bits)
                results[text] = {"methods": {}}
                if not args.train_steps or methods:
                    ranks = cluster.run(argv, timeout_s=args.timeout, env=env)
                    results[text] = json.loads(ranks[0].stdout.strip().splitlines()[-1])
                if psgd:
                    results[text]["methods"][psgd] = _bounded_psgd(cluster, step, args.psgd_timeout, env)
        meta = {"date": datetime.date.today().isoformat(),
                "loadavg": ", ".join(f"{v:.1f}" for v in os.getloadavg())}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    body = render_train(args, results, meta) if args.train_steps else render(args, results, meta)
    print(body)
    if args.write:
        section, title = (TRAIN_SECTION, TRAIN_TITLE) if args.train_steps else (SECTION, TITLE)
        write_section(Path(args.write), section, body, title=title)
        print(f"wrote section {section!r} of {args.write}")
    return 0


def _bounded_psgd(cluster, step_argv: list[str], timeout_s: float, env) -> dict:
    """Train ``ddp powerSGD_hook`` in a launch of its own, bounded: its result, or why there is none.

    It can hang on gloo; its gloo timeout is the bound too, so a hung collective raises inside
    the ranks and the simulator kills what is left."""
    from robust_plugins.sim import SimError

    argv = step_argv + ["--timeout", f"{timeout_s:g}", "--methods", "ddp powerSGD_hook"]
    try:
        ranks = cluster.run(argv, timeout_s=timeout_s + 30, env=env)
    except SimError as exc:
        first = str(exc).strip().splitlines()[0]
        return {"failed": f"hung or failed within the {timeout_s:g} s bound ({first[:160]})"}
    return json.loads(ranks[0].stdout.strip().splitlines()[-1])["methods"]["ddp powerSGD_hook"]


def link_kind(rate: str) -> str | None:
    """``slow`` (<= 1 Gbit/s), ``fast`` (>= 5 Gbit/s) or ``None``: which targets judge a rate."""
    from robust_plugins.sim import parse_rate

    bits = parse_rate(rate)
    return "slow" if bits <= SLOW_MAX_BITS else "fast" if bits >= FAST_MIN_BITS else None


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces a run with these arguments."""
    if getattr(args, "train_steps", None):
        methods = getattr(args, "train_methods", None)
        psgd = getattr(args, "psgd_timeout", 120.0)
        return (f"robust bench comm --sim-nodes {args.sim_nodes} --ranks-per-node {args.ranks_per_node} "
                f"--rates {' '.join(args.rates)} --train-steps {args.train_steps}"
                + (f" --train-rounds {args.train_rounds}" if getattr(args, "train_rounds", 1) != 1 else "")
                + (f" --train-methods {' '.join(repr(m) for m in methods)}" if methods else "")
                + (f" --psgd-timeout {psgd:g}" if psgd != 120.0 else "")
                + (f" --write {args.write}" if args.write else ""))
    return (f"robust bench comm --sim-nodes {args.sim_nodes} --ranks-per-node {args.ranks_per_node} "
            f"--rates {' '.join(args.rates)} --mbytes {args.mbytes:g} --repeats {args.repeats}"
            + (f" --methods {' '.join(repr(m) for m in args.methods)}" if args.methods != _default_methods() else "")
            + (f" --write {args.write}" if args.write else ""))


def _default_methods() -> list[str]:
    return list(comm_worker.METHODS)


def rows(results: dict[str, Any], methods: Sequence[str]) -> list[list[str]]:
    """One row per method: median ms, speed-up over flat fp32 at each rate, and the relative error."""
    out = []
    for name in methods:
        row = [name]
        for res in results.values():
            m = res["methods"].get(name)
            if m is None:
                row += ["-", "-"]
                continue
            med = statistics.median(m["times_s"])
            base = statistics.median(res["methods"]["flat fp32"]["times_s"]) if "flat fp32" in res["methods"] else None
            row += [f"{med * 1e3:.0f}", f"{base / med:.2f}x" if base else "-"]
        errors = [r["methods"][name]["rel_error"] for r in results.values() if name in r["methods"]]
        row.append(f"{max(errors):.1e}" if errors else "-")
        note = [str(r["methods"][name]["choice"]) for r in results.values()
                if name in r["methods"] and "choice" in r["methods"][name]]
        row.append(", ".join(note))
        out.append(row)
    return out


def _median(results: dict[str, Any], rate: str, method: str) -> float | None:
    m = results[rate]["methods"].get(method)
    return statistics.median(m["times_s"]) if m else None


def target_rows(results: dict[str, Any]) -> list[list[str]]:
    """The issue's targets, checked against the measured medians: (target, measured, verdict)."""
    out = []
    for rate in results:
        kind = link_kind(rate)
        if kind == "slow":
            out += _slow_targets(results, rate)
        elif kind == "fast":
            out += _fast_targets(results, rate)
    hier = [r["methods"]["hier fp32"]["rel_error"] for r in results.values() if "hier fp32" in r["methods"]]
    if hier:
        out.append(["hier fp32 equals flat fp32 up to summation order", f"rel. error {max(hier):.1e}",
                    "ok" if max(hier) < 1e-6 else "MISS"])
    return out


def _slow_targets(results: dict[str, Any], slow: str) -> list[list[str]]:
    out = []

    def speedup(target: str, rate: str, method: str, base: str, need: float) -> None:
        a, b = _median(results, rate, method), _median(results, rate, base)
        if a is None or b is None:
            out.append([target, "not measured", "-"])
        else:
            out.append([target, f"{b / a:.2f}x", "ok" if b / a >= need else "MISS"])

    speedup(f"{slow}: hier int8 >= 2.5x flat fp32", slow, "hier int8", "flat fp32", 2.5)
    speedup(f"{slow}: hier int8 >= 1.4x flat bf16", slow, "hier int8", "flat bf16", 1.4)
    speedup(f"{slow}: hier int4 >= 3x flat fp32", slow, "hier int4", "flat fp32", 3.0)
    for auto in ("flat auto", "hier auto"):
        m = results[slow]["methods"].get(auto)
        if m is not None:
            a, b = _median(results, slow, auto), _median(results, slow, "flat fp32")
            ok = m.get("choice") not in (None, "none") and b is not None and a < b
            out.append([f"{slow}: {auto} picks a compressed codec and beats flat fp32",
                        f"chose {m.get('choice')}, {b / a:.2f}x" if b else f"chose {m.get('choice')}",
                        "ok" if ok else "MISS"])
    return out


def _fast_targets(results: dict[str, Any], fast: str) -> list[list[str]]:
    out = []
    fixed = {k: _median(results, fast, k) for k in results[fast]["methods"] if not k.endswith("auto")}
    if fixed:
        best = min(fixed, key=fixed.get)
        for auto in ("flat auto", "hier auto"):
            a = _median(results, fast, auto)
            if a is not None:
                out.append([f"{fast}: {auto} within 5 % of the fastest fixed method ({best})",
                            f"chose {results[fast]['methods'][auto].get('choice')}, {a / fixed[best]:.2f}x its time",
                            "ok" if a <= 1.05 * fixed[best] else "MISS"])
    return out


def render(args: argparse.Namespace, results: dict[str, Any], meta: dict[str, str] | None = None) -> str:
    """Markdown: command, setup, the table, the targets and the notes."""
    import torch

    meta = meta or {"date": datetime.date.today().isoformat(),
                    "loadavg": ", ".join(f"{v:.1f}" for v in os.getloadavg())}
    load = meta["loadavg"]
    head = ["method"]
    for rate in results:
        head += [f"{rate} ms", f"{rate} vs flat fp32"]
    head += ["rel. error", "auto chose (per rate)"]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table += ["| " + " | ".join(r) + " |" for r in rows(results, args.methods)]
    return "\n".join([
        f"Command: `{command_line(args)}` (as root)  ",
        f"Date: {meta['date']}  ",
        f"Setup: {args.sim_nodes} simulated nodes x {args.ranks_per_node} gloo ranks, one {args.mbytes:g} MB fp32 "
        f"bucket, median of {args.repeats} calls, block size 256, error feedback on  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared by all ranks (load average {load} at the "
        f"end), Python {platform.python_version()}, torch {torch.__version__}",
        "",
        *table,
        "",
        "Targets, from the medians above:",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
        *["| " + " | ".join(r) + " |" for r in target_rows(results)],
        "",
        NOTES,
    ])


def train_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per method: median step ms, speed-up over DDP fp32, val loss, at each rate; auto's
    choice. A method that hung or failed (``powerSGD_hook``) says so in its cells."""
    methods = list(dict.fromkeys(m for r in results.values() for m in r["methods"]))
    out = []
    for name in methods:
        row = [name]
        for res in results.values():
            m = res["methods"].get(name)
            if m is None or "failed" in m:
                row += [m["failed"] if m else "not run", "-", "-"]
                continue
            med = statistics.median(m["times_s"])
            base = res["methods"].get("ddp fp32")
            row += [f"{med * 1e3:.0f}", f"{statistics.median(base['times_s']) / med:.2f}x" if base else "-",
                    f"{m['val_loss']:.4f}"]
        # Per rate (named when there are several); rounds that chose differently follow "; another
        # round:" (the worker separates them with " | ", which would split a Markdown cell).
        chosen = [(rate, _choice(r["methods"][name])) for rate, r in results.items()
                  if "choice" in r["methods"].get(name, {})]
        row.append(" ".join(f"{rate}: {c}." for rate, c in chosen) if len(chosen) > 1
                   else (chosen[0][1] if chosen else ""))
        out.append(row)
    return out


def _choice(method: dict[str, Any]) -> str:
    """``auto``'s choice as table text: rounds that chose differently follow "; another round:"."""
    return str(method.get("choice")).replace(" | ", "; another round: ")


def _ok_times(methods: dict[str, Any]) -> dict[str, float]:
    return {k: statistics.median(v["times_s"]) for k, v in methods.items() if "times_s" in v}


def train_target_rows(results: dict[str, Any]) -> list[list[str]]:
    """The training-step targets for ``auto`` (``ds hier auto``, else ``plugin hier auto``):
    on a slow link >= 1.3x faster than DDP's fp16_compress_hook at no worse val loss; on a fast link
    within 5 % of the fastest fixed method, of its own host and of all."""
    out = []
    for rate, res in results.items():
        kind = link_kind(rate)
        ms = res["methods"]
        times = _ok_times(ms)
        auto = next((a for a in ("ds hier auto", "plugin hier auto") if a in times), None)
        if auto is None or kind is None:
            continue
        a = times[auto]
        if kind == "slow" and "ddp fp16_compress_hook" in times:
            f = ms["ddp fp16_compress_hook"]
            ratio = times["ddp fp16_compress_hook"] / a
            loss = ms[auto]["val_loss"] / f["val_loss"] - 1
            ok = ratio >= 1.3 and loss <= 0.005
            out.append([f"{rate}: {auto} >= 1.3x faster than fp16_compress_hook, val loss no worse (+0.5 %)",
                        f"{ratio:.2f}x, val loss {loss:+.2%}", "ok" if ok else "MISS"])
            own = "ds fp32" if auto.startswith("ds ") else "ddp fp32"
            if own in times and own != "ddp fp32":
                # DeepSpeed and DDP engines do not train identically even uncompressed: the loss
                # against the host's own fp32 run separates the codec's cost from the host's.
                own_loss = ms[auto]["val_loss"] / ms[own]["val_loss"] - 1
                out.append([f"{rate}: {auto} val loss vs its host's fp32 ({own}; context, not a target)",
                            f"{own_loss:+.2%} ({own} itself: {ms[own]['val_loss'] / f['val_loss'] - 1:+.2%} vs "
                            f"fp16_compress_hook)", "-"])
        if kind == "fast":
            # The plugin rows are DDP comm hooks: their host is DDP.
            hosts = ("ds",) if auto.startswith("ds ") else ("ddp", "plugin")
            fixed = {k: t for k, t in times.items() if " auto" not in k}  # "ds hier auto no-overlap" too
            pools = [(f"the fastest fixed {hosts[0]} method", {k: t for k, t in fixed.items() if k.split()[0] in hosts}),
                     ("the fastest fixed method", fixed)]
            seen = set()
            for what, pool in pools:
                if not pool:
                    continue
                best = min(pool, key=pool.get)
                if best in seen:
                    continue
                seen.add(best)
                out.append([f"{rate}: {auto} within 5 % of {what} ({best})",
                            f"chose {_choice(ms[auto])}, {a / pool[best]:.2f}x its time",
                            "ok" if a <= 1.05 * pool[best] else "MISS"])
    return out


def render_train(args: argparse.Namespace, results: dict[str, Any], meta: dict[str, str]) -> str:
    """Markdown of the training-step benchmark."""
    import torch

    params = next((m["params"] for r in results.values() for m in r["methods"].values() if "params" in m), 0)
    head = ["method"]
    for rate in results:
        head += [f"{rate} ms/step", f"{rate} vs ddp fp32", f"{rate} val loss"]
    head.append("auto chose (per rate)")
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table += ["| " + " | ".join(r) + " |" for r in train_rows(results)]
    return "\n".join([
        f"Command: `{command_line(args)}` (as root)  ",
        f"Date: {meta['date']}  ",
        f"Setup: {args.sim_nodes} simulated nodes x {args.ranks_per_node} gloo ranks, byte-level GPT with "
        f"{params / 1e6:.1f}M parameters (2 layers, width 512, 64-token windows, micro-batch 2 per rank), "
        f"{args.train_steps} steps per method"
        + (f" in each of {args.train_rounds} rounds (alternating order, fresh engines)"
           if getattr(args, "train_rounds", 1) != 1 else "") + ", AdamW  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared by all ranks (load average "
        f"{meta['loadavg']} at the end), Python {platform.python_version()}, torch {torch.__version__}",
        "",
        *table,
        "",
        "Targets, from the medians above:",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
        *["| " + " | ".join(r) + " |" for r in train_target_rows(results)],
        "",
        TRAIN_NOTES,
    ])

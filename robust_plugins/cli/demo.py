"""``robust demo``: vanilla DeepSpeed against DeepSpeed with robust_plugins, faults included.

Two jobs of the deepspeed_gpt recipe on CPU ranks, same seed and data:

1. **comparison** on a simulated 2-node cluster (``robust_plugins.sim``: one network namespace per
   node, ``--link-rate`` between them; as root, else loopback on this machine, said on screen):
   ``baseline`` (``baseline.json``, plain DeepSpeed plus only the ``telemetry`` block, which does
   not change training) and ``plugin`` (``plugin.json``, int8 compressed gradients) in one launch;
2. **faults**: the plugin again under ``robust run`` with a crash, a hang and a NaN injected, and
   the recovery the product gives by default: an in-memory snapshot every step (plus a copy on
   the other node, and a verified disk checkpoint every :data:`PERSIST_EVERY` steps), warm
   standbys, and the resume inside ``deepspeed.initialize`` (the recipe loads nothing itself).
   ``robust run`` detects each fault, restarts the ranks from standbys, and each fault costs at
   most one step of rework. On the simulator it runs as a real multi-node
   job: one ``robust run`` agent per simulated node, c10d rendezvous at node 0's address, each
   node its own run directory (``plugin-faults/node<i>``); the faults are read from the job-wide
   view (``job_faults.jsonl``), which names each fault once, on the node that caused it.

While they run, progress bars are drawn from the runs' own telemetry files and fault log. At the
end: the comparison table, the fault job's summary and the path of the HTML report
(``robust report``) of all three runs; the W&B runs (offline) are in one project and group.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from robust_plugins.cli._runs import RECIPE_MODULE, format_table, human_bytes, recipe_config, timestamped_dir
from robust_plugins.config import load_json
from robust_plugins.errors import RobustPluginsError
from robust_plugins.watchdog.faults import fault_view_path
from robust_plugins.workloads import PRESETS

#: Telemetry window of the demo: the progress bar moves every this many steps.
LOG_EVERY = 5
#: Verified disk checkpoints of the fault job (it recovers from its in-memory snapshots, taken
#: every step; the disk checkpoints outlive the job).
PERSIST_EVERY = 50
#: The fault job's hang timeout floor (``--watchdog hang_min_timeout_s``): the learned timeout is
#: 10x the p99 step time (tiny steps take ~0.1 s), never below this. It also bounds a restarted
#: incarnation's start (hand-off, process group, restore, first step; about 2 s here): room for
#: a loaded machine, since a false hang blames a node and the second blame excludes it.
HANG_MIN_TIMEOUT_S = 5
#: The fault job's c10d rendezvous port on node 0 (each simulated node is a fresh network
#: namespace: nothing else listens there).
RDZV_PORT = 29400


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``robust demo``."""
    # tiny GPT, 4 ranks, 300 steps: both jobs, three restarts included, take a few minutes on 2 cores.
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps a run (default 300)")
    parser.add_argument("--nproc", type=int, default=4, help="CPU ranks (default 4)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="GPT size (default tiny)")
    parser.add_argument("--faults", default="crash,hang,nan",
                        help="faults injected into the plugin job, comma-separated from crash, hang, nan; "
                             "'none' for none (default crash,hang,nan)")
    parser.add_argument("--cluster", choices=("auto", "sim", "loopback"), default="auto",
                        help="where the comparison runs: the network-namespace simulator (2 nodes, needs "
                             "root), loopback, or auto: the simulator when it can run (default auto)")
    parser.add_argument("--link-rate", default="100mbit",
                        help="simulated link rate between the 2 nodes (default 100mbit)")
    parser.add_argument("--out-dir", help="results directory (default runs/demo/<timestamp>)")
    parser.add_argument("--timeout", type=float, default=600, help="hard limit for each job, seconds (default 600)")


def plan_faults(kinds: str, steps: int, nproc: int) -> list[str]:
    """``--inject`` specs spreading the faults over the run, each on another rank, after the
    hang warm-up."""
    names = [k.strip() for k in kinds.split(",") if k.strip()]
    if names == ["none"]:
        return []
    spec = {"crash": "kill", "hang": "hang", "nan": "nan"}
    bad = [n for n in names if n not in spec]
    if bad:
        raise RobustPluginsError(f"--faults: unknown fault(s) {bad}; allowed: crash, hang, nan (or none).")
    if steps < 20 * (len(names) + 1):
        raise RobustPluginsError(f"--steps {steps} is too short for {len(names)} fault(s): use at least "
                                 f"{20 * (len(names) + 1)} (faults need the hang warm-up and checkpoints).")
    out = []
    for i, name in enumerate(names):
        # Evenly spaced, never on a disk checkpoint's step (recovery comes from memory).
        step = (steps * (i + 1) // (len(names) + 1)) // 10 * 10 + 5
        out.append(f"{spec[name]}:rank={(i + 1) % nproc},step={step}")
    return out


def _write_config(src: str, dest: Path, blocks: dict[str, Any]) -> Path:
    cfg = load_json(recipe_config(src))
    cfg.setdefault("robust_plugins", {}).update(blocks)
    dest.write_text(json.dumps(cfg, indent=1) + "\n")
    return dest


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete records of a JSONL file another process is appending to ([] if absent)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the line being written
    return out


class Progress:
    """One progress line per job, drawn from ``<run-dir>/telemetry/metrics.jsonl`` and the job's
    faults (``watchdog.faults.fault_view_path``; on a terminal the line is redrawn; otherwise a line per
    change)."""

    WIDTH = 30

    def __init__(self, name: str, run_dir: Path, steps: int, telemetry_dir: Path | None = None) -> None:
        self.name, self.run_dir, self.steps = name, run_dir, steps
        self.telemetry_dir = telemetry_dir or run_dir / "telemetry"
        self.tty = sys.stdout.isatty()
        self.shown_faults = 0
        self.last = ""
        self.last_state: tuple | None = None

    def _records(self) -> list[dict[str, Any]]:
        return _read_jsonl(self.telemetry_dir / "metrics.jsonl")

    def update(self, t0: float) -> None:
        """Redraw from the files now."""
        recs = self._records()
        steps = [r for r in recs if r.get("kind") == "step"]
        step = steps[-1]["step"] if steps else 0
        loss = steps[-1].get("loss") if steps else None
        faults = self._faults()
        for f in faults[self.shown_faults:]:
            self._print_fault(f)
        self.shown_faults = len(faults)
        done = int(self.WIDTH * min(step, self.steps) / self.steps)
        bar = "#" * done + "." * (self.WIDTH - done)
        what = "starting" if not recs else ("loss n/a" if loss is None else f"loss {loss:.3f}")
        line = (f"  {self.name:<8} [{bar}] {step:>4}/{self.steps}  {what:<12} "
                f"{len(faults)} fault(s)  {time.monotonic() - t0:5.0f} s")
        state = (bool(recs), step, len(faults))
        if self.tty and line != self.last:
            print("\r" + line, end="", flush=True)
        elif not self.tty and state != self.last_state:  # a log file gets a line per change of step
            print(line, flush=True)
        self.last, self.last_state = line, state

    def started(self) -> bool:
        """True once the run wrote its first telemetry record."""
        return (self.telemetry_dir / "metrics.jsonl").is_file()

    def _faults(self) -> list[dict[str, Any]]:
        return _read_jsonl(fault_view_path(self.run_dir))

    def _print_fault(self, f: dict[str, Any]) -> None:
        where = f" (node {f['node']})" if f.get("node") else ""
        msg = (f"  ! {f.get('kind')} at step {f.get('step')} on rank(s) {f.get('suspect_ranks')}{where}: detected after "
               f"{f.get('detected_after_s') or 0:.1f} s, action {f.get('action')}, resumed at step "
               f"{f.get('resumed_at_step')} ({f.get('lost_steps')} steps redone)")
        print(("\n" if self.tty and self.last else "") + msg, flush=True)
        self.last = ""

    def finish(self, t0: float) -> None:
        """Final redraw and newline."""
        self.update(t0)
        if self.tty:
            print(flush=True)


def fault_job_argv(args: argparse.Namespace, run_dir: Path, inject: list[str], recipe: list[str],
                   addrs: list[str] | None = None) -> list[list[str]]:
    """The fault job's ``robust run`` command lines: one ``--standalone`` job on this machine
    (``addrs`` None), else one agent per simulated node at ``addrs[i]``, c10d rendezvous on node
    0's address, each node its own run directory ``run_dir/node<i>``."""
    common = ["--max-restarts", str(len(inject) + 1),
              "--watchdog", f"hang_min_timeout_s={HANG_MIN_TIMEOUT_S}", "--watchdog", "hang_initial_timeout_s=300",
              # Every rank of the demo shares the same 2-4 cores, so a starved rank now and then
              # computes 2x slower than its peers: a straggler report there says nothing about the
              # job. The straggler detector is tested on its own (tests/fault/test_straggler.py).
              "--watchdog", "straggler_factor=0",
              # Every node gets every injection: each fires only in the rank it names.
              *[a for spec in inject for a in ("--inject", spec)], "-m", RECIPE_MODULE, *recipe]
    run = [sys.executable, "-m", "robust_plugins.cli.main", "run"]
    if addrs is None:
        return [[*run, "--standalone", "--nproc-per-node", str(args.nproc), "--run-dir", str(run_dir), *common]]
    return [[*run, "--nnodes", str(len(addrs)), "--nproc-per-node", str(args.nproc // len(addrs)),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addrs[0]}:{RDZV_PORT}", "--rdzv-id", "demo-faults",
             "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}", "--local-addr", addr,
             "--run-dir", str(run_dir / f"node{i}"), *common]
            for i, addr in enumerate(addrs)]


def run_job(name: str, plan: Path, out_dir: Path, run_dir: Path, args: argparse.Namespace,
            inject: list[str], cluster: Any = None) -> dict[str, Any]:
    """One ``robust run`` job with a progress bar (one agent per node of ``cluster``, a
    :class:`~robust_plugins.sim.SimCluster`, else one on this machine); returns the recipe's
    result for ``name``."""
    from robust_plugins.launch import _kill_group, launch_env

    recipe = ["--plan", str(plan), "--out-dir", str(out_dir), "--steps", str(args.steps),
              "--preset", args.preset, "--log-every", "0"]
    addrs = None if cluster is None else [cluster.node_addr(i) for i in range(cluster.nodes)]
    cmds = fault_job_argv(args, run_dir, inject, recipe, addrs)
    logs = [out_dir / (f"{name}.log" if len(cmds) == 1 else f"{name}.node{i}.log") for i in range(len(cmds))]
    # Node 0's run directory holds the job-wide fault view (every node's does); telemetry goes to
    # one directory whichever node runs rank 0.
    progress = Progress(name, run_dir if addrs is None else run_dir / "node0", args.steps,
                        telemetry_dir=run_dir / "telemetry")
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    files = [open(log, "wb") for log in logs]
    try:
        for i, (cmd, out) in enumerate(zip(cmds, files)):
            kw = dict(stdout=out, stderr=subprocess.STDOUT)
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=launch_env(), start_new_session=True, **kw)
                         if cluster is None else cluster.spawn(i, cmd, env=launch_env(), **kw))
        while any(p.poll() is None for p in procs):
            if time.monotonic() - t0 > args.timeout:
                raise RobustPluginsError(f"the {name} job ran past --timeout {args.timeout:g} s; "
                                         f"it was stopped. Logs: {', '.join(map(str, logs))}")
            progress.update(t0)
            time.sleep(0.5)
    finally:
        for proc in procs:
            _kill_group(proc)  # no rank outlives the demo, whatever happened
        for f in files:
            f.close()
    progress.finish(t0)
    result_path = out_dir / f"{name}.json"
    codes = [p.returncode for p in procs]
    if any(codes) or not result_path.is_file():
        bad = next((i for i, c in enumerate(codes) if c), 0)
        tail = "\n".join(logs[bad].read_text(errors="replace").splitlines()[-25:])
        raise RobustPluginsError(f"the {name} job failed (exit codes {codes}). Log: {logs[bad]}\n{tail}")
    result = json.loads(result_path.read_text())
    result["job_wall_s"] = time.monotonic() - t0
    result["faults"] = _read_jsonl(fault_view_path(progress.run_dir))
    node_dirs = [run_dir] if addrs is None else [run_dir / f"node{i}" for i in range(len(addrs))]
    result["restores"] = [r for d in node_dirs for r in _read_jsonl(d / "restores.jsonl")]
    return result


def _cluster(args: argparse.Namespace) -> tuple[str, str]:
    """("sim" or "loopback", the sentence saying so on screen)."""
    from robust_plugins.sim.netns import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if args.cluster == "loopback":
        return "loopback", f"{args.nproc} CPU ranks on this machine over loopback (--cluster loopback)"
    if reason is None and args.nproc % 2 == 0:
        return "sim", (f"a simulated 2-node cluster ({args.nproc // 2} ranks a node, network namespaces, "
                       f"{args.link_rate} between the nodes, loopback inside a node)")
    why = reason or f"--nproc {args.nproc} does not split into 2 nodes"
    if args.cluster == "sim":
        raise RobustPluginsError(f"--cluster sim: {why}.")
    return "loopback", f"{args.nproc} CPU ranks on this machine over loopback (no simulator: {why})"


def _follow(bars: list[Progress], worker: threading.Thread, t0: float, timeout: float, what: str) -> None:
    # The runs of one launch go one after another: follow each bar until the next run starts.
    i = 0
    while worker.is_alive():
        if time.monotonic() - t0 > timeout:
            raise RobustPluginsError(f"{what} ran past --timeout {timeout:g} s.")
        bars[i].update(t0)
        if i + 1 < len(bars) and bars[i + 1].started():
            bars[i].finish(t0)
            i += 1
        time.sleep(0.5)
    for bar in bars[i:]:
        bar.finish(t0)


def run_comparison(out_dir: Path, args: argparse.Namespace, telemetry: dict, kind: str) -> dict[str, Any]:
    """Baseline and plugin in one launch (simulated cluster or loopback); returns their results."""
    from robust_plugins.launch import launch_env, run_torchrun

    runs = []
    for name, src in (("baseline", "baseline.json"), ("plugin", "plugin.json")):
        cfg = _write_config(src, out_dir / f"{name}.ds.json", {"telemetry": {**telemetry, "dir": str(out_dir / name)}})
        runs.append({"name": name, "config": str(cfg)})
    plan = out_dir / "comparison.plan.json"
    plan.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    recipe_args = ["--plan", str(plan), "--out-dir", str(out_dir), "--steps", str(args.steps),
                   "--preset", args.preset]
    log = out_dir / "comparison.log"
    errors: list[BaseException] = []

    def launch() -> None:
        try:
            if kind == "sim":
                results = cluster.run([sys.executable, "-m", RECIPE_MODULE, *recipe_args], timeout_s=args.timeout,
                                      env=launch_env())
                log.write_text("".join(f"--- rank {r.rank} ---\n{r.stdout}{r.stderr}" for r in results))
            else:
                run_torchrun(RECIPE_MODULE, recipe_args, nproc=args.nproc, timeout_s=args.timeout, log_path=log)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    bars = [Progress(r["name"], out_dir / r["name"], args.steps, telemetry_dir=out_dir / r["name"]) for r in runs]
    t0 = time.monotonic()
    if kind == "sim":
        from robust_plugins.sim import SimCluster

        # Entered in the main thread: the simulator's teardown-on-signal handlers live there.
        with SimCluster(2, args.nproc // 2, args.link_rate) as cluster:
            worker = threading.Thread(target=launch, daemon=True)
            worker.start()
            _follow(bars, worker, t0, args.timeout + 30, "the comparison")
    else:
        worker = threading.Thread(target=launch, daemon=True)
        worker.start()
        _follow(bars, worker, t0, args.timeout + 30, "the comparison")
    if errors:
        raise RobustPluginsError(f"the comparison launch failed (log: {log}): {errors[0]}")
    return {r["name"]: json.loads((out_dir / f"{r['name']}.json").read_text()) for r in runs}


def run(args: argparse.Namespace) -> int:
    """Both jobs, then the table and the report."""
    from robust_plugins.telemetry import read_records
    from robust_plugins.telemetry.report import build

    inject = plan_faults(args.faults, args.steps, args.nproc)
    kind, where = _cluster(args)
    out_dir = (Path(args.out_dir) if args.out_dir else timestamped_dir("runs/demo")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    group = f"demo-{out_dir.name}"
    telemetry = {"log_every": LOG_EVERY, "heatmap_at_start": True,
                 "wandb": {"project": "robust_plugins-demo", "group": group, "mode": "offline"}}
    print(f"robust demo: {args.preset} GPT, {args.steps} steps, results in {out_dir}")
    print(f"1. baseline vs plugin (int8) on {where}")
    results = run_comparison(out_dir, args, telemetry, kind)
    where_faults = (f"one robust run agent per simulated node ({args.nproc // 2} ranks each), c10d rendezvous "
                    f"at node 0" if kind == "sim" else f"{args.nproc} ranks over loopback")
    print(f"2. the plugin job with faults under robust run ({where_faults}); injected: "
          f"{', '.join(inject) if inject else 'none'}")
    run_dir = out_dir / "plugin-faults"
    cfg = _write_config("plugin.json", out_dir / "plugin-faults.ds.json", {
        "telemetry": {**telemetry, "dir": str(run_dir / "telemetry")},
        "checkpoint": {"dir": str(out_dir / "ckpt"), "memory_every": 1, "peer_backup": kind == "sim",
                       "persist_every": PERSIST_EVERY, "keep": 2, "verify": "sha256"}})
    plan = out_dir / "plugin-faults.plan.json"
    plan.write_text(json.dumps({"runs": [{"name": "plugin-faults", "config": str(cfg)}]}, indent=1) + "\n")
    if kind == "sim":
        from robust_plugins.sim import SimCluster

        # Entered in the main thread: the agents' PR_SET_PDEATHSIG follows it, and the
        # simulator's teardown-on-signal handlers live there.
        with SimCluster(2, args.nproc // 2, args.link_rate) as cluster:
            faulted = run_job("plugin-faults", plan, out_dir, run_dir, args, inject, cluster)
    else:
        faulted = run_job("plugin-faults", plan, out_dir, run_dir, args, inject)
    recs = {n: read_records(d) for n, d in (("baseline", out_dir / "baseline"), ("plugin", out_dir / "plugin"),
                                              ("plugin-faults", run_dir / "telemetry"))}
    report = build([out_dir / "baseline", out_dir / "plugin", out_dir / "plugin-faults"], out_dir / "report.html")
    print()
    print(render(results["baseline"], results["plugin"], recs["baseline"], recs["plugin"], where=where))
    print()
    print(render_faults(faulted, recs["plugin-faults"], results["plugin"]))
    print(f"\nreport: {report}")
    print(f"W&B (offline) runs, project robust_plugins-demo, group {group}: "
          f"wandb sync {out_dir}/*/wandb/offline-run-* {out_dir}/*/telemetry/wandb/offline-run-*")
    if not (results["plugin"]["plugin_active"] and faulted["plugin_active"]):
        # The table above would compare vanilla with vanilla: say so and fail, never pass quietly.
        print("\nERROR: the plugin run did not attach robust_plugins to its engine, so it ran vanilla "
              "DeepSpeed. Check that `import robust_plugins` works and that patches/deepspeed.py is installed.")
        return 1
    return 0


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}x" if a is not None and b else "n/a"


def _median_of(recs: list[dict[str, Any]], key: str) -> float | None:
    vals = sorted(r[key] for r in recs if r.get("kind") == "step" and isinstance(r.get(key), (int, float)))
    return vals[len(vals) // 2] if vals else None


def render_faults(result: dict, recs: list[dict], fault_free: dict) -> str:
    """What the fault job went through (``result["faults"]``: the job's fault records, each fault
    once), and how it ended against the fault-free plugin run."""
    faults = result["faults"]
    lines = [f"plugin job under robust run: {len(faults)} fault(s) detected and recovered, "
             f"{sum(1 for r in recs if r.get('kind') == 'start')} incarnation(s), "
             f"{result['job_wall_s']:.0f} s launch to exit, ETTR {_fmt(_last(recs, 'ettr'), '.3f')}"]
    for f in faults:
        where = f" on node {f['node']}" if f.get("node") else ""
        timeout = (f.get("detail") or {}).get("timeout_s")
        limit = f" (hang timeout {timeout:g} s)" if f.get("kind") == "hang" and timeout is not None else ""
        lines.append(f"  {f.get('kind'):<6} at step {f.get('step')}, rank(s) {f.get('suspect_ranks')}{where}: detected "
                     f"after {f.get('detected_after_s') or 0:.1f} s{limit}, {f.get('action')}, resumed at step "
                     f"{f.get('resumed_at_step')} ({f.get('lost_steps')} steps redone){_recovery(f)}"
                     f"{_sources(result.get('restores') or [], f.get('incarnation'))}")
    lines.append(f"  final validation loss {result['val_loss']:.4f} (fault-free plugin run: {fault_free['val_loss']:.4f})")
    return "\n".join(lines)


def _sources(restores: list[dict], incarnation: int | None) -> str:
    """", restored from memory on 4 ranks": where the incarnation after the fault's restored from
    (``restores.jsonl``: a line per rank)."""
    if incarnation is None:
        return ""
    by: dict[str, int] = {}
    for r in restores:
        if r.get("incarnation") == incarnation + 1:
            src = str(r.get("source", "?")).split("://")[0].split(":")[0]
            by[src] = by.get(src, 0) + 1
    return (", restored from " + ", ".join(f"{s} on {n} rank(s)" for s, n in sorted(by.items()))) if by else ""


def _recovery(fault: dict) -> str:
    # detail.recovered_after_s: detection to the first step after the restart; detail.standby:
    # warm standbys served every rank of the node (watchdog/FORMAT.md).
    detail = fault.get("detail") or {}
    after = detail.get("recovered_after_s")
    if after is None:
        return ""
    how = "warm standbys" if detail.get("standby") else "cold start"
    return f", first step {after:.1f} s after detection ({how})"


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _last(recs: list[dict[str, Any]], key: str) -> Any:
    steps = [r for r in recs if r.get("kind") == "step" and r.get(key) is not None]
    return steps[-1][key] if steps else None


def render(base: dict, plug: dict, base_recs: list[dict] | None = None, plug_recs: list[dict] | None = None,
           where: str | None = None) -> str:
    """The side-by-side table of two result dicts (and their telemetry records, when given)."""
    codec = ((plug.get("robust_plugins_block") or {}).get("compression") or {}).get("codec", "?")
    rows = []
    for label, key in (("final train loss (mean of last 10 steps)", "final_loss_last10"),
                       ("validation loss", "val_loss")):
        b, p = base[key], plug[key]
        rows.append([label, f"{b:.4f}", f"{p:.4f}", f"{(p - b) / b * 100:+.2f} %"])
    wire = [(r.get("wire") or {}).get("rank0_median_grad_bytes_per_step") for r in (base, plug)]
    rows.append(["gradient bytes sent per step (rank 0)", human_bytes(wire[0]), human_bytes(wire[1]),
                 _ratio(wire[1], wire[0])])
    b, p = base["median_step_time_s"], plug["median_step_time_s"]
    rows.append(["median step time", f"{b * 1e3:.1f} ms", f"{p * 1e3:.1f} ms", _ratio(p, b)])
    if base_recs is not None and plug_recs is not None:
        tps = [_median_of(recs, "tokens_per_s") for recs in (base_recs, plug_recs)]
        rows.append(["tokens/s (all ranks, median)", *(f"{x:.0f}" if x else "n/a" for x in tps), _ratio(tps[1], tps[0])])
    rows.append(["training wall time (first to last step)", f"{sum(base['step_time_s']):.1f} s",
                 f"{sum(plug['step_time_s']):.1f} s", _ratio(sum(plug["step_time_s"]), sum(base["step_time_s"]))])
    head = (f"{base['world_size']} ranks, {base['preset']} GPT ({base['n_params'] / 1e6:.2f}M params), "
            f"{base['steps']} steps, ZeRO-{base['zero_stage']}, {base['dtype'].replace('torch.', '')}"
            + (f", on {where}" if where else ""))
    return head + "\n" + format_table(["", "vanilla DeepSpeed", f"robust_plugins ({codec})", "plugin / vanilla"], rows)

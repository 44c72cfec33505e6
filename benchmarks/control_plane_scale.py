"""The control plane at scale: real ``robust run`` agents, monitors and c10d rendezvous, fake ranks.

``nodes`` agents on this machine (loopback addresses ``127.0.0.<i+1>``, one c10d rendezvous),
``ranks`` fake ranks each (``benchmarks/fake_rank.py``: the step protocol, nothing trained, fresh
interpreters: ``--no-standby``, see ``STANDBY``). One job, in this order:

1. launch to every rank started (rendezvous, interpreters, imports; the ranks' first barrier): ``start_s``;
2. a steady window: the agents' CPU (``/proc/<pid>/stat``, user + system, every thread of the
   agent: its monitor, detectors, rendezvous keep-alive) per rank and second: ``cpu_ms_per_rank_s``;
3. ``kill:rank=<last>``: detection latency (``faults.jsonl``'s ``detected_after_s``), whether the
   fault names that rank alone, how long until every node's ``job_faults.jsonl`` holds it after it
   reached the killed node's ``faults.jsonl`` (``agree_s``), and the restart's rendezvous: the
   fault's detection to the last node's next round in ``membership.jsonl`` (``rdzv_s``);
4. the middle rank hangs (``benchmarks/fake_rank.py``'s hang file, set ``HANG_AFTER`` steps into
   the incarnation after the crash): detection latency, less the hang timeout (``hang_overhead_s``: stack
   dumps, verdict), and whether it names that rank.

Run (sizes 8, 64, 256 ranks; minutes on 2 cores; 1,024 ranks need about 20 GB for the fake ranks
alone, see ``STANDBY``)::

    python benchmarks/control_plane_scale.py --layout 1x8 8x8 16x16 --out runs/scale.json

It prints one markdown row per layout. ``tests/fault/test_control_plane_scale.py`` runs 2 x 8.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

FAKE_RANK = str(Path(__file__).with_name("fake_rank.py"))
STEP_S = 0.2
#: Steps of the steady window before the crash (CPU sampled over the middle of it).
STEADY_STEPS = 30
#: Steps into the incarnation after the crash before the hang: its learned timeout needs
#: ``hang_warmup_steps`` (3 here) of them.
HANG_AFTER = 10
#: Hang timeout floor: 0.2 s steps x hang_factor 10 = 2 s, raised to 5 s so that a step delayed
#: by two busy cores is not called a hang.
HANG_MIN_S = 5
WATCHDOG = ("hang_min_timeout_s=5", "hang_warmup_steps=3", "straggler_factor=0", "sdc_every_steps=0")
#: Fake ranks start as fresh interpreters (``--no-standby``): one imports only the watchdog, 19 MB
#: of private memory; forked from the agent's fork server (which imported torch) one held 157 MB
#: private (smaps_rollup, 8 x 8 here), too much for hundreds on one machine.
STANDBY = False
#: The product's default: how long stacks may take, and how long a node whose ranks only wait for
#: a peer of another node holds its restart for that node's verdict (``agent._hold_for_peer``).
STACK_DUMP_TIMEOUT_S = 15.0
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=10,join_timeout=600"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _iso(t: str) -> float:
    return datetime.datetime.fromisoformat(t).timestamp()


class _Watcher(threading.Thread):
    """First wall time each node's ``faults.jsonl`` / ``job_faults.jsonl`` holds a fault of a kind."""

    def __init__(self, dirs: list[Path]) -> None:
        super().__init__(daemon=True)
        self.dirs, self.seen, self.stop = dirs, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            now = time.time()
            for i, d in enumerate(self.dirs):
                for name in ("faults.jsonl", "job_faults.jsonl"):
                    for rec in _lines(d / name):
                        self.seen.setdefault((name, i, rec.get("kind")), now)


class Job:
    """The agents of one scale run and their clean-up (every exit path)."""

    def __init__(self, work: Path, nodes: int, ranks: int, inject: str, step_s: float,
                 stack_dump_timeout_s: float, standby: bool) -> None:
        self.work, self.nodes, self.ranks = work, nodes, ranks
        self.state = work / "state"
        self.state.mkdir(parents=True, exist_ok=True)
        self.dirs = [work / f"node{i}" for i in range(nodes)]
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs: list[subprocess.Popen] = []
        for i, d in enumerate(self.dirs):
            d.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(d),
                   "--nnodes", f"{nodes}:{nodes}", "--nproc-per-node", str(ranks), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "scale",
                   "--rdzv-conf", f"{RDZV_CONF},is_host={'true' if i == 0 else 'false'}",
                   "--local-addr", f"127.0.0.{i + 1}", "--max-restarts", "3", "--monitor-interval", "0.1",
                   *[a for w in WATCHDOG for a in ("--watchdog", w)],
                   "--watchdog", f"stack_dump_timeout_s={stack_dump_timeout_s:g}", "--inject", inject,
                   *([] if standby else ["--no-standby"]),
                   FAKE_RANK, "--state", str(self.state), "--step-s", str(step_s)]
            log = open(d / "launcher.log", "wb")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env, start_new_session=True))
            log.close()
            if i == 0:
                time.sleep(0.5)  # node 0 binds the store first

    def progress(self) -> int:
        try:
            return int((self.state / "step").read_text())
        except (OSError, ValueError):
            return 0

    def wait(self, what: str, ok, deadline: float, *, exits_ok: bool = False) -> None:
        while not ok():
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead and not exits_ok:
                raise RuntimeError(f"waiting for {what}: agents {dead} exited; see {self.dirs[dead[0]]}/launcher.log:\n"
                                   + (self.dirs[dead[0]] / "launcher.log").read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what} (work dir {self.work})")
            time.sleep(0.05)

    def close(self) -> None:
        """Kill every agent's session and every rank or standby it recorded."""
        pids = set()
        for d in self.dirs:
            pids.update(int(p) for rec in _lines(d / "workers.jsonl") for p in rec["pids"].values())
            pids.update(int(rec["pid"]) for rec in _lines(d / "standbys.jsonl") if rec.get("pid"))
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(timeout=30)


def run_scale(work: Path, nodes: int, ranks: int, *, step_s: float = STEP_S, timeout_s: float = 600.0,
              steady_steps: int = STEADY_STEPS, stack_dump_timeout_s: float = STACK_DUMP_TIMEOUT_S,
              standby: bool = STANDBY) -> dict:
    """One job of ``nodes`` x ``ranks`` fake ranks through a crash and a hang; the measures."""
    world = nodes * ranks
    kill_rank, hang_rank = world - 1, world // 2
    kill_step = steady_steps
    inject = f"kill:rank={kill_rank},step={kill_step}"
    deadline = time.monotonic() + timeout_s
    t0 = time.time()
    job = Job(work, nodes, ranks, inject, step_s, stack_dump_timeout_s, standby)
    watcher = _Watcher(job.dirs)
    watcher.start()
    try:
        ready = job.state / "ready-0"
        job.wait("every rank at the first barrier", lambda: ready.is_dir() and len(os.listdir(ready)) >= world, deadline)
        start_s = time.time() - t0
        job.wait("the steady window", lambda: job.progress() >= kill_step // 3, deadline)
        cpu0, w0 = [_cpu_s(p.pid) for p in job.procs], time.monotonic()
        job.wait("the steady window's end", lambda: job.progress() >= 2 * kill_step // 3, deadline)
        cpu1, w1 = [_cpu_s(p.pid) for p in job.procs], time.monotonic()
        cpu_ms = 1000 * (sum(cpu1) - sum(cpu0)) / (w1 - w0) / world
        crash_dir, hang_dir = job.dirs[kill_rank // ranks], job.dirs[hang_rank // ranks]
        job.wait("the crash's record", lambda: any(f["kind"] == "crash" for f in _lines(crash_dir / "faults.jsonl")),
                 deadline)
        first = job.state / "start-1"  # the incarnation after the crash (every node restarts with it)
        job.wait("the next incarnation's steps", lambda: first.exists() and job.progress() >= int(first.read_text())
                 + HANG_AFTER, deadline)
        (job.state / f"hang-{hang_rank}").write_text("1")
        hang_step = job.progress()
        job.wait("the hang's record", lambda: any(f["kind"] == "hang" for f in _lines(hang_dir / "faults.jsonl")),
                 deadline)
        job.wait("steps after the hang", lambda: job.progress() >= hang_step + 5, deadline)
        if nodes > 1:  # one node is the job: it keeps no job-wide view (watchdog/FORMAT.md)
            job.wait("every node's job view of both faults", lambda: all(
                ("job_faults.jsonl", i, k) in watcher.seen for i in range(nodes) for k in ("crash", "hang")), deadline)
        (job.state / "stop").touch()
        job.wait("the agents' exit", lambda: all(p.poll() is not None for p in job.procs), deadline, exits_ok=True)
    finally:
        watcher.stop.set()
        job.close()
    crash = next(f for f in _lines(crash_dir / "faults.jsonl") if f["kind"] == "crash")
    hang = next(f for f in _lines(hang_dir / "faults.jsonl") if f["kind"] == "hang")
    crash_node = kill_rank // ranks
    crash_seen = watcher.seen[("faults.jsonl", crash_node, "crash")]
    agree = (max(watcher.seen[("job_faults.jsonl", i, "crash")] for i in range(nodes)) - crash_seen
             if nodes > 1 else None)
    rounds = [_lines(d / "membership.jsonl") for d in job.dirs]
    detected = _iso(crash["time"])
    rejoined = [min((_iso(r["time"]) for r in rs if _iso(r["time"]) > detected), default=math.nan) for rs in rounds]
    return {
        "ranks": world, "nodes": nodes, "ranks_per_node": ranks, "exit_codes": [p.returncode for p in job.procs],
        "start_s": round(start_s, 2), "cpu_ms_per_rank_s": round(cpu_ms, 3),
        "crash_detect_s": crash["detected_after_s"], "crash_ranks": crash["suspect_ranks"], "kill_rank": kill_rank,
        "crash_restart_s": crash["detail"].get("restart_s"), "rdzv_s": round(max(rejoined) - detected, 2),
        "agree_s": None if agree is None else round(agree, 2),
        "hang_detect_s": hang["detected_after_s"], "hang_timeout_s": hang["detail"].get("timeout_s"),
        "hang_overhead_s": round(hang["detected_after_s"] - hang["detail"].get("timeout_s", 0), 2),
        "hang_ranks": hang["suspect_ranks"], "hang_rank": hang_rank,
        "hang_rdzv_s": round(max(min((_iso(r["time"]) for r in rs if _iso(r["time"]) > _iso(hang["time"])),
                                     default=math.nan) for rs in rounds) - _iso(hang["time"]), 2),
    }


ROW = ("| {ranks} ({nodes} x {ranks_per_node}) | {start_s:.1f} | {cpu_ms_per_rank_s:.2f} | {crash_detect_s:.2f} "
       "| {rdzv_s:.1f} | {agree} | {hang_detect_s:.1f} ({hang_timeout_s:g} timeout) | {hang_overhead_s:.2f} "
       "| {attributed} |")
HEADER = ("| ranks (agents x ranks) | launch to ranks started, s | agent CPU, ms per rank per s | crash detected "
          "after, s | crash to next rendezvous round, s | fault in every node's job view after, s | hang detected "
          "after, s | hang detection beyond the timeout, s | right rank named |\n|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    """Run each ``--layout`` once; print a markdown row each; write the measures as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", nargs="+", default=["1x8", "8x8"], help="NODESxRANKS, e.g. 8x8 32x32")
    p.add_argument("--work", default="runs/control_plane_scale", help="run directories")
    p.add_argument("--out", help="write the measures here (JSON)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on each layout's job")
    p.add_argument("--standby", action="store_true", help="fork the fake ranks from the agents' fork servers")
    args = p.parse_args()
    rows = []
    print(HEADER, flush=True)
    for layout in args.layout:
        n, m = (int(x) for x in layout.lower().split("x"))
        r = run_scale(Path(args.work) / layout, n, m, timeout_s=args.timeout_s, standby=args.standby)
        r["attributed"] = "yes" if (r["crash_ranks"] == [r["kill_rank"]] and r["hang_rank"] in r["hang_ranks"]) \
            else f"no (crash {r['crash_ranks']}, hang {r['hang_ranks']})"
        r["agree"] = "n/a (1 node)" if r["agree_s"] is None else f"{r['agree_s']:.2f}"
        rows.append(r)
        print(ROW.format(**r), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

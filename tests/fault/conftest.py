"""The fault tier: ``robust run`` jobs with injected faults (gloo, CPU ranks, plain PyTorch recipe).

Every job runs in its own session under a hard timeout; after it, the test checks that no
process of the launcher's session and no rank of any incarnation is still alive.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from robust_plugins.launch import launch_env

RECIPE = "robust_plugins.recipes.plain_gpt.train"

#: Small and fast: 40 tiny-GPT steps take ~2 s on 2 ranks; start-up (imports, rendezvous) dominates.
RECIPE_ARGS = ["--steps", "40", "--save-every", "10", "--corpus-bytes", "200000"]


def pytest_configure(config):
    config.addinivalue_line("markers", "fault: robust run jobs with injected faults (tests/fault)")


@dataclass
class Job:
    """A finished ``robust run`` job."""

    returncode: int
    output: str
    run_dir: Path
    wall_s: float

    @property
    def faults(self) -> list[dict]:
        path = self.run_dir / "faults.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    @property
    def result(self) -> dict:
        return json.loads((self.run_dir / "result.json").read_text())

    def worker_pids(self) -> list[int]:
        path = self.run_dir / "workers.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [p for x in lines for p in json.loads(x)["pids"].values()]


def _session_members(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid:  # fields after "(comm)": state ppid pgrp session ...
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def robust_run(run_dir: Path, nproc: int, *args: str, timeout_s: float = 120.0,
               env: dict | None = None, recipe_args: list[str] | None = None,
               rdzv: str = "standalone", script: list[str] | None = None,
               stragglers: bool = False) -> Job:
    """Run ``robust run`` on the plain GPT recipe; kill everything after ``timeout_s``.

    ``rdzv="standalone"`` uses torchrun's ``--standalone`` (c10d rendezvous on a free port);
    ``"static"`` the static rendezvous (``--master-addr``/``--master-port``), torchrun's default
    for a multi-node job. Both reuse one store across restarts upstream. ``script`` replaces the
    recipe (``[path, args...]``); it must take ``--ckpt-dir`` and ``--out``. ``stragglers``:
    keep the straggler detector on (off otherwise, see below).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    if not stragglers:
        # The straggler detector (on by default) reports a rank whose compute time is 2x its
        # peers'; with 2-4 ranks on 2 shared CI cores a starved rank earns that now and then, and
        # its report would break the fault-free assertions of tests about other detectors. The
        # straggler tests turn it on (stragglers=True).
        args = ("--watchdog", "straggler_factor=0", *args)
    rdzv_args = (["--standalone"] if rdzv == "standalone" else
                 ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())])
    cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(run_dir),
           *rdzv_args, "--nproc-per-node", str(nproc), "--monitor-interval", "0.1", *args,
           *(script or ["-m", RECIPE, *(RECIPE_ARGS if recipe_args is None else recipe_args)]),
           "--ckpt-dir", str(run_dir / "ckpt"), "--out", str(run_dir / "result.json")]
    return run_job(cmd, run_dir, timeout_s, env)


def run_job(cmd: list[str], run_dir: Path, timeout_s: float, env: dict | None = None) -> Job:
    """Run a ``robust run`` command line in its own session, logging to ``run_dir/launcher.log``;
    kill whatever is left of it afterwards and fail on a timeout or on a survivor."""
    full_env = launch_env(extra=env)  # OMP_NUM_THREADS=1, DeepSpeed's CPU accelerator and JIT cache
    t0 = time.monotonic()
    log = run_dir / "launcher.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=full_env, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            timed_out = proc.poll() is None
            leftovers = _kill_everything(proc.pid, run_dir)
            if timed_out:
                proc.wait(timeout=10)
    job = Job(proc.returncode, log.read_text(errors="replace"), run_dir, time.monotonic() - t0)
    assert not timed_out, f"robust run did not finish within {timeout_s} s:\n{job.output[-4000:]}"
    assert not leftovers, f"processes left running after robust run exited: {leftovers}\n{job.output[-3000:]}"
    return job


def _kill_everything(sid: int, run_dir: Path) -> list[int]:
    """Kill what is left of the job; return what was left *after the launcher exited on its own*."""
    workers_file = run_dir / "workers.jsonl"
    standbys_file = run_dir / "standbys.jsonl"  # warm standby workers live in their own sessions

    def survivors() -> list[int]:
        pids = set(_session_members(sid))
        if workers_file.exists():
            for line in workers_file.read_text().splitlines():
                pids.update(int(p) for p in json.loads(line)["pids"].values())
        if standbys_file.exists():
            pids.update(json.loads(line)["pid"] for line in standbys_file.read_text().splitlines())
        return sorted(p for p in pids if _alive(p))

    # Ranks get SIGKILL from the kernel when the launcher exits (PDEATHSIG); allow a moment.
    deadline = time.monotonic() + 5.0
    left = survivors()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = survivors()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@pytest.fixture(scope="session")
def baseline_2(tmp_path_factory) -> dict:
    """A fault-free 2-rank run of the recipe through ``robust run`` (the reference result).

    Run once per ``make test``: concurrent workers (pytest-xdist) share the temporary root, and
    the first to get there runs the job under a file lock while the others wait for its result.
    """
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by every worker of this session
    result = root / "baseline2.result.json"
    with FileLock(str(root / "baseline2.lock")):
        if not result.exists():
            job = robust_run(root / "baseline2", 2, "--max-restarts", "0")
            assert job.returncode == 0, job.output[-3000:]
            assert job.faults == [], f"false positive on a fault-free run: {job.faults}"
            result.write_text(json.dumps(job.result))
    return json.loads(result.read_text())

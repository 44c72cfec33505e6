"""Step signals from fast loops in other processes: every step is read from the shared-memory
ring or counted as overwritten, and a NaN is never lost, also when the ring is lapped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import robust_run

from robust_plugins.config import WatchdogConfig
from robust_plugins.watchdog import protocol
from robust_plugins.launcher.monitor import Monitor

pytestmark = [pytest.mark.fault]

SCRIPT = str(Path(__file__).with_name("fast_loop.py"))


class _Recording(Monitor):
    """The real monitor, also noting every step it handles (rank, step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[int, list[int]] = {}

    def _on_step(self, st, rank, step, *args):
        self.seen.setdefault(rank, []).append(step)
        super()._on_step(st, rank, step, *args)


@pytest.mark.parametrize("entries,steps,busy_us", [(64, 30000, 0.0), (8192, 10000, 100.0)],
                         ids=["lapped-64-entries", "default-ring-100us-steps"])
def test_a_nan_in_a_fast_loop_is_found_at_its_step_and_every_step_is_accounted_for(
        tmp_path, entries, steps, busy_us):
    nan_step = steps * 2 // 3 + 7
    mon = _Recording(WatchdogConfig(straggler_factor=0), tmp_path, host="h", ring_entries=entries)
    procs = []
    try:
        env = dict(os.environ)
        env.update(mon.worker_env([0, 1]))
        env[protocol.ENV_INCARNATION] = "0"
        out = str(tmp_path / "rank")
        for r in (0, 1):
            procs.append(subprocess.Popen(
                [sys.executable, SCRIPT, "--steps", str(steps), "--busy-us", str(busy_us),
                 "--nan-step", str(nan_step), "--out", out],
                env={**env, "RANK": str(r)}, stdin=subprocess.DEVNULL))
        mon.begin_incarnation({r: p.pid for r, p in enumerate(procs)})
        for p in procs:
            assert p.wait(timeout=120) == 0
        fault = mon.check(will_restart=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        mon.close()
    assert all(json.loads(Path(f"{out}-rank{r}.json").read_text())["ring"] for r in (0, 1))
    assert (fault.kind, fault.step, fault.suspect_ranks) == ("nan", nan_step, [1])
    for r in (0, 1):
        seen = mon.seen[r]
        # In order, none twice, none invented (a torn record read as a step would break this),
        # and every step not read is one the monitor counted as overwritten.
        assert seen == sorted(set(seen)) and set(seen) <= set(range(1, steps + 1)) and seen[-1] == steps
        assert len(seen) + mon.transport.ring_missed.get(r, 0) == steps, (r, len(seen), mon.transport.ring_missed)
    if entries == 64:
        assert sum(mon.transport.ring_missed.values()) > 0  # lapped: the NaN came through its datagram


def test_robust_run_gives_ranks_rings_and_finds_a_nan_in_a_fast_loop(tmp_path):
    job = robust_run(tmp_path / "run", 2, "--max-restarts", "0",
                     script=[SCRIPT, "--steps", "20000", "--busy-us", "50", "--nan-step", "15001"],
                     timeout_s=150)
    assert job.returncode != 0  # a fault with no restart left ends the job
    infos = [json.loads(p.read_text()) for p in sorted((tmp_path / "run").glob("result.json-rank*.json"))]
    assert [i["ring"] for i in infos] == [True, True], job.output[-3000:]
    (fault,) = job.faults
    assert (fault["kind"], fault["step"], fault["suspect_ranks"]) == ("nan", 15001, [1]), job.output[-3000:]

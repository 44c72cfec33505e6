"""The newest step a rollback's ranks may restore, without processes: the monitor hands it to
every incarnation until the job has run past the bad steps (also when the NaN is only seen after
every rank exited 0, and when the restarted ranks crash before their first step), and the disk
choice passes over checkpoints newer than it (a save the monitor could not veto in time)."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import pytest

from robust_plugins.checkpoint import store
from robust_plugins.config import WatchdogConfig
from robust_plugins.watchdog import protocol
from robust_plugins.launcher.monitor import Monitor

from test_checkpoint import EXPECT, make_ckpt


def _wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _run(mon, tx, incarnation: int, first: int, last: int, nan_at: int | None = None, exit_=False):
    for step in range(first, last + 1):
        for r in (0, 1):
            loss = float("nan") if (r == 1 and step == nan_at) else 2.0
            tx.sendto(json.dumps({"k": "end", "r": r, "i": incarnation, "s": step, "t": 0.0,
                                  "l": loss}).encode(), mon.address)
    if exit_:
        for r in (0, 1):
            tx.sendto(json.dumps({"k": "exit", "r": r, "i": incarnation, "t": 0.0}).encode(), mon.address)
    assert _wait_for(lambda: all(mon.ranks[r].progress.last_step == last for r in (0, 1)))


def _bound(mon) -> str:
    """The newest step the monitor lets the next ranks restore ("" when none)."""
    return mon.worker_env()[protocol.ENV_ROLLBACK_MAX_STEP]


@pytest.fixture
def monitor(tmp_path):
    """A node monitor with default settings and a socket that sends it ranks' datagrams."""
    mon = Monitor(WatchdogConfig(), tmp_path, host="h")
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        yield mon, tx
    finally:
        tx.close()
        mon.close()


def test_the_bound_holds_when_the_nan_is_seen_after_the_last_step_and_across_a_crash(monitor):
    mon, tx = monitor
    assert _bound(mon) == ""
    mon.begin_incarnation({0: 100, 1: 101})
    # NaN at the second-to-last step; both ranks finish and exit before the monitor looks.
    _run(mon, tx, 0, 1, 16, nan_at=15, exit_=True)
    fault = mon.check(will_restart=True)
    assert (fault.kind, fault.step, fault.action) == ("nan", 15, "rollback")
    assert _bound(mon) == "14"
    # The restarted ranks crash before reporting a step: the crash replaces the pending
    # fault, but memory still holds the snapshots of steps 15 and 16.
    mon.begin_incarnation({0: 200, 1: 201})
    crash = mon.on_crash({1: SimpleNamespace(exitcode=1, timestamp=0)}, will_restart=True)
    assert crash.kind == "crash"
    assert _bound(mon) == "14"
    # The next incarnation restores 14 and runs on: up to one step past the faulty ranks'
    # newest (a stopped rank may have snapshotted it without reporting) the bound stays.
    mon.begin_incarnation({0: 300, 1: 301})
    _run(mon, tx, 2, 15, 17)
    assert _bound(mon) == "14"
    _run(mon, tx, 2, 18, 18)
    assert _bound(mon) == ""


def test_a_crash_after_a_reported_nan_restarts_below_the_nan(monitor):
    """Rank 1 reports a NaN at step 15, then rank 0 is killed before the monitor's next look: the
    restart must not restore the newest snapshots (15, 16 hold the bad state). The NaN comes back
    as the fault, its bound 14, the crash in its detail; written once the ranks resume."""
    mon, tx = monitor
    mon.begin_incarnation({0: 100, 1: 101})
    _run(mon, tx, 0, 1, 16, nan_at=15)
    fault = mon.on_crash({0: SimpleNamespace(exitcode=-9, timestamp=0)}, will_restart=True)
    assert (fault.kind, fault.step, fault.action, fault.suspect_ranks) == ("nan", 15, "rollback", [1])
    assert fault.detail["crash"]["exitcodes"] == {"0": -9} and fault.detail["crash"]["signal"] == "SIGKILL"
    assert _bound(mon) == "14"
    mon.begin_incarnation({0: 200, 1: 201})
    _run(mon, tx, 1, 15, 15)
    written = [json.loads(x) for x in (mon.run_dir / "faults.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["resumed_at_step"]) for f in written] == [("nan", 15)]
    assert written[0]["detail"]["crash"]["suspect_ranks"] == [0]


def test_steps_the_faulty_ranks_report_after_the_fault_extend_the_bad_range(monitor):
    mon, tx = monitor
    mon.begin_incarnation({0: 100, 1: 101})
    _run(mon, tx, 0, 1, 6, nan_at=5)
    assert mon.check(will_restart=True).step == 5
    _run(mon, tx, 0, 7, 9)  # not yet stopped: their snapshots of 7..9 hold the bad state too
    assert _bound(mon) == "4"
    mon.begin_incarnation({0: 200, 1: 201})
    _run(mon, tx, 1, 5, 10)
    assert _bound(mon) == "4"
    _run(mon, tx, 1, 11, 11)
    assert _bound(mon) == ""


def test_a_rollback_in_a_later_incarnation_is_bounded_by_its_own_step_only(monitor):
    """A NaN at step 12, then, after the restore of 11, a second one at step 13: the restarted
    incarnation snapshotted 12 anew (its restore retired the bad ones), so 12 is the bound, not
    the first rollback's 11; the first one's bad steps still keep the bound until run past."""
    mon, tx = monitor
    mon.begin_incarnation({0: 100, 1: 101})
    _run(mon, tx, 0, 1, 12, nan_at=12)
    assert mon.check(will_restart=True).step == 12
    assert _bound(mon) == "11"
    mon.begin_incarnation({0: 200, 1: 201})
    _run(mon, tx, 1, 12, 13, nan_at=13)
    assert mon.check(will_restart=True).step == 13
    assert _bound(mon) == "12"
    mon.begin_incarnation({0: 300, 1: 301})
    _run(mon, tx, 2, 13, 14)
    assert _bound(mon) == "12"
    _run(mon, tx, 2, 15, 15)
    assert _bound(mon) == ""


def test_choose_passes_over_checkpoints_after_the_rollback_bound(tmp_path):
    for seq, step in enumerate((12, 14, 16), start=1):
        make_ckpt(tmp_path, f"global_step{step}", step, seq)
    assert store.choose(str(tmp_path), EXPECT).tag == "global_step16"
    choice = store.choose(str(tmp_path), EXPECT, max_step=14)
    assert choice.tag == "global_step14"
    assert choice.skipped == [("global_step16", "step 16 is after the rollback's last good step 14")]
    nothing = store.choose(str(tmp_path), EXPECT, max_step=11)
    assert nothing.tag is None and nothing.found_any and len(nothing.skipped) == 3

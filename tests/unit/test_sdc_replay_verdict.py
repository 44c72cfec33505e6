"""The monitor's SDC replay verdicts, fed with the datagrams ranks send (no processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from robust_plugins.config import WatchdogConfig
from robust_plugins.errors import ConfigError
from robust_plugins.watchdog import inject
from robust_plugins.watchdog.faults import read_faults
from robust_plugins.launcher.monitor import Monitor

GOOD, BAD = "00000000000000aa", "00000000000000bb"


def _steps(mon: Monitor, inc: int, first: int, last: int) -> None:
    for step in range(first, last + 1):
        for r in (0, 1, 2):
            mon._handle({"k": "end", "r": r, "i": inc, "s": step, "t": time.time(), "l": 2.0}, time.monotonic())


def _hashes(mon: Monitor, inc: int, step: int, bad_rank: int | None) -> None:
    for r in (0, 1, 2):
        why = f"ranks [{bad_rank}] hold parameters that differ" if bad_rank is not None else ""
        mon._handle({"k": "hash", "r": r, "i": inc, "s": step, "t": time.time(),
                     "h": BAD if r == bad_rank else GOOD, "bad": [bad_rank] if why else [], "why": why},
                    time.monotonic())


def _detect(tmp_path: Path, **cfg) -> Monitor:
    mon = Monitor(WatchdogConfig(sdc_every_steps=5, **cfg), tmp_path, host="h")
    mon.begin_incarnation({0: 10, 1: 11, 2: 12})
    _steps(mon, 0, 1, 20)
    _hashes(mon, 0, 20, bad_rank=2)
    return mon


def test_agreeing_replay_is_transient_and_written_with_its_evidence(tmp_path):
    mon = _detect(tmp_path)
    try:
        fault = mon.check(will_restart=True)
        assert (fault.kind, fault.action, fault.suspect_ranks) == ("sdc", "rollback", [2])
        mon.begin_incarnation({0: 20, 1: 21, 2: 22})
        _steps(mon, 1, 11, 19)
        assert read_faults(tmp_path / "faults.jsonl") == []  # held for the verdict, not written yet
        _hashes(mon, 1, 20, bad_rank=None)
        (line,) = read_faults(tmp_path / "faults.jsonl")
        assert line["resumed_at_step"] == 11 and line["detail"]["replay"]["verdict"] == "transient"
        ev = json.loads(Path(line["evidence"][0]).read_text())
        assert ev["hashes_at_detection"] == {"0": GOOD, "1": GOOD, "2": BAD}
        assert ev["hashes_at_replay"] == {"0": GOOD, "1": GOOD, "2": GOOD}
        assert mon.check(will_restart=True) is None
    finally:
        mon.close()


def test_the_same_minority_again_is_persistent_and_evicted(tmp_path):
    mon = _detect(tmp_path)
    try:
        mon.check(will_restart=True)
        mon.begin_incarnation({0: 20, 1: 21, 2: 22})
        _steps(mon, 1, 11, 20)
        _hashes(mon, 1, 20, bad_rank=2)
        evict = mon.check(will_restart=True)
        assert (evict.kind, evict.action, evict.suspect_ranks, evict.step) == ("sdc", "evict", [2], 20)
        first, second = read_faults(tmp_path / "faults.jsonl")
        assert first["action"] == "rollback" and first["detail"]["replay"]["verdict"] == "persistent"
        assert second["action"] == "evict" and second["evidence"] == first["evidence"]
    finally:
        mon.close()


def test_another_minority_on_replay_is_a_new_fault_and_the_first_says_so(tmp_path):
    mon = _detect(tmp_path)
    try:
        mon.check(will_restart=True)
        mon.begin_incarnation({0: 20, 1: 21, 2: 22})
        _steps(mon, 1, 11, 20)
        _hashes(mon, 1, 20, bad_rank=0)
        fault = mon.check(will_restart=True)
        assert (fault.action, fault.suspect_ranks, fault.detail["replay"]) == ("rollback", [0], {"verdict": "pending"})
        (first,) = read_faults(tmp_path / "faults.jsonl")
        assert first["detail"]["replay"]["verdict"] == "different"
    finally:
        mon.close()


def test_a_job_that_ends_before_the_replay_writes_the_fault_as_not_replayed(tmp_path):
    mon = _detect(tmp_path)
    mon.check(will_restart=True)
    mon.close()
    (line,) = read_faults(tmp_path / "faults.jsonl")
    assert line["detail"]["replay"]["verdict"] == "not replayed"


def test_replay_off_and_no_restart_write_a_plain_fault(tmp_path):
    mon = _detect(tmp_path, sdc_replay=False)
    try:
        fault = mon.check(will_restart=True)
        assert fault.action == "rollback" and "replay" not in fault.detail
    finally:
        mon.close()
    mon = _detect(tmp_path / "b")
    try:
        fault = mon.check(will_restart=False)
        assert fault.action == "report" and "replay" not in fault.detail
    finally:
        mon.close()


def test_stuckbit_parses_recurs_and_is_checked():
    (i,) = inject.parse("stuckbit:rank=1,step=17,bit=3")
    assert (i.kind, i.option, i.spec()) == ("stuckbit", "3", "stuckbit:rank=1,step=17,bit=3")
    assert i.kind in inject.RECURRING_KINDS and i.kind in inject.PARAM_KINDS
    with pytest.raises(ConfigError, match="bit='40' must be an integer from 0 to 31"):
        inject.parse("stuckbit:rank=1,step=17,bit=40")
    with pytest.raises(ConfigError, match="sdc_replay"):
        WatchdogConfig(sdc_replay="yes")

"""The snapshot's replica check (silent data corruption) without processes: which bytes are
hashed, what a mismatch does to the store, when the check runs, and how the monitor rolls back."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from robust_plugins.checkpoint import memory, replicas
from robust_plugins.config import WatchdogConfig
from robust_plugins.errors import CheckpointError
from robust_plugins.launcher.monitor import Monitor
from robust_plugins.watchdog.param_hash import hash_message
from robust_plugins.watchdog.snapshot_check import off_reason


@pytest.fixture
def job(tmp_path):
    key = f"unit-{uuid.uuid4().hex[:12]}"
    yield key, str(tmp_path)
    memory.remove_job(key, str(tmp_path))


def _state():
    torch.manual_seed(0)
    w, b = torch.randn(64, 7), torch.randn(7)
    return {"module": {"w": w, "b": b}, "optimizer": {"m": torch.randn(13)}}, [w, b]


def test_only_the_parameters_are_hashed_and_one_flipped_bit_changes_the_digest(job):
    key, root = job
    state, params = _state()
    st = memory.SnapshotStore(key, 0, 2, root=root, verify=lambda *_: True)
    seen = []
    st.verify = lambda slot, step, ranges: seen.append((step, ranges, replicas.slot_digest(slot, ranges))) or True
    try:
        st.save(1, state, replicated=replicas.replicated_keys(params))
        st.flush()
        (step, ranges, digest), = seen
        assert step == 1 and [n for _, n in ranges] == [64 * 7 * 4, 7 * 4]  # w and b, not the optimizer
        state["optimizer"]["m"] += 1  # not a parameter: the digest stays
        st.save(2, state, replicated=replicas.replicated_keys(params))
        st.flush()
        assert seen[-1][2] == digest
        params[0].view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)  # one bit
        st.save(3, state, replicated=replicas.replicated_keys(params))
        st.flush()
        assert seen[-1][2] != digest
    finally:
        st.close()


def test_a_parameter_missing_from_the_snapshot_fails_loudly(job):
    key, root = job
    state, params = _state()
    st = memory.SnapshotStore(key, 0, 2, root=root, verify=lambda *_: True)
    try:
        with pytest.raises(CheckpointError, match="1 of 3 parameters are not in the snapshot"):
            st.save(1, state, replicated=replicas.replicated_keys(params + [torch.ones(3)]))
    finally:
        st.close()


def test_a_mismatch_uncommits_the_snapshot_skips_its_hand_off_and_stops_further_snapshots(job):
    key, root = job
    state, params = _state()
    handed = []
    st = memory.SnapshotStore(key, 0, 2, root=root, after_commit=lambda i, slot: handed.append(slot.header().step),
                              verify=lambda slot, step, ranges: step != 2)
    try:
        for step in (1, 2):
            st.save(step, state, replicated=replicas.replicated_keys(params))
            st.flush()
        assert st.verdict() == 2 and handed == [1]  # no peer copy, no disk save of the bad one
        assert [s.step for s in st.own_snapshots()] == [1]  # step 2 is not restorable
        with pytest.raises(CheckpointError, match="differed in the snapshot of step 2"):
            st.save(3, state, replicated=replicas.replicated_keys(params))
        assert [s.step for s in st.own_snapshots()] == [1]  # step 1's slot was not overwritten
    finally:
        st.close()


def test_replica_sets_must_partition_the_ranks():
    assert replicas.plan_sets([[0, 2], [1, 3], [0, 2], [3, 1]]) == [(0, 2), (1, 3)]
    with pytest.raises(CheckpointError, match="rank 0 is in two data-parallel groups"):
        replicas.plan_sets([[0, 1], [0, 1, 2], [1, 2]])
    with pytest.raises(CheckpointError, match="rank 1 reported the data-parallel group"):
        replicas.plan_sets([[0, 2], [0, 2], [0, 2]])


def test_the_check_runs_only_where_it_can_act():
    assert off_reason(True, True, 100, 4) is None
    assert "verify_replicas is false" in off_reason(False, True, 100, 4)
    assert "not under robust run" in off_reason(True, False, 100, 4)
    assert "sdc_every_steps=0" in off_reason(True, True, 0, 4)
    assert "no data-parallel replica" in off_reason(True, True, 100, 1)
    assert off_reason(True, True, 100, 1, alone="ZeRO-3 has none") == "ZeRO-3 has none"


def test_the_monitor_rolls_a_snapshot_mismatch_back_to_the_snapshot_before(tmp_path):
    mon = Monitor(WatchdogConfig(sdc_every_steps=100), tmp_path, host="h")
    mon.begin_incarnation({0: 10, 1: 11, 2: 12})
    try:
        for step in range(1, 8):
            for r in (0, 1, 2):
                mon._handle({"k": "end", "r": r, "i": 0, "s": step, "t": time.time(), "l": 2.0}, time.monotonic())
        hashes = {0: 7, 1: 7, 2: 9}
        for r in (0, 1, 2):
            msg = hash_message(7, hashes[r], hashes, every=1)
            mon._handle({**msg, "r": r, "i": 0, "t": time.time()}, time.monotonic())
        fault = mon.check(will_restart=True)
        assert (fault.kind, fault.step, fault.suspect_ranks, fault.action) == ("sdc", 7, [2], "rollback")
        # Back one snapshot (6), not sdc_every_steps (100): the snapshot of step 6 agreed.
        assert fault.detail["check_every"] == 1 and fault.detail["checked_by"] == "snapshot"
        assert mon.book.rollback_max_step() == "6"
    finally:
        mon.close()

"""The job-wide fault view's merge (pure, made-up records) and its store transport (a real
TCPStore, two views acting as two nodes, a monitor stand-in)."""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time

import pytest
import torch.distributed as dist

from robust_plugins.launcher.jobfaults import ViewBook, merge_round
from robust_plugins.watchdog.faults import JOB_FAULTS, fault_view_path
from robust_plugins.launcher.jobfaults_sync import JobFaultView
from robust_plugins.launcher.nodes import exiting_ranks

A, B = "10.0.0.1", "10.0.0.2"


def rec(node, kind, ranks, t, node_ranks, step=25, action="restart", **detail):
    return {"kind": kind, "step": step, "suspect_ranks": ranks, "suspect_hosts": [node],
            "time": f"2026-01-01T00:00:{t:06.3f}+00:00", "action": action, "incarnation": 1,
            "detail": detail, "node": node, "round": 2, "node_ranks": node_ranks}


def test_a_killed_rank_on_node_b_is_one_crash_on_b_not_also_a_crash_on_a():
    # B's rank 3 was SIGKILLed; A's ranks lost their peer (exit 1) and A logged that first.
    a = rec(A, "crash", [0, 1], 1.0, [0, 1], signal=None, onset="last signal")
    b = rec(B, "crash", [3], 1.4, [2, 3], signal="SIGKILL", onset="injected")
    (fault,) = merge_round([a, b])
    assert (fault["node"], fault["suspect_ranks"], fault["source"]) == (B, [3], "evidence")
    assert [(e["node"], e["suspect_ranks"]) for e in fault["echoes"]] == [(A, [0, 1])]
    assert "node_ranks" not in fault and fault["round"] == 2


def test_a_hang_outside_a_collective_beats_the_peers_waiting_inside_one():
    waiting = rec(A, "hang", [0, 1], 1.0, [0, 1], in_collective={"0": True, "1": True})
    stuck = rec(B, "hang", [2], 3.0, [2, 3], in_collective={"2": False})
    # B's other rank then died of A's restart: a plain exit, no evidence.
    peer = rec(B, "crash", [3], 3.5, [2, 3], signal=None)
    (fault,) = merge_round([waiting, stuck, peer])
    assert (fault["kind"], fault["node"], fault["suspect_ranks"]) == ("hang", B, [2])
    assert sorted(e["node"] for e in fault["echoes"]) == [A, B]


_STUCK = """Process 11: /venv/bin/python -u train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 11 (idle): "MainThread"
    _sleep (robust_plugins/watchdog/inject_rank.py:40)
    step_end (robust_plugins/watchdog/client.py:300)
    main (train.py:90)
    <module> (train.py:116)
"""
# A rank whose peer on another node died while its stack was read: an exception hook, then atexit.
_EXITING = """Process 12: /venv/bin/python -u -m robust_plugins.launcher.standby.worker
Python v3.11.7 (/usr/bin/python3.11)

Thread 12 (active+gil): "MainThread"
    _del_library (torch/library.py:665)
    finalize.__call__ (weakref.py:590)
    finalize._exitfunc (weakref.py:666)
Thread 13 (idle): "wandb-AsyncioManager-main"
    select (selectors.py:468)
"""


def test_a_rank_caught_exiting_is_no_evidence_of_a_hang(tmp_path):
    (tmp_path / "hang-inc1-rank1.pyspy.txt").write_text(_STUCK)
    (tmp_path / "hang-inc1-rank0.pyspy.txt").write_text(_EXITING)
    evidence = sorted(str(p) for p in tmp_path.iterdir())
    assert exiting_ranks([0, 1], evidence) == [0]
    assert exiting_ranks([2], evidence) == []          # no dump: no claim
    # Both nodes' timeouts ran out together; B (rank 2 stuck) restarted first and A read the
    # stack of its rank 0 dying of the lost peer, outside any collective.
    dying = rec(A, "hang", [0], 1.3, [0, 1], in_collective={"0": False}, exiting=[0])
    stuck = rec(B, "hang", [2], 1.0, [2, 3], in_collective={"2": False})
    (fault,) = merge_round([dying, stuck])
    assert (fault["node"], fault["suspect_ranks"]) == (B, [2]) and fault["echoes"][0]["node"] == A


def test_a_nan_seen_on_two_nodes_is_one_fault_with_every_rank():
    a = rec(A, "nan", [0, 1], 1.2, [0, 1], what="grad_norm")
    b = rec(B, "nan", [2, 3], 1.1, [2, 3], what="grad_norm")
    side = rec(A, "crash", [1], 1.5, [0, 1], signal="SIGTERM")
    (fault,) = merge_round([a, b, side])
    assert (fault["node"], fault["suspect_ranks"], fault["source"]) == (B, [0, 1, 2, 3], "ranks")
    assert sorted(fault["suspect_hosts"]) == [A, B] and len(fault["echoes"]) == 2


def test_an_sdc_verdict_is_kept_from_the_node_with_the_corrupted_rank():
    a = rec(A, "sdc", [3], 1.0, [0, 1], action="rollback")   # A computed the same verdict
    b = rec(B, "sdc", [3], 1.1, [2, 3], action="rollback")
    (fault,) = merge_round([a, b])
    assert (fault["node"], fault["source"]) == (B, "evidence") and fault["echoes"][0]["node"] == A


def test_without_evidence_the_first_detection_stands_and_the_rest_are_echoes():
    # A Python exception on B (exit 1) looks like A's ranks losing their peer: nobody is blamed.
    b = rec(B, "crash", [2], 0.5, [2, 3], signal=None)
    a = rec(A, "crash", [0, 1], 0.9, [0, 1], signal=None)
    (fault,) = merge_round([a, b], silent=["10.0.0.3"])
    assert (fault["node"], fault["source"], fault["silent_nodes"]) == (B, "first", ["10.0.0.3"])
    assert [e["node"] for e in fault["echoes"]] == [A]


def test_two_real_faults_of_one_round_stay_two_and_stragglers_absorb_nothing():
    kill_a = rec(A, "crash", [1], 1.0, [0, 1], signal="SIGSEGV")
    kill_b = rec(B, "crash", [3], 1.2, [2, 3], signal="SIGKILL", onset="injected")
    slow = rec(B, "straggler", [2], 0.2, [2, 3], action="report")
    faults = merge_round([kill_b, slow, kill_a])
    assert [(f["kind"], f["node"]) for f in faults] == [("straggler", B), ("crash", A), ("crash", B)]
    assert all(not f["echoes"] for f in faults)
    assert merge_round([]) == []


def test_view_book_waits_for_every_node_of_a_round_then_writes_rounds_in_order():
    book = ViewBook(settle_s=30)
    for node in (A, B):
        book.ingest({"type": "join", "round": 1, "node": node, "nodes": 2}, 0)
        book.ingest({"type": "join", "round": 2, "node": node, "nodes": 2}, 0)
    book.ingest({"type": "fault", "round": 1, "node": A, "record": rec(A, "crash", [0], 1, [0], signal=None)}, 1)
    book.ingest({"type": "closed", "round": 1, "node": A}, 1)
    book.ingest({"type": "closed", "round": 2, "node": A}, 1)
    book.ingest({"type": "closed", "round": 2, "node": B}, 1)
    assert book.settle(2) == []          # round 1 waits for B, and round 2 for round 1
    book.ingest({"type": "fault", "round": 1, "node": B,
                 "record": rec(B, "crash", [1], 2, [1], signal="SIGKILL", onset="injected")}, 2)
    book.ingest({"type": "closed", "round": 1, "node": B}, 2)
    (fault,) = book.settle(3)
    assert (fault["node"], fault["round"], len(fault["echoes"])) == (B, 1, 1)
    assert book.rounds == {}


def test_view_book_writes_a_round_without_a_lost_node_after_settle_s_and_marks_late_records():
    book = ViewBook(settle_s=5)
    for node in (A, B):
        book.ingest({"type": "join", "round": 1, "node": node, "nodes": 2}, 0)
    book.ingest({"type": "fault", "round": 1, "node": A, "record": rec(A, "crash", [0], 1, [0], signal=None)}, 1)
    book.ingest({"type": "closed", "round": 1, "node": A}, 1)
    assert book.settle(5.9) == []
    (fault,) = book.settle(6.0)
    assert fault["silent_nodes"] == [B] and fault["source"] == "first"
    book.ingest({"type": "fault", "round": 1, "node": B, "record": rec(B, "crash", [1], 2, [1], signal=None)}, 7)
    (late,) = book.settle(7)
    assert (late["node"], late["source"]) == (B, "late")


class _Monitor:
    """What the view reads of a Monitor: its run directory and fault_state()."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.incarnation = 0
        self.held: set[int] = set()
        self.lock = threading.Lock()

    def fault_state(self):
        with self.lock:
            return self.incarnation, set(self.held)

    def write(self, record):
        with open(self.run_dir / "faults.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def _wait_for(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_two_nodes_mirror_one_view_through_the_store(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))

    def connect():
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=5))

    mons = {n: _Monitor(tmp_path / n) for n in (A, B)}
    views = {}
    for n, m in mons.items():
        m.run_dir.mkdir()
        m.write({"kind": "crash", "incarnation": 0, "time": "old"})  # an earlier launch's line
        views[n] = JobFaultView(connect, n, m, settle_s=30, poll_s=0.05)
        assert fault_view_path(m.run_dir) == m.run_dir / JOB_FAULTS
        views[n].start()
        views[n].join_round(7, 0, 2, [0] if n == A else [1])
    # Round 7: B's rank 1 killed, A's rank 0 lost its peer; each fault held until the restart.
    for n, m in mons.items():
        with m.lock:
            m.held = {0}
            m.incarnation = 1
    for n in (A, B):
        views[n].join_round(8, 1, 2, [0] if n == A else [1])
    time.sleep(0.3)
    assert (mons[A].run_dir / JOB_FAULTS).read_text() == ""   # nothing closed yet
    mons[A].write({**rec(A, "crash", [0], 1.0, [0], signal=None), "incarnation": 0})
    with mons[A].lock:
        mons[A].held = set()
    time.sleep(0.3)
    assert (mons[A].run_dir / JOB_FAULTS).read_text() == ""   # B has not closed round 7
    mons[B].write({**rec(B, "crash", [1], 1.2, [1], signal="SIGKILL", onset="injected"), "incarnation": 0})
    with mons[B].lock:
        mons[B].held = set()
    for n, m in mons.items():
        _wait_for(lambda m=m: (m.run_dir / JOB_FAULTS).read_text() != "")
        (fault,) = [json.loads(x) for x in (m.run_dir / JOB_FAULTS).read_text().splitlines()]
        assert (fault["node"], fault["round"], fault["suspect_ranks"]) == (B, 7, [1])
        assert [e["node"] for e in fault["echoes"]] == [A]
    # The job ends: both flush and wait for each other, bounded.
    t0 = time.monotonic()
    closers = [threading.Thread(target=views[n].close, args=(True,)) for n in (A, B)]
    for c in closers:
        c.start()
    for c in closers:
        c.join(30)
    assert time.monotonic() - t0 < 5
    assert all(len((m.run_dir / JOB_FAULTS).read_text().splitlines()) == 1 for m in mons.values())


@pytest.mark.timeout(60)
def test_a_dead_store_does_not_hang_the_agent_and_says_the_view_is_incomplete(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def connect():
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1))

    mon = _Monitor(tmp_path)
    view = JobFaultView(connect, A, mon, poll_s=0.05)
    view.start()
    view.join_round(1, 0, 2, [0])
    mon.write({**rec(A, "nan", [0], 1.0, [0]), "incarnation": 0})
    time.sleep(0.5)
    t0 = time.monotonic()
    view.close(completed=True)
    assert time.monotonic() - t0 < 8
    assert "may miss other nodes' faults" in capsys.readouterr().err
    # What this node saw still goes into its view when the store never answered.
    (fault,) = [json.loads(x) for x in (tmp_path / JOB_FAULTS).read_text().splitlines()]
    assert fault["kind"] == "nan" and fault["node"] == A

"""Shared-memory step rings (watchdog/ring.py) and the monitor reading them, in one process:
wraparound, exact counts of lapped entries, torn records, the heartbeat, file clean-up."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from robust_plugins.config import WatchdogConfig
from robust_plugins.errors import RobustPluginsError
from robust_plugins.watchdog import client, hold, protocol, ring
from robust_plugins.launcher.monitor import Monitor
from robust_plugins.watchdog.ring import RingError, RingReader, RingWriter


def _pair(tmp_path, capacity):
    path = str(tmp_path / "r")
    return RingReader.create(path, capacity), RingWriter(path)


def test_records_round_trip_with_absent_values_nan_and_wraparound(tmp_path):
    reader, writer = _pair(tmp_path, 8)
    assert reader.poll() == ([], 0)  # nothing written: zeroed slots fail their CRC
    writer.write(1, 2.5, None, None, None, 10.0)
    writer.write(2, math.nan, 0.5, 0.03, 0.01, 10.03)
    recs, missed = reader.poll()
    assert missed == 0 and [r.step for r in recs] == [1, 2]
    assert (recs[0].loss, recs[0].grad_norm, recs[0].wall_s, recs[0].comm_s) == (2.5, None, None, None)
    assert math.isnan(recs[1].loss) and (recs[1].grad_norm, recs[1].wall_s, recs[1].comm_s) == (0.5, 0.03, 0.01)
    assert recs[1].t_mono == 10.03
    # Around the end of the ring several times, reading before it is lapped: nothing lost.
    seen = []
    for step in range(3, 40):
        writer.write(step, float(step), None, 0.0, None, 0.0)
        if step % 5 == 0:
            got, missed = reader.poll()
            assert missed == 0
            seen += [r.step for r in got]
    seen += [r.step for r in reader.poll()[0]]
    assert seen == list(range(3, 40)) and reader.missed == 0 and reader.cursor == writer.written


def test_a_lapped_reader_counts_exactly_the_overwritten_entries(tmp_path):
    reader, writer = _pair(tmp_path, 8)
    for step in range(1, 21):  # 20 entries into 8 slots before the first poll
        writer.write(step, 1.0, None, None, None, 0.0)
    recs, missed = reader.poll()
    assert missed == 12 and [r.step for r in recs] == list(range(13, 21))
    writer.write(21, 1.0, None, None, None, 0.0)
    assert [r.step for r in reader.poll()[0]] == [21] and reader.missed == 12


@pytest.mark.parametrize("seed", range(5))
def test_every_entry_is_read_once_or_counted_missed_under_random_interleaving(tmp_path, seed):
    rng = random.Random(seed)
    cap = 16
    reader, writer = _pair(tmp_path, cap)
    read: list[int] = []
    expected: list[int] = []
    missed_total = 0
    for _ in range(300):
        for _ in range(rng.choice([0, 1, 3, 15, 16, 17, 40])):
            writer.write(writer.written, 0.0, None, None, None, 0.0)  # step = entry index
        # A ring of 16 holds the newest 16 entries: those not read yet are what a poll returns.
        expected += range(max(len(expected) + missed_total, writer.written - cap), writer.written)
        got, missed = reader.poll()
        missed_total += missed
        read += [r.step for r in got]
        assert read == expected and len(read) + missed_total == writer.written
    assert reader.missed == missed_total > 0


def test_a_half_written_record_is_not_read_until_it_is_complete(tmp_path):
    reader, writer = _pair(tmp_path, 4)
    writer.write(1, 1.0, None, None, None, 0.0)
    assert [r.step for r in reader.poll()[0]] == [1]
    # Entry 1 caught mid-copy: its first half is in the slot, the rest is still zeros.
    writer.write(2, 2.0, None, None, None, 0.0)
    off = ring.HEADER_SIZE + 1 * ring.RECORD_SIZE
    full = writer._mm[off:off + ring.RECORD_SIZE]
    writer._mm[off + 32:off + ring.RECORD_SIZE] = bytes(32)
    assert reader.poll() == ([], 0) and reader.cursor == 1
    # The same slot holding a half-overwritten older lap mixed with the new entry: rejected too.
    stale = bytearray(full)
    stale[8:16] = (99).to_bytes(8, "little")  # step changed, CRC not
    writer._mm[off:off + ring.RECORD_SIZE] = bytes(stale)
    assert reader.poll() == ([], 0)
    writer._mm[off:off + ring.RECORD_SIZE] = full  # the copy completes
    recs, missed = reader.poll()
    assert [r.step for r in recs] == [2] and missed == 0


def test_writer_refuses_a_file_that_is_not_a_ring(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"x" * 200)
    with pytest.raises(RingError, match="expected b'RWDR' version 1"):
        RingWriter(str(bad))
    short = tmp_path / "short"
    short.write_bytes(b"x")
    with pytest.raises(RingError, match="less than its 64-byte header"):
        RingWriter(str(short))
    with pytest.raises(ValueError, match="capacity = 1 must be an integer >= 2"):
        RingReader.create(str(tmp_path / "c"), 1)


def test_heartbeat_round_trips_and_a_torn_one_reads_as_unknown(tmp_path):
    reader, writer = _pair(tmp_path, 4)
    reader.heartbeat(123.5)
    assert writer.monitor_heartbeat() == 123.5
    writer._mm[ring._BEAT_AT] ^= 0xFF
    assert writer.monitor_heartbeat() is None


def test_sweep_removes_only_rings_of_launchers_that_are_gone(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"robust-wd-{dead.pid}-abcd0123-1-rank0"
    live = tmp_path / f"robust-wd-{os.getpid()}-abcd0123-1-rank0"
    other = tmp_path / "unrelated-file"
    for p in (gone, live, other):
        p.write_bytes(b"")
    assert ring.sweep_stale(tmp_path) == [gone.name]
    assert live.exists() and other.exists() and not gone.exists()


# -- the monitor and the client over rings ---------------------------------------------------------
@pytest.fixture
def ring_env(tmp_path, monkeypatch):
    monkeypatch.setattr(client, "_die_with_parent", lambda: None)
    for var in (protocol.ENV_RUN_DIR, protocol.ENV_INJECT, protocol.ENV_STRAGGLER):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(protocol.ENV_INCARNATION, "0")
    # A NaN's rank asks the monitor whether it is being stopped (hold.py); where a test drives
    # the monitor's checks itself, nobody answers during step_end: wait briefly, not 10 s.
    monkeypatch.setattr(hold, "ANSWER_TIMEOUT_S", 0.1)

    def start(mon, ranks):
        env = mon.worker_env(ranks)
        mon.begin_incarnation({r: os.getpid() for r in ranks})
        clients = {}
        for r in ranks:
            monkeypatch.setenv("RANK", str(r))
            monkeypatch.setenv(protocol.ENV_RING, env[protocol.ENV_RING])
            clients[r] = client._Client(mon.address)
        return env[protocol.ENV_RING], clients

    return start


def test_steps_travel_through_the_ring_with_the_ranks_own_times_and_files_are_removed(tmp_path, ring_env):
    mon = Monitor(WatchdogConfig(), tmp_path, host="h")
    try:
        prefix, clients = ring_env(mon, [0, 1])
        assert all(c.ring is not None for c in clients.values())
        mon.transport.drain()  # the hellos: both ranks mapped their rings, so the names are removed
        assert not any(os.path.exists(f"{prefix}{r}") for r in (0, 1))
        t_steps = []
        for step in range(1, 6):
            for c in clients.values():
                c.step_end(step, 2.0, 1.0)
            t_steps.append(time.monotonic())
            time.sleep(0.05)
        assert mon.check(will_restart=True) is None
        for r in (0, 1):
            prog = mon.ranks[r].progress
            assert prog.last_step == 5 and prog.steps_seen == 5
            # Step times are the rank's own (about 50 ms), not when the monitor happened to poll.
            assert all(0.04 < t < 0.5 for t in prog.step_times) and len(prog.step_times) == 3  # 4 intervals, the first left out (WARM_INTERVALS)
            assert prog.last_progress <= t_steps[-1]
        # The NaN is both in the ring and a datagram; it is judged at its own step.
        clients[1].step_end(6, math.nan, 1.0)
        fault = mon._check(will_restart=True)
        assert (fault.kind, fault.step, fault.suspect_ranks) == ("nan", 6, [1])
    finally:
        mon.close()
        for c in clients.values():
            c.sock.close()
    assert not list(tmp_path.glob("rings/*")) and not os.path.exists(f"{prefix}0")


def test_a_lapped_ring_is_counted_and_logged_and_the_nan_still_arrives(tmp_path, ring_env, caplog):
    mon = Monitor(WatchdogConfig(), tmp_path, host="h", ring_entries=4)
    try:
        _, clients = ring_env(mon, [0])
        with mon.transport.lock:  # a monitor that does not poll while the rank runs ahead
            for step in range(1, 11):
                clients[0].step_end(step, math.inf if step == 3 else 2.0, None)
        with caplog.at_level("WARNING", logger="robust_plugins"):
            fault = mon._check(will_restart=True)
        assert mon.transport.ring_missed == {0: 6} and mon.ranks[0].progress.steps_seen == 4
        assert "rank 0 wrote 6 step records that were overwritten" in caplog.text
        # Step 3's record was overwritten; its datagram was not.
        assert (fault.kind, fault.step, fault.detail["what"]) == ("nan", 3, "loss")
    finally:
        mon.close()
        clients[0].sock.close()


@contextlib.contextmanager
def _agent(mon, clients):
    """What the elastic agent does every monitor interval, in a thread; yields the faults its
    checks returned. Closes the monitor and the clients' sockets afterwards."""
    stop, found = threading.Event(), []

    def loop():
        while not stop.is_set():
            if (fault := mon.check(will_restart=True)) is not None:
                found.append(fault)
            time.sleep(0.02)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join(timeout=5)
        mon.close()
        for c in clients.values():
            c.sock.close()


def test_ok_to_save_answers_once_every_ring_reports_the_step(tmp_path, ring_env, monkeypatch):
    mon = Monitor(WatchdogConfig(), tmp_path, host="h")
    _, clients = ring_env(mon, [0, 1])
    answers = {}
    with _agent(mon, clients):
        clients[0].step_end(1, 2.0, None)
        asker = threading.Thread(target=lambda: answers.setdefault(1, clients[0].ok_to_save(1, 10.0)))
        asker.start()
        time.sleep(0.3)
        assert 1 not in answers  # rank 1 has not written step 1 yet
        clients[1].step_end(1, 2.0, None)
        asker.join(timeout=5)
        assert answers[1] is True
        clients[0].step_end(2, 2.0, None)
        # The NaN's rank is told that the ranks are being stopped and holds (hold.py) until
        # stopped; nothing stops it here, so it stops itself after the hold.
        monkeypatch.setattr(hold, "HOLD_MAX_S", 0.3)
        with pytest.raises(RobustPluginsError, match="the ranks are being stopped"):
            clients[1].step_end(2, float("nan"), None)
        assert clients[0].ok_to_save(2, 5.0) is False


def test_a_ranks_spike_holds_it_until_stopped_and_a_later_question_is_answered_at_once(
        tmp_path, ring_env, monkeypatch):
    """The rank applies the monitor's spike rule to its own values and holds at the spike's step
    (hold.py); a rank that asks after the check found the fault is answered at once."""
    cfg = WatchdogConfig(spike_factor=5, spike_window=8, spike_warmup_steps=3)
    mon = Monitor(cfg, tmp_path, host="h")
    monkeypatch.setenv(protocol.ENV_SPIKE, mon.worker_env([0, 1])[protocol.ENV_SPIKE])
    monkeypatch.setattr(hold, "HOLD_MAX_S", 0.3)
    _, clients = ring_env(mon, [0, 1])
    with _agent(mon, clients) as found:
        for step in range(1, 5):  # warm-up, then normal steps: no question, no hold
            for r in (0, 1):
                clients[r].step_end(step, 2.0, 1.0)
        clients[1].step_end(5, 2.0, 1.0)
        t0 = time.monotonic()
        with pytest.raises(RobustPluginsError, match="rank 0: the node monitor found the spike of step 5"):
            clients[0].step_end(5, 50.0, 1.0)  # 25x the median loss
        assert time.monotonic() - t0 >= 0.3
        assert (found[0].kind, found[0].step, found[0].suspect_ranks) == ("spike", 5, [0])  # (agent: stops here)
        t1 = time.monotonic()
        assert clients[1].ask(5, 5.0) is False and time.monotonic() - t1 < 1.0


def test_a_restarted_rank_takes_over_the_monitors_spike_window_and_holds_at_its_first_step(
        tmp_path, ring_env, monkeypatch):
    """The monitor's spike windows live across incarnations; a restarted rank starts its own from
    them (spike_windows.json), so a spike at its first step after the restart holds it as a later
    one would. With an empty window it trained on: with fast steps, or at the end of a job, the
    ranks then took snapshots until the step before the spike was evicted from memory."""
    cfg = WatchdogConfig(spike_factor=5, spike_window=8, spike_warmup_steps=3)
    mon = Monitor(cfg, tmp_path, host="h")
    monkeypatch.setattr(hold, "HOLD_MAX_S", 0.3)
    clients: dict = {}

    def start():
        env = mon.worker_env([0, 1])
        mon.begin_incarnation({0: os.getpid(), 1: os.getpid()})
        for var in (protocol.ENV_RING, protocol.ENV_SPIKE, protocol.ENV_SPIKE_WINDOWS, protocol.ENV_INCARNATION):
            monkeypatch.setenv(var, env[var])
        for c in clients.values():
            c.sock.close()
        for r in (0, 1):
            monkeypatch.setenv("RANK", str(r))
            clients[r] = client._Client(mon.address)
        return env

    start()
    with _agent(mon, clients) as found:
        for step in range(1, 5):
            for r in (0, 1):
                clients[r].step_end(step, 2.0 + 0.1 * r, 1.0)
        env = start()  # a restart that resumes at step 2 (the values of 3 and 4 stay in the windows)
        windows = json.loads(Path(env[protocol.ENV_SPIKE_WINDOWS]).read_text())
        assert windows == {"incarnation": 1, "ranks": {"0": {"loss": [2.0] * 4, "grad_norm": [1.0] * 4},
                                                       "1": {"loss": [2.1] * 4, "grad_norm": [1.0] * 4}}}
        assert clients[0].spikes.medians["loss"].values == deque([2.0] * 4, maxlen=8)
        clients[1].step_end(3, 2.1, 1.0)
        with pytest.raises(RobustPluginsError, match="rank 0: the node monitor found the spike of step 3"):
            clients[0].step_end(3, 50.0, 1.0)  # 25x the median, at the first step of the incarnation
        assert (found[-1].kind, found[-1].step, found[-1].suspect_ranks) == ("spike", 3, [0])


def test_a_rank_without_its_spike_windows_says_so_and_starts_empty(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="robust_plugins"):
        watch = hold.SpikeWatch("5,8,3", str(tmp_path / "missing.json"), rank=0, incarnation=1)
        assert watch.medians["loss"].values == deque() and "cannot take over the monitor's spike windows" in caplog.text
        (tmp_path / "old.json").write_text(json.dumps({"incarnation": 0, "ranks": {"0": {"loss": [1.0]}}}))
        watch = hold.SpikeWatch("5,8,3", str(tmp_path / "old.json"), rank=0, incarnation=1)
    assert watch.medians["loss"].values == deque() and "written for incarnation 0, this is 1" in caplog.text


def test_a_rank_warns_once_when_the_monitor_stops_reading(tmp_path, ring_env, monkeypatch, caplog):
    from robust_plugins import _logging

    monkeypatch.setattr(_logging, "_WARNED", set())
    mon = Monitor(WatchdogConfig(), tmp_path, host="h")
    try:
        _, clients = ring_env(mon, [0])
        c = clients[0]
        with caplog.at_level("WARNING", logger="robust_plugins"):
            c.step_end(1, 2.0, None)  # heartbeat from the ring's creation: fresh
            assert "has not read" not in caplog.text
            mon.transport._rings[0].heartbeat(time.monotonic() - client.MONITOR_STALE_S - 5)
            c._next_beat_check = 0.0
            c.step_end(2, 2.0, None)
        assert "the node monitor has not read rank 0's step ring for 6" in caplog.text
        assert c.ring.written == 2  # training went on
    finally:
        mon.close()
        clients[0].sock.close()


def test_a_rank_without_its_ring_file_says_so_and_sends_datagrams(tmp_path, ring_env, monkeypatch, caplog):
    mon = Monitor(WatchdogConfig(), tmp_path, host="h")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(protocol.ENV_RING, str(tmp_path / "no-such-ring-"))
    mon.begin_incarnation({0: os.getpid()})
    try:
        with caplog.at_level("WARNING", logger="robust_plugins"):
            c = client._Client(mon.address)
        assert c.ring is None and "cannot map its step ring" in caplog.text
        c.step_end(1, 2.0, None)
        assert mon.check(will_restart=True) is None and mon.ranks[0].progress.last_step == 1
    finally:
        mon.close()
        c.sock.close()

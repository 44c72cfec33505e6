"""The monitor's bounded wait for emergency saves, fed real datagrams on its socket (no ranks)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from robust_plugins.config import WatchdogConfig
from robust_plugins.watchdog.emergency_rank import _is_collective_failure
from robust_plugins.launcher.monitor import Monitor


# The monitor's bound on the wait. Timing bounds below derive from it: a wait that ran lasts at
# least ~TIMEOUT_S and at most TIMEOUT_S + a slack for a loaded machine; no wait stays far under it.
TIMEOUT_S = 2.0
SLACK_S = 3.0


@pytest.fixture
def monitor(tmp_path):
    mon = Monitor(WatchdogConfig(emergency_save_timeout_s=TIMEOUT_S), tmp_path / "run")
    dead = subprocess.Popen(["true"])
    dead.wait()
    mon.begin_incarnation({0: os.getpid(), 1: dead.pid})  # rank 0 alive, rank 1 gone
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def send(rank, **msg):
        sock.sendto(json.dumps({"k": "emerg", "r": rank, "i": 0, "t": time.time(), **msg}).encode(),
                    mon.address)

    mon.send = send
    yield mon
    sock.close()
    mon.close()


def _crash(mon):
    return mon.on_crash({1: SimpleNamespace(exitcode=-9, timestamp=0)}, will_restart=True)


def test_a_finished_save_is_recorded_per_rank(monitor):
    monitor.send(0, phase="registered")
    monitor.send(1, phase="registered")
    monitor.send(0, phase="start", s=6)
    monitor.send(0, phase="done", s=6, ok=True, sec=0.01)
    fault = _crash(monitor)
    saves = fault.detail["emergency_save"]
    assert saves["0"] == {"step": 6, "ok": True, "seconds": 0.01}
    assert saves["1"]["ok"] is False and "not started" in saves["1"]["error"]


def test_the_wait_is_bounded(monitor):
    monitor.send(0, phase="registered")
    monitor.send(0, phase="start", s=3)  # never finishes
    t0 = time.monotonic()
    saves = _crash(monitor).detail["emergency_save"]
    waited = time.monotonic() - t0
    assert 0.9 * TIMEOUT_S <= waited < TIMEOUT_S + SLACK_S, waited
    assert saves["0"]["ok"] is False and "not finished within" in saves["0"]["error"]


def test_no_saver_means_no_wait_and_null(monitor):
    t0 = time.monotonic()
    assert _crash(monitor).detail["emergency_save"] is None
    waited = time.monotonic() - t0
    assert waited < TIMEOUT_S / 2, waited  # did not wait for the bound


def test_collective_failures_are_recognised():
    import torch.distributed as dist

    assert _is_collective_failure(dist.DistBackendError("x"))
    assert _is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert not _is_collective_failure(RuntimeError("shape mismatch"))
    assert not _is_collective_failure(ValueError("Connection closed by peer"))


RANK_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from robust_plugins.watchdog import client, emergency_rank

out = Path(sys.argv[1])

def save(step):
    # The agent's stop, arriving while the save runs (as it does when the agent sees the dead
    # peer as soon as this rank does).
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
    (out / "saved").write_text(str(step))

emergency_rank.on_emergency(save)
client.step_end(5)
raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
"""


def test_a_sigterm_during_the_emergency_save_is_held_then_acted_on(tmp_path):
    # A SIGTERM that arrives during the save must neither cut it short nor be lost: lost, the rank
    # outlived its stop and the agent waited out torch's 30 s grace (seen in the demo).
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    addr = str(tmp_path / "monitor.sock")
    sock.bind(addr)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "ROBUST_WATCHDOG_SOCKET": addr, "RANK": "0", "ROBUST_EMERGENCY_TIMEOUT_S": "10"}
    env.pop("ROBUST_RUN_DIR", None)
    env.pop("ROBUST_WATCHDOG_RING", None)
    try:
        proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True,
                              text=True, timeout=120)
    finally:
        sock.close()
    assert (tmp_path / "saved").read_text() == "5"  # the save ran to its end
    assert "emergency save of step 5 done" in proc.stderr, proc.stderr
    assert "Connection reset by peer" in proc.stderr  # the exception was reported first
    assert proc.returncode == -15, (proc.returncode, proc.stderr[-2000:])  # then the held SIGTERM ended it


def test_the_stop_waits_for_a_save_that_starts_within_the_grace(monitor):
    # torch's stop after a crash first calls hold_for_emergency_saves: a live rank that reaches
    # its failing collective a moment later still saves, and the stop waits only as long as that.
    import threading

    monitor.send(0, phase="registered")

    def late_rank():
        time.sleep(0.3)
        monitor.send(0, phase="start", s=6)
        time.sleep(0.3)
        monitor.send(0, phase="done", s=6, ok=True, sec=0.3)

    threading.Thread(target=late_rank).start()
    t0 = time.monotonic()
    monitor.hold_for_emergency_saves()
    held = time.monotonic() - t0
    assert 0.5 <= held < TIMEOUT_S, held
    fault = _crash(monitor)
    assert fault.detail["emergency_save"]["0"]["ok"] is True
    assert fault.detail["emergency_hold_s"] == pytest.approx(held, abs=0.05)


def test_a_rank_that_never_starts_holds_the_stop_only_for_the_grace(tmp_path):
    # Rank 0 is alive and registered but never fails a collective (NCCL blocks until its own
    # timeout): the stop waits EMERGENCY_START_MIN_S, not the 10 s emergency_save_timeout_s.
    from robust_plugins.launcher.monitor.emergency import EMERGENCY_START_MIN_S

    mon = Monitor(WatchdogConfig(emergency_save_timeout_s=10.0), tmp_path / "run")
    try:
        mon.begin_incarnation({0: os.getpid()})
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.sendto(json.dumps({"k": "emerg", "r": 0, "i": 0, "t": time.time(),
                                "phase": "registered"}).encode(), mon.address)
        sock.close()
        t0 = time.monotonic()
        mon.hold_for_emergency_saves()
        held = time.monotonic() - t0
        assert EMERGENCY_START_MIN_S * 0.9 <= held < EMERGENCY_START_MIN_S + SLACK_S, held
    finally:
        mon.close()


def test_only_torchs_stop_after_a_failure_is_held():
    # patches.torch_elastic.before_failure_stop: the poll's close() (no signal) runs the hold
    # first; a stop that names a signal (the agent's own) does not; the block's end undoes it.
    import signal

    from robust_plugins.patches import torch_elastic

    calls = []

    class Context:
        def close(self, death_sig=None, timeout=30):
            calls.append(("close", death_sig))

    agent = SimpleNamespace(_pcontext=Context())
    with torch_elastic.before_failure_stop(agent, lambda: calls.append(("hold", None))):
        agent._pcontext.close()
        agent._pcontext.close(signal.SIGKILL)
    agent._pcontext.close()
    assert calls == [("hold", None), ("close", None), ("close", signal.SIGKILL), ("close", None)]
    assert "close" not in vars(agent._pcontext)


@pytest.mark.timeout(60)
def test_which_ranks_the_monitor_asks_to_save():
    from robust_plugins.launcher.monitor.emergency import asks_rank

    assert asks_rank("auto", "cuda") and asks_rank("monitor", "cpu") and asks_rank("monitor", None)
    assert not asks_rank("auto", "cpu") and not asks_rank("auto", None)  # gloo raises: its hook saves
    assert not asks_rank("exception", "cuda") and not asks_rank(None, "cuda")


@pytest.mark.timeout(60)
def test_the_monitor_asks_an_nccl_ranks_listener_and_records_the_save_via_monitor(monitor):
    # Rank 0's collectives move CUDA tensors ("comm"): a dead peer raises nothing there, so the
    # monitor asks its listener (the address its registration came from) before the stop.
    import threading

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("")  # Linux autobind, as the rank's listener does
    listener.settimeout(10)

    def from_listener(**msg):
        listener.sendto(json.dumps({"r": 0, "i": 0, "t": time.time(), **msg}).encode(), monitor.address)

    from_listener(k="comm", dev="cuda")
    from_listener(k="emerg", phase="registered", via="auto")
    asked = []

    def rank() -> None:
        asked.append(json.loads(listener.recv(4096)))
        monitor.send(0, phase="start", s=6, via="monitor")
        monitor.send(0, phase="done", s=6, ok=True, sec=0.2, via="monitor")

    t = threading.Thread(target=rank)
    t.start()
    try:
        monitor.hold_for_emergency_saves()
        t.join(10)
    finally:
        listener.close()
    assert asked == [{"k": "emerg_now"}]
    saves = _crash(monitor).detail["emergency_save"]
    assert saves["0"] == {"step": 6, "ok": True, "seconds": 0.2, "via": "monitor"}


class _FakeClient:
    rank, incarnation, last_step, can_ask, device = 0, 0, 5, True, None

    def __init__(self, mark=None):
        self.step_mark = mark
        self.sent = []

    def send(self, msg, wait=False):
        self.sent.append(msg)


@pytest.mark.timeout(60)
def test_the_monitor_path_saves_only_a_state_the_device_had_finished(monkeypatch, capsys):
    from robust_plugins.watchdog import emergency_rank

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    saved = []
    for done, ok in ((False, False), (True, True)):
        monkeypatch.setattr(emergency_rank, "_emergency", {"save": saved.append})
        client = _FakeClient(Event(done))
        emergency_rank._save_when_asked(client)
        emergency_rank._save_when_asked(client)  # asked twice: saved once
        (start, end) = client.sent
        assert start["phase"] == "start" and start["via"] == "monitor" and end["ok"] is ok, client.sent
        if not ok:
            assert "had not finished the work queued before step 5" in end["error"]
    assert saved == [5]
    assert "emergency save of step 5 done" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_listener_answers_an_ask_that_comes_long_after_its_registration(monkeypatch, tmp_path):
    # The rank's real listener: it registers (a send that may wait for room), then an ask comes
    # later than that wait's bound (a loaded machine's slow steps). Its thread must still read it.
    from robust_plugins.watchdog import emergency_rank

    monkeypatch.setattr(emergency_rank, "WAIT_SEND_S", 0.2)
    monitor_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    monitor_sock.bind(str(tmp_path / "monitor.sock"))
    monitor_sock.settimeout(10)
    client = _FakeClient()
    client.address = str(tmp_path / "monitor.sock")
    asked = []
    monkeypatch.setattr(emergency_rank, "_save_when_asked", asked.append)
    for _ in range(5):  # each a fresh listener: its thread may enter recv during the send
        listener = emergency_rank._Listener(client)
        listener.send(client, {"k": "emerg", "phase": "registered", "via": "monitor"})
        registration, addr = monitor_sock.recvfrom(4096)
        assert json.loads(registration)["phase"] == "registered" and addr
        time.sleep(0.5)  # past WAIT_SEND_S
        monitor_sock.sendto(json.dumps({"k": "emerg_now"}).encode(), addr)
        deadline = time.monotonic() + 10
        while len(asked) < _ + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(asked) == _ + 1 and listener._thread.is_alive()
        listener.sock.close()
    monitor_sock.close()


@pytest.mark.timeout(60)
def test_the_listener_thread_saves_on_the_device_the_training_thread_chose(monkeypatch, tmp_path):
    # The current CUDA device is per thread and a new thread starts on GPU 0. Played here with a
    # per-thread device in place of CUDA's: the training thread of local rank 3 chose cuda:3; the
    # monitor's ask arrives on the listener thread, whose own device is cuda:0. The save must run
    # on cuda:3, its side stream too.
    import threading

    import robust_plugins.device as device_mod
    from robust_plugins.watchdog import emergency_rank

    current = threading.local()
    streams = []
    monkeypatch.setattr(device_mod, "thread_device", lambda: getattr(current, "dev", "cuda:0"))
    monkeypatch.setattr(device_mod, "set_thread_device", lambda dev: setattr(current, "dev", dev))
    monkeypatch.setattr(device_mod, "current_stream", lambda dev: None)
    monkeypatch.setattr(device_mod, "side_stream", lambda dev: streams.append(dev))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # on_emergency chains its hook
    monkeypatch.setattr(emergency_rank, "_emergency", {})
    monkeypatch.setenv(emergency_rank.ENV_VIA, "monitor")
    monitor_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    monitor_sock.bind(str(tmp_path / "monitor.sock"))
    monitor_sock.settimeout(10)
    client = _FakeClient()
    client.address = str(tmp_path / "monitor.sock")
    monkeypatch.setattr(emergency_rank, "get_client", lambda: client)
    saves = []
    current.dev = "cuda:3"  # the training thread: torch.cuda.set_device(LOCAL_RANK)
    emergency_rank.on_emergency(lambda step: saves.append((step, threading.current_thread().name,
                                                           device_mod.thread_device())))
    try:
        registration, addr = monitor_sock.recvfrom(4096)
        assert json.loads(registration)["phase"] == "registered"
        monitor_sock.sendto(json.dumps({"k": "emerg_now"}).encode(), addr)
        deadline = time.monotonic() + 10
        while not saves and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        emergency_rank._emergency["listener"].sock.close()
        monitor_sock.close()
    assert saves == [(5, "robust-emergency-save", "cuda:3")], saves
    assert streams == ["cuda:3"]
    assert getattr(current, "dev") == "cuda:3"  # the training thread's own choice is untouched
    assert client.sent[-1]["phase"] == "done" and client.sent[-1]["ok"] is True

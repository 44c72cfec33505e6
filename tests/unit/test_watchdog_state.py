"""The watchdog's checkpointed state: a rank's step times round-trip through ``state_dict`` and
seed a fresh monitor's learned hang timeout (once per rank, never over its own measurements)."""

from __future__ import annotations

import json
import socket
import time

import torch

from robust_plugins.config import WatchdogConfig
from robust_plugins.watchdog import client, detect, protocol
from _wait import wait_for as _wait_for


def test_state_is_empty_outside_robust_run(monkeypatch):
    monkeypatch.delenv(protocol.ENV_SOCKET, raising=False)
    monkeypatch.setattr(client, "_client", None)
    monkeypatch.setattr(client, "_checked", False)
    assert client.state_dict() == {}
    client.load_state_dict({"format": 1, "step_times": [1.0]})  # no-op, no error


def test_saved_step_times_seed_a_fresh_monitor_and_survive_weights_only_loads(tmp_path, monkeypatch):
    from robust_plugins.launcher.monitor import Monitor

    cfg = WatchdogConfig(hang_warmup_steps=5, hang_factor=10, hang_min_timeout_s=2,
                         hang_initial_timeout_s=100, hang_max_timeout_s=200)
    mon = Monitor(cfg, tmp_path, host="h")
    try:
        mon.begin_incarnation({0: 100, 1: 101})
        monkeypatch.setenv(protocol.ENV_SOCKET, mon.address)
        monkeypatch.delenv(protocol.ENV_RUN_DIR, raising=False)
        monkeypatch.delenv(protocol.ENV_INJECT, raising=False)
        monkeypatch.setattr(client, "_die_with_parent", lambda: None)
        saved = {"format": 1, "step_times": [0.5] * 20}
        path = tmp_path / "ckpt.pt"
        torch.save({"watchdog": saved}, path)
        loaded = torch.load(path, weights_only=True)["watchdog"]
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setattr(client, "_client", None)
            monkeypatch.setattr(client, "_checked", False)
            client.load_state_dict(loaded)
            assert client.state_dict()["step_times"] == [0.5] * 20  # saved again with the next save
            client.load_state_dict(loaded)  # a second load of the same rank: the monitor takes one
        assert _wait_for(lambda: len(mon._history) == 40)
        time.sleep(0.3)
        assert len(mon._history) == 40 and mon._seeded == {0, 1}
        # The learned timeout applies after the first step of the relaunched job: 10 x 0.5 s.
        progress = {r: detect.RankProgress(last_step=21, last_progress=0.0, steps_seen=1) for r in (0, 1)}
        stalled, timeout = detect.stalled_ranks(cfg, progress, now=6.0, history=mon._history)
        assert timeout == 5.0 and stalled == [0, 1]
    finally:
        mon.close()


def test_a_monitor_that_measured_steps_itself_ignores_saved_times(tmp_path):
    from robust_plugins.launcher.monitor import Monitor

    mon = Monitor(WatchdogConfig(), tmp_path, host="h")
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        mon.begin_incarnation({0: 100})
        for step in (1, 2, 3):  # two intervals: the first is left out (detect.WARM_INTERVALS)
            tx.sendto(json.dumps({"k": "end", "r": 0, "i": 0, "s": step, "t": 0.0}).encode(), mon.address)
        assert _wait_for(lambda: mon.ranks[0].progress.step_times)
        tx.sendto(json.dumps({"k": "history", "r": 0, "i": 0, "t": 0.0, "times": [9.0] * 5}).encode(),
                  mon.address)
        time.sleep(0.3)
        assert mon._history == []
    finally:
        tx.close()
        mon.close()

"""Skipping a batch that spikes again after the rollback, without processes: the monitor counts
spikes per step over incarnations, records the step, and tells the next ranks; the client's
``skip_batch`` and the ``badbatch`` injection."""

from __future__ import annotations

import json
import socket

import pytest

from robust_plugins.config import PluginConfig, WatchdogConfig
from robust_plugins.errors import ConfigError
from robust_plugins.watchdog import client, inject, protocol
from _wait import wait_for as _wait_for


def _spike_run(mon, tx, incarnation: int, spike_step: int, upto: int) -> None:
    mon.begin_incarnation({0: 100 + incarnation, 1: 200 + incarnation})
    for step in range(1, upto + 1):
        for r in (0, 1):
            loss = 1000.0 if (r == 1 and step == spike_step) else 2.0
            tx.sendto(json.dumps({"k": "end", "r": r, "i": incarnation, "s": step, "t": 0.0,
                                  "l": loss}).encode(), mon.address)
    assert _wait_for(lambda: all(mon.ranks[r].progress.last_step == upto for r in (0, 1)))


def test_a_step_that_spikes_in_two_incarnations_is_recorded_and_handed_to_the_next_ranks(tmp_path):
    from robust_plugins.launcher.monitor import Monitor

    cfg = WatchdogConfig(spike_warmup_steps=3)
    mon = Monitor(cfg, tmp_path, host="h")
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        _spike_run(mon, tx, 0, spike_step=6, upto=7)
        first = mon.check(will_restart=True)
        assert (first.kind, first.step, first.detail["skip_batch"]) == ("spike", 6, False)
        assert mon.worker_env()[protocol.ENV_SKIP] == "" and not (tmp_path / "skip_steps.json").exists()
        _spike_run(mon, tx, 1, spike_step=6, upto=7)  # the replay spikes again: the batch is bad
        second = mon.check(will_restart=True)
        assert (second.kind, second.step, second.detail["skip_batch"]) == ("spike", 6, True)
        assert "skip its batch" in second.detail["reason"]
        assert mon.worker_env()[protocol.ENV_SKIP] == "6"
    finally:
        tx.close()
        mon.close()
    assert json.loads((tmp_path / "skip_steps.json").read_text())["steps"] == [6]
    # A relaunch with the same run directory keeps skipping it.
    again = Monitor(cfg, tmp_path, host="h")
    try:
        assert again.worker_env()[protocol.ENV_SKIP] == "6"
    finally:
        again.close()


def test_spike_skip_batch_off_never_skips(tmp_path):
    from robust_plugins.launcher.monitor import Monitor

    mon = Monitor(WatchdogConfig(spike_warmup_steps=3, spike_skip_batch=False), tmp_path, host="h")
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        for inc in (0, 1):
            _spike_run(mon, tx, inc, spike_step=6, upto=7)
            assert mon.check(will_restart=True).detail["skip_batch"] is False
        assert mon.worker_env()[protocol.ENV_SKIP] == ""
    finally:
        tx.close()
        mon.close()
    with pytest.raises(ConfigError, match="spike_skip_batch must be true or false"):
        PluginConfig.from_dict({"watchdog": {"spike_skip_batch": "yes"}})


def test_skip_batch_is_false_outside_robust_run_and_reads_the_steps_inside(monkeypatch):
    monkeypatch.delenv(protocol.ENV_SOCKET, raising=False)
    monkeypatch.setenv(protocol.ENV_SKIP, "6")
    assert client.skip_batch(6) is False
    monkeypatch.setenv(protocol.ENV_SOCKET, "/nonexistent/monitor.sock")
    assert client.skip_batch(6) is True and client.skip_batch(7) is False
    assert protocol.parse_skip_steps("25, 40,") == {25, 40}


def test_badbatch_fires_on_every_replay_but_not_on_a_skipped_batch(tmp_path, monkeypatch):
    (bad,) = inject.parse("badbatch:rank=0,step=3")
    assert bad.spec() == "badbatch:rank=0,step=3,what=loss" and bad.kind in inject.RECURRING_KINDS
    path = str(tmp_path / "m.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    srv.settimeout(5)
    monkeypatch.setenv(protocol.ENV_SOCKET, path)
    monkeypatch.setenv(protocol.ENV_INJECT, bad.spec())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(protocol.ENV_RUN_DIR, raising=False)
    monkeypatch.setattr(client, "_die_with_parent", lambda: None)
    try:
        for skip, expect in (("", 2000.0), ("3", None)):
            monkeypatch.setenv(protocol.ENV_SKIP, skip)
            monkeypatch.setattr(client, "_client", None)
            monkeypatch.setattr(client, "_checked", False)
            client.step_end(3, loss=None if skip else 2.0)
            msgs = [json.loads(srv.recv(65536)) for _ in range(3 if not skip else 2)]
            end = msgs[-1]
            assert end["k"] == "end" and end["l"] == expect
            assert ("inject" in [m["k"] for m in msgs]) == (not skip)
    finally:
        srv.close()

"""Step signals when the node monitor is behind: plain steps may be dropped, a NaN may not."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

from robust_plugins.watchdog.client import _Client


def _received(sock: socket.socket) -> list[dict]:
    out = []
    sock.setblocking(False)
    while True:
        try:
            out.append(json.loads(sock.recv(65536)))
        except BlockingIOError:
            return out


def test_nan_signal_waits_for_room_where_a_plain_step_is_dropped(tmp_path, monkeypatch):
    monkeypatch.delenv("ROBUST_RUN_DIR", raising=False)
    address = str(tmp_path / "monitor.sock")
    monitor = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    monitor.bind(address)
    client = _Client(address)
    try:
        step = 0
        while client.dropped == 0:  # a monitor that does not read: the queue fills up
            step += 1
            client.step_end(step, 1.0, 1.0)
            assert step < 10_000, "the datagram queue never filled"
        plain_dropped = client.dropped
        # The monitor catches up a moment later; the NaN step must still reach it.
        drained: list[dict] = []
        reader = threading.Timer(0.3, lambda: drained.extend(_received(monitor)))
        reader.start()
        t0 = time.monotonic()
        client.step_end(step + 1, math.nan, 1.0)
        waited = time.monotonic() - t0
        reader.join()
        drained.extend(_received(monitor))
        nan_steps = [m for m in drained if m.get("k") == "end" and m["s"] == step + 1]
        assert len(nan_steps) == 1 and math.isnan(nan_steps[0]["l"])
        assert client.dropped == plain_dropped, "the NaN signal was dropped"
        assert waited >= 0.2, f"the NaN signal did not wait for room ({waited:.3f} s)"
    finally:
        client.sock.close()
        monitor.close()

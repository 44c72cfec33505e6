"""The one timing helper: which clock times which device, warm-up per key, host timing on CPU."""

from __future__ import annotations

import time

import pytest
import torch

from robust_plugins import timing
from robust_plugins.comm import WireCounter, wire


@pytest.mark.parametrize("device, clock", [
    ("cuda", timing.CUDA_EVENTS), ("cuda:3", timing.CUDA_EVENTS), (torch.device("cuda", 1), timing.CUDA_EVENTS),
    ("cpu", timing.PERF_COUNTER), (torch.device("cpu"), timing.PERF_COUNTER), (None, timing.PERF_COUNTER),
    ("meta", timing.PERF_COUNTER),
])
def test_clock_for_picks_cuda_events_only_for_cuda_devices(device, clock):
    assert timing.clock_for(device) == clock
    assert timing.warmup_runs(device) == (1 if clock == timing.CUDA_EVENTS else 0)


def test_host_clock_times_host_work():
    clock = timing.Clock("cpu").start()
    time.sleep(0.05)
    seconds = clock.stop()
    assert clock.kind == timing.PERF_COUNTER
    assert 0.045 < seconds < 1.0 and clock.seconds() == seconds and clock.done()
    assert clock.stop(wait=False) > 0  # no deferred reading on the host
    result, took = timing.timed(lambda: time.sleep(0.02) or "ok", torch.device("cpu"))
    assert result == "ok" and 0.015 < took < 1.0


def test_cuda_clock_records_events_on_the_current_stream(monkeypatch):
    """The CUDA branch, with a fake event API: events on the device's current stream, the time read
    from them (not the host's), and nothing recorded while a CUDA graph is being captured."""
    recorded = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self, stream):
            recorded.append(stream)
            self.t = 10.0 * len(recorded)

        def query(self):
            return True

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 100.0  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", str(device)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    clock = timing.Clock("cuda:1").start()
    assert clock.kind == timing.CUDA_EVENTS
    assert clock.stop(wait=False) is None and clock.done()
    assert clock.seconds() == pytest.approx(1.0)  # (20 - 10) * 100 ms
    assert recorded == [("stream of", "cuda:1")] * 2
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert timing.Clock("cuda:1").start().stop() == 0.0 and len(recorded) == 2


def test_warmup_runs_each_key_once_on_a_device_and_never_on_the_host():
    book, calls = timing.Warmup(), []
    assert book.ensure(("run", (0, 1), "flat none"), lambda: calls.append("a"), "cuda:0") == 1
    assert book.ensure(("run", (0, 1), "flat none"), lambda: calls.append("a"), "cuda:0") == 0
    assert book.ensure(("run", (0, 1), "hier int8"), lambda: calls.append("b"), "cuda:0") == 1
    assert book.ensure(("run", (2, 3), "flat none"), lambda: calls.append("c"), "cuda:0") == 1
    assert calls == ["a", "b", "c"]
    assert book.ensure("host", lambda: calls.append("d"), "cpu") == 0 and book.seen("host")
    assert book.ensure("two", lambda: calls.append("e"), "cpu", runs=2) == 2
    book.forget(("run", (0, 1), "flat none"))
    assert book.ensure(("run", (0, 1), "flat none"), lambda: calls.append("a"), "cuda:0") == 1
    assert calls == ["a", "b", "c", "e", "e", "a"]


def test_timed_runs_warms_up_once_per_group_and_name_where_the_device_needs_it(monkeypatch):
    """auto_measure.timed_runs gives each (group, name) one untimed run before its first timed one on a
    GPU, none on the CPU (run here without a process group)."""
    from robust_plugins.comm import auto_measure

    book, runs = timing.Warmup(), []
    monkeypatch.setattr(auto_measure, "WARMUP", book)
    tensor = torch.ones(8)
    auto_measure.timed_runs(tensor, ("a", "b"), lambda name, t: runs.append(name), None, rounds=2)
    assert runs == ["a", "b", "a", "b"]  # CPU: no warm-up run
    runs.clear()
    book.forget()
    monkeypatch.setattr(auto_measure, "Clock", lambda device: timing.Clock("cpu"))
    monkeypatch.setattr(timing, "warmup_runs", lambda device: 1)  # a device that needs one
    auto_measure.timed_runs(tensor, ("a", "b"), lambda name, t: runs.append(name), None)
    auto_measure.timed_runs(tensor, ("a", "c"), lambda name, t: runs.append(name), None)
    assert runs == ["a", "b", "a", "b", "c", "a", "c"]


def test_wire_counter_times_cpu_calls_on_the_host_and_folds_device_clocks_when_read():
    """CPU calls add host seconds at once (as before); a device clock handed in (what a CUDA call or
    a pipelined wait reports) is read when ``seconds`` is."""

    class Deferred(timing.Clock):
        def __init__(self, s, finished):
            super().__init__(None)
            self.s, self.finished = s, finished

        def done(self):
            return self.finished

        def seconds(self):
            return self.s

    with WireCounter(timing_only=True) as counter:
        counter._add("all_reduce", 0, None, 0.25)
        counter._add("all_reduce", 0, None, Deferred(0.5, finished=False))
        assert counter._seconds == 0.25 and len(counter._pending) == 1  # not read yet: no wait
        wire.add_wait_seconds(Deferred(1.0, finished=True))
        assert counter._seconds == 0.25 and len(counter._pending) == 2  # behind the unfinished one
        assert counter.seconds == pytest.approx(1.75) and not counter._pending
        assert counter.calls["all_reduce"] == 2


def test_wire_device_of_finds_the_calls_tensor():
    t = torch.zeros(2)
    assert wire._device_of((t,), {}) == torch.device("cpu")
    assert wire._device_of(([t, t], t), {}) == torch.device("cpu")
    assert wire._device_of((), {"tensor": t}) == torch.device("cpu")
    assert wire._device_of((None, 3), {"group": None}) is None


@pytest.mark.timeout(60)
def test_wire_counter_picks_how_to_time_a_call_by_what_it_returned():
    """The branch selection of collective timing (what NCCL returns is only known on a GPU)."""
    import torch.distributed.distributed_c10d as c10d

    class Work:  # anything with a future: an async_op call's work
        def get_future(self):
            return None

    assert wire.timing_path(None, coalescing=False) == "sync"
    assert wire.timing_path(Work(), coalescing=False) == "future"
    assert wire.timing_path(object(), coalescing=False) == "launch"  # no future to watch
    assert wire.timing_path(c10d._IllegalWork(), coalescing=False) == "launch"
    assert wire.timing_path(None, coalescing=True) == "coalesced"
    assert wire.timing_path(Work(), coalescing=True) == "coalesced"


@pytest.mark.timeout(60)
def test_settled_seconds_folds_finished_clocks_in_any_order_and_never_waits():
    class Deferred(timing.Clock):
        def __init__(self, s, finished):
            super().__init__(None)
            self.s, self.finished = s, finished

        def done(self):
            return self.finished

        def seconds(self):
            if not self.finished:
                pytest.fail("settled_seconds waited for an unfinished clock")
            return self.s

    with WireCounter(timing_only=True) as counter:
        late = Deferred(2.0, finished=False)
        counter._add("all_reduce", 0, None, late)  # an async collective still running
        counter._add("all_reduce", 0, None, Deferred(0.5, finished=True))
        assert counter.settled_seconds() == pytest.approx(0.5)
        late.finished = True
        assert counter.settled_seconds() == pytest.approx(2.5) and not counter._pending


@pytest.mark.timeout(60)
def test_coalesced_nccl_p2p_work_is_timed_at_its_launch_never_through_a_future():
    """batch_isend_irecv on NCCL ends in one coalesced work that carries no future: the counter
    times such a block at its launch and never calls get_future on it (``.then`` on a missing
    future may abort the process). A coalesced collective, or any block on the CPU, keeps its
    future's completion time. The CUDA clock is imitated (no events recorded: stop() reads 0)."""
    import torch.distributed.distributed_c10d as c10d

    assert not wire.coalesced_future_usable(True, timing.CUDA_EVENTS)
    assert wire.coalesced_future_usable(False, timing.CUDA_EVENTS)
    assert wire.coalesced_future_usable(True, timing.PERF_COUNTER)

    asked = []

    class Work:
        def get_future(self):
            asked.append(self)
            raise RuntimeError("a work without a future")

    with WireCounter(timing_only=True) as counter:
        for p2p, kind in ((True, timing.CUDA_EVENTS), (False, timing.CUDA_EVENTS), (True, timing.PERF_COUNTER)):
            clock = timing.Clock(None)
            clock.kind = kind  # imitates a CUDA clock whose start recorded no event
            wire._tls.coalesced = (object(), clock, [counter], None, p2p)
            c10d._CoalescingManager().append(Work())
            assert getattr(wire._tls, "coalesced", None) is None
    assert len(asked) == 2, "get_future was called on NCCL's coalesced point-to-point work"

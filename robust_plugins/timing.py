"""One clock for every measurement that feeds a decision or a metric: CUDA events on a CUDA device,
``time.perf_counter`` on the host.

On a CUDA device the host returns from a kernel launch, and from an NCCL collective, as soon as the
work is queued: a host timer around it measures the launch (microseconds), not the work. The
clock here records a CUDA event on the device's *current* stream (per thread, so a side thread on
its own stream times its own stream) before the work and another after it, and reads the time
between them once the second has completed. Work queued on another stream counts only once the
current stream waits for it: a collective's synchronous call, or ``work.wait()`` of an
``async_op`` call, makes the current stream wait for the NCCL stream, so record :meth:`Clock.stop`
after that wait, as every caller in the package does.

The first collective on a group (NCCL builds its communicator lazily) and the first launch of a
Triton kernel (JIT compilation) take seconds, which no later call pays: :class:`Warmup` runs each
measured thing once, untimed, per key (group, route), on a CUDA device. On the host (gloo builds
its connections in ``new_group``; plain-torch codecs compile nothing) it runs nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable

import torch

#: The two clocks, as :func:`clock_for` names them.
CUDA_EVENTS = "cuda_events"
PERF_COUNTER = "perf_counter"


def clock_for(device: torch.device | str | None) -> str:
    """The clock that times work on ``device`` (pure): :data:`CUDA_EVENTS` for a CUDA device,
    :data:`PERF_COUNTER` for the CPU (and for None: no tensor, host work)."""
    if device is None:
        return PERF_COUNTER
    kind = torch.device(device).type
    return CUDA_EVENTS if kind == "cuda" else PERF_COUNTER


def warmup_runs(device: torch.device | str | None) -> int:
    """Untimed runs :class:`Warmup` gives a key before its first measurement (pure): 1 where the
    first run pays for communicator init and JIT (a CUDA device), 0 on the host."""
    return 1 if clock_for(device) == CUDA_EVENTS else 0


def _capturing() -> bool:
    # A stream being captured into a CUDA graph cannot record timing events; nothing runs then anyway.
    return torch.cuda.is_current_stream_capturing()


class Clock:
    """Times one piece of work on ``device``: ``c = Clock(dev); c.start(); work(); s = c.stop()``.

    On CUDA :meth:`stop` records the end event and, unless ``wait=False``, waits for it and returns
    the seconds between the events; with ``wait=False`` it returns None and :meth:`seconds` reads
    the time later (a counter that must not stall the host at every collective). While the current
    stream is being captured into a CUDA graph nothing is recorded and the time is 0.
    """

    __slots__ = ("kind", "device", "_t0", "_t1", "_events")

    def __init__(self, device: torch.device | str | None):
        self.device = torch.device(device) if device is not None else None
        self.kind = clock_for(self.device)
        self._t0 = self._t1 = 0.0
        self._events: tuple[Any, Any] | None = None

    def start(self) -> "Clock":
        """Mark the start (an event on the current stream, or the host time)."""
        if self.kind == CUDA_EVENTS:
            if _capturing():
                self._events = None
                return self
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(torch.cuda.current_stream(self.device))
            self._events = (begin, None)
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self, wait: bool = True) -> float | None:
        """Mark the end; the elapsed seconds (None with ``wait=False`` on CUDA: see :meth:`seconds`)."""
        if self.kind != CUDA_EVENTS:
            self._t1 = time.perf_counter()
            return self._t1 - self._t0
        if self._events is None:
            return 0.0
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._events = (self._events[0], end)
        return self.seconds() if wait else None

    def done(self) -> bool:
        """Whether :meth:`seconds` can answer without waiting for the device."""
        return self._events is None or self._events[1] is None or self._events[1].query()

    def seconds(self) -> float:
        """The elapsed seconds of a stopped clock (on CUDA: waits for the end event first)."""
        if self.kind != CUDA_EVENTS:
            return self._t1 - self._t0
        if self._events is None or self._events[1] is None:
            return 0.0
        begin, end = self._events
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def timed(fn: Callable[[], Any], device: torch.device | str | None) -> tuple[Any, float]:
    """``(fn(), seconds)`` on ``device``'s clock; ``fn`` must leave its work joined to the current
    stream (a synchronous collective, or ``work.wait()``) for the device time to include it."""
    clock = Clock(device).start()
    result = fn()
    return result, clock.stop()


class Warmup:
    """Runs each key's work ``runs`` times, untimed, the first time the key is seen.

    A key names what a first run would mis-measure: a route on a group (``(group ranks, route)``),
    a probe's collective on a group. Every rank of a group must see the same keys in the same order
    (a warm-up run of a collective is a collective): the package's callers measure only after an
    agreed decision to, so they do. ``runs`` defaults to :func:`warmup_runs` of the device.
    """

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def ensure(self, key: Hashable, fn: Callable[[], Any], device: torch.device | str | None,
               runs: int | None = None) -> int:
        """Run ``fn`` ``runs`` times if ``key`` is new; the number of runs made (0 for a known key)."""
        n = warmup_runs(device) if runs is None else runs
        with self._lock:
            if key in self._seen:
                return 0
            self._seen.add(key)
        for _ in range(n):
            fn()
        return n

    def seen(self, key: Hashable) -> bool:
        """Whether ``key`` was warmed up (or needed no warm-up) already."""
        return key in self._seen

    def forget(self, key: Hashable | None = None) -> None:
        """Forget ``key`` (all keys if None): a rebuilt group needs a new warm-up."""
        with self._lock:
            if key is None:
                self._seen.clear()
            else:
                self._seen.discard(key)


#: The process's warm-up book: one per process, as NCCL communicators and Triton's JIT cache are.
WARMUP = Warmup()

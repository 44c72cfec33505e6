"""Count the bytes this rank puts on the wire, by intercepting ``torch.distributed`` calls."""

from __future__ import annotations

import collections
import functools
import inspect
import threading
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from robust_plugins.timing import CUDA_EVENTS, Clock

#: The functions a :class:`WireCounter` intercepts (those this torch has). torch 2.13 deprecates
#: ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of the ``*_single`` names, which
#: the old names call: a call is counted once, under the name the caller used.
INTERCEPTED = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "send",
    "isend",
    "recv",
    "irecv",
)

#: Sources of collectives a host bound to its own objects at start-up (patching torch's module
#: misses those): each returns ``(owner, attribute, torch name)`` triples to wrap while a counter is
#: open. Host patches register them (:func:`register_bound_collectives`); this module names no host.
_BOUND_SOURCES: list[Callable[[], Iterable[tuple[Any, str, str]]]] = []


def register_bound_collectives(source: Callable[[], Iterable[tuple[Any, str, str]]]) -> None:
    """Have every counter opened from now on also wrap the collectives ``source()`` names (each
    counted as the torch function named third); registering the same source twice is a no-op."""
    if source not in _BOUND_SOURCES:
        _BOUND_SOURCES.append(source)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _list_nbytes(ts) -> int:
    return sum(_nbytes(t) for t in ts or ())


def _all_to_all_single_bytes(a: dict, rank: int, world: int) -> int:
    inp = a["input"]
    rows = inp.shape[0] if inp.dim() else 1
    if rows == 0:
        return 0
    row_bytes = _nbytes(inp) // rows
    splits = a.get("input_split_sizes")
    if splits is not None and len(splits):  # a list, or a numpy array (megatron's MoE dispatcher)
        return (int(sum(splits)) - int(splits[rank])) * row_bytes
    return _nbytes(inp) - (rows // world) * row_bytes


def _is_root(a: dict, rank: int, global_key: str, group_key: str) -> bool:
    if a.get(group_key) is not None:
        return rank == a[group_key]
    return dist.get_rank() == (a.get(global_key) or 0)


def _scatter_bytes(a: dict, rank: int, world: int) -> int:
    if not _is_root(a, rank, "src", "group_src"):
        return 0
    others = [t for i, t in enumerate(a.get("scatter_list") or ()) if i != rank]
    return _list_nbytes(others)


# Bytes this rank sends, from the bound arguments, its rank in the group and the group size.
_BYTES: dict[str, Callable[[dict, int, int], int]] = {
    "all_reduce": lambda a, r, w: 2 * (w - 1) * _nbytes(a["tensor"]) // w,
    "all_reduce_coalesced": lambda a, r, w: 2 * (w - 1) * _list_nbytes(a["tensors"]) // w,
    "reduce": lambda a, r, w: _nbytes(a["tensor"]),
    "broadcast": lambda a, r, w: _nbytes(a["tensor"]),
    "all_gather": lambda a, r, w: (w - 1) * _nbytes(a["tensor"]),
    "all_gather_into_tensor": lambda a, r, w: (w - 1) * _nbytes(a["output_tensor"]) // w,
    "all_gather_single": lambda a, r, w: (w - 1) * _nbytes(a["output_tensor"]) // w,
    "_all_gather_base": lambda a, r, w: (w - 1) * _nbytes(a["output_tensor"]) // w,
    "reduce_scatter_tensor": lambda a, r, w: (w - 1) * _nbytes(a["input"]) // w,
    "reduce_scatter_single": lambda a, r, w: (w - 1) * _nbytes(a["input"]) // w,
    "_reduce_scatter_base": lambda a, r, w: (w - 1) * _nbytes(a["input"]) // w,
    "reduce_scatter": lambda a, r, w: (w - 1) * _list_nbytes(a["input_list"]) // w,
    "all_to_all_single": _all_to_all_single_bytes,
    "all_to_all": lambda a, r, w: _list_nbytes(t for i, t in enumerate(a["input_tensor_list"]) if i != r),
    "gather": lambda a, r, w: 0 if _is_root(a, r, "dst", "group_dst") else _nbytes(a["tensor"]),
    "scatter": _scatter_bytes,
    "send": lambda a, r, w: _nbytes(a["tensor"]),
    "isend": lambda a, r, w: _nbytes(a["tensor"]),
    "recv": lambda a, r, w: 0,
    "irecv": lambda a, r, w: 0,
}

_lock = threading.RLock()
_active: list["WireCounter"] = []
_count_bytes = False  # some open counter wants bytes (not only calls and time): bind the arguments
_restore: list[tuple[Any, str, Any, bool]] = []  # (owner, attribute, original, was in __dict__)
_tls = threading.local()

#: A counter folds finished device clocks into ``seconds`` as it goes; past this many unfinished
#: ones it waits for the oldest (bounded memory when nobody reads ``seconds`` for a long time).
_MAX_PENDING = 1024


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    """The device of the call's first tensor (or first tensor of a list): what clock times it."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0].device
    return None


def _make_wrapper(name: str, original: Callable) -> Callable:
    sig = inspect.signature(original)
    measure = _BYTES[name]

    @functools.wraps(original)
    def counted(*args, **kwargs):
        # Calls made inside a counted call (torch's own helpers, a wrapped alias) are part of it.
        if getattr(_tls, "depth", 0) or not _active:
            return original(*args, **kwargs)
        group, nbytes = None, 0
        if _count_bytes:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)  # let torch report the bad call itself
            a = bound.arguments
            group = a.get("group")
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            nbytes = measure(a, rank, world) if world > 1 and rank >= 0 else 0
        _tls.depth = 1
        clock = Clock(_device_of(args, kwargs)).start()
        try:
            result = original(*args, **kwargs)
        finally:
            _tls.depth = 0
        with _lock:
            counters = list(_active)
        block = _coalescing(group, known=_count_bytes)
        path = timing_path(result, block is not None)
        if path == "sync":
            # Host time on the CPU; on a CUDA tensor events on the current stream, read later: a
            # synchronous call makes the current stream wait for the collective, so the events
            # bracket the collective itself.
            seconds = clock.stop(wait=False)
            for counter in counters:
                counter._add(name, nbytes, group, clock if seconds is None else seconds)
            return result
        for counter in counters:
            counter._add(name, nbytes, group, 0.0)  # the call; its time comes when it completes
        if path == "future":
            _time_until_done(result, clock, counters, group)
        elif path == "coalesced":
            # Inside a coalescing block the collective is launched at the block's end: timed from
            # the block's first call to the coalesced work's completion (_CoalescingManager.append,
            # async blocks; a synchronous block's end is not seen: its calls count their launch).
            pending = getattr(_tls, "coalesced", None)
            if pending is None or pending[0] is not block:  # a new block (a synchronous one left no append)
                _tls.coalesced = (block, clock, counters, group, name in _P2P)
        return result

    counted._robust_wire_counter = True
    return counted


def timing_path(result: Any, coalescing: bool) -> str:
    """How a counted call's time is taken (pure; by what the call returned):

    - ``sync``: it returned no work (a synchronous call, outside a coalescing block): events (CUDA)
      or host time around the call;
    - ``future``: an asynchronous work (``async_op=True``): from the call to the work's completion,
      read off its future (:func:`_time_until_done`) without waiting: the launch alone would read
      ~0 s on NCCL, and overlapped reductions (megatron's ``overlap_grad_reduce``) are async;
    - ``coalesced``: inside a coalescing block (``_coalescing_manager``): the block's end launches
      the collective, timed from the block's first call to that work's completion;
    - ``launch``: a work whose completion cannot be observed (no future): the launch only.
    """
    if coalescing:
        return "coalesced"
    if result is None:
        return "sync"
    illegal = getattr(c10d, "_IllegalWork", None)
    if (illegal is not None and isinstance(result, illegal)) or not hasattr(result, "get_future"):
        return "launch"
    return "future"


def _coalescing(group: Any, known: bool = True) -> list | None:
    """The coalescing block (torch's ``_coalescing_manager``: its op list, a new list a block) that
    calls on ``group`` join now, or None; with ``known`` False (a timing-only counter does not bind
    the call's arguments), any block open now."""
    state = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    if not state:
        return None
    if not known:
        return next(iter(state.values()))
    pg = group if group is not None else c10d.GroupMember.WORLD
    return state.get(pg)


#: Point-to-point calls: a coalescing block of these is ``batch_isend_irecv`` on NCCL.
_P2P = frozenset({"send", "isend", "recv", "irecv"})


def coalesced_future_usable(p2p: bool, clock_kind: str) -> bool:
    """Whether a coalescing block's work may be timed off its future (pure). Not NCCL's coalesced
    point-to-point work (``batch_isend_irecv`` on CUDA): it is not documented to carry a future,
    and ``.then`` on a work without one may end the process in C++ rather than raise; such a
    block is timed at its launch (``timing_path``'s ``launch``). Not checked on a GPU."""
    return not (p2p and clock_kind == CUDA_EVENTS)


def _time_until_done(work: Any, clock: Clock, counters: list, group: Any) -> None:
    """Count the seconds from ``clock``'s start to ``work``'s completion, without waiting for it.

    The work's future runs its callbacks once the collective is done (gloo: on its thread, when it
    finished; NCCL: at once, with current streams that wait for the collective's stream), so the
    clock stopped there ends when the collective does: host time on the CPU, a CUDA event on CUDA,
    read when the counter is.
    """
    def done(_fut) -> None:
        try:
            seconds = clock.stop(wait=False)
            for counter in counters:
                counter._add_seconds(group, clock if seconds is None else seconds)
        except Exception:  # a timer must never fail a collective's future
            pass

    try:
        work.get_future().then(done)
    except Exception:  # a work without a usable future: its launch was counted
        pass


def _append_timed(original: Callable) -> Callable:
    """``_CoalescingManager.append`` that times the coalesced work from the block's first call."""
    @functools.wraps(original)
    def append(self, work=None):
        pending = _tls.__dict__.pop("coalesced", None)
        if work and pending:
            _, clock, counters, group, p2p = pending
            if coalesced_future_usable(p2p, clock.kind):
                _time_until_done(work, clock, counters, group)
            else:
                seconds = clock.stop(wait=False)
                for counter in counters:
                    counter._add_seconds(group, clock if seconds is None else seconds)
        return original(self, work)

    append._robust_wire_counter = True
    return append


def _patch(owner: Any, attr: str, wrapper: Callable) -> None:
    was_own = attr in getattr(owner, "__dict__", {})
    _restore.append((owner, attr, getattr(owner, attr), was_own))
    setattr(owner, attr, wrapper)


def _install() -> None:
    wrappers: dict[int, Callable] = {}
    for module in (dist, c10d):
        for name in INTERCEPTED:
            original = getattr(module, name, None)
            if original is None or getattr(original, "_robust_wire_counter", False):
                continue
            # torch.distributed re-exports distributed_c10d: one wrapper per function object.
            wrapper = wrappers.setdefault(id(original), _make_wrapper(name, original))
            _patch(module, name, wrapper)
    manager = getattr(c10d, "_CoalescingManager", None)
    append = getattr(manager, "append", None)
    if append is not None and not getattr(append, "_robust_wire_counter", False):
        _patch(manager, "append", _append_timed(append))
    for source in _BOUND_SOURCES:
        for owner, attr, name in source():
            bound = getattr(owner, attr)
            if not getattr(bound, "_robust_wire_counter", False):
                _patch(owner, attr, wrappers.get(id(bound)) or _make_wrapper(name, bound))


def _uninstall() -> None:
    while _restore:
        owner, attr, original, was_own = _restore.pop()
        if was_own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)


class WireCounter:
    """Context manager counting the bytes this rank sends through ``torch.distributed``.

    While any counter is open, the functions in :data:`INTERCEPTED` are wrapped in both
    ``torch.distributed`` and ``torch.distributed.distributed_c10d``, and those a host bound to
    its own objects (:func:`register_bound_collectives`; DeepSpeed's comm backend, by
    ``patches/deepspeed_wire.py``); the originals come back when the last counter closes, also
    on an exception. Code that looks collectives up at call time (``dist.all_reduce(...)``,
    ``deepspeed.comm``) is seen; a function object bound before the counter opened
    (``from torch.distributed import all_reduce`` at import) and collectives issued from C++
    (DDP's built-in reducer without a comm hook) are not.

    Bytes sent by this rank, bus model for a group of ``W`` ranks (0 when ``W == 1``):

    ==========================================  =============================================
    ``all_reduce[_coalesced]``                  ``2 (W-1) / W * nbytes`` (ring)
    ``reduce_scatter[_tensor|_single]``         ``(W-1) / W * input bytes``
    ``all_gather[_into_tensor|_single]``        ``(W-1) / W * output bytes``
    ``all_to_all_single``                       input rows sent to other ranks (honours
                                                ``input_split_sizes``)
    ``all_to_all``                              input tensors for other ranks
    ``broadcast``, ``reduce``                   ``nbytes`` (every rank: a pipelined tree)
    ``gather``                                  ``nbytes`` on non-root ranks, 0 on the root
    ``scatter``                                 the other ranks' tensors on the root, else 0
    ``send``, ``isend``                         ``nbytes``; ``recv`` / ``irecv``: 0
    ==========================================  =============================================

    Nested counters (and counters in several threads) all count every call. Calls made while a
    counted call runs (torch's own helpers) are not counted twice.

    Args:
        filter_group: count only calls on this process group (``None``, the default, counts all;
            a call with ``group=None`` is on ``torch.distributed.group.WORLD``), or a function
            ``fn(group) -> bool`` choosing the groups to count.
        timing_only: count calls and seconds only (``bytes_sent`` and ``by_op`` stay 0; every
            group). While only such counters are open the wrapper skips binding the call's
            arguments, most of its cost (the watchdog's straggler detector needs only the time).

    Attributes:
        bytes_sent: total bytes (int).
        calls: ``collections.Counter`` of calls by function name.
        by_op: ``collections.Counter`` of bytes by function name.
        seconds: time spent in the counted collectives (float; :func:`timing_path`): around a
            synchronous call; from an ``async_op`` call (or a coalescing block's first call) to
            its work's completion, seen through the work's future. Host time for CPU tensors; for
            CUDA tensors device time between CUDA events (NCCL's host call returns at launch):
            reading it waits for the counted collectives to finish (:meth:`settled_seconds`
            does not).
    """

    def __init__(self, filter_group: Any = None, timing_only: bool = False):
        if timing_only and filter_group is not None:
            raise ValueError("WireCounter: timing_only counts every group; a filter_group needs "
                             "the call's arguments bound (use timing_only=False)")
        self.filter_group = filter_group
        self.timing_only = timing_only
        self.bytes_sent = 0
        self.calls: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()
        self._seconds = 0.0
        self._pending: list[Clock] = []  # device clocks not folded into _seconds yet
        self._mutex = threading.Lock()

    def __enter__(self) -> "WireCounter":
        global _count_bytes
        with _lock:
            if not _active:
                _install()
            _active.append(self)
            _count_bytes = any(not c.timing_only for c in _active)
        return self

    def __exit__(self, *exc) -> None:
        global _count_bytes
        with _lock:
            _active.remove(self)
            _count_bytes = any(not c.timing_only for c in _active)
            if not _active:
                _uninstall()

    def _matches(self, group: Any) -> bool:
        if self.filter_group is None:
            return True
        group = group if group is not None else dist.group.WORLD
        if callable(self.filter_group) and not isinstance(self.filter_group, dist.ProcessGroup):
            return bool(self.filter_group(group))
        return group is self.filter_group

    @property
    def seconds(self) -> float:
        """Seconds inside the counted calls (waits for their device clocks: see the class doc)."""
        with self._mutex:
            while self._pending:
                self._seconds += self._pending.pop(0).seconds()
            return self._seconds

    def settled_seconds(self) -> float:
        """The seconds whose clocks have finished, without waiting for the device: what a step
        signal reads (an unfinished collective counts once it finished, at a later read; an
        asynchronous one once its completion was seen)."""
        with self._mutex:
            self._fold_done()
            return self._seconds

    def unsettled(self) -> int:
        """How many counted collectives' device clocks have not finished (0 on CPU); reading
        :attr:`seconds` now would wait for them."""
        with self._mutex:
            self._fold_done()
            return len(self._pending)

    def _fold(self, seconds: "float | Clock") -> None:
        # Under self._mutex. Finished clocks are read without waiting; the rest wait for a read.
        if isinstance(seconds, Clock):
            self._pending.append(seconds)
        else:
            self._seconds += seconds
        while self._pending and (self._pending[0].done() or len(self._pending) > _MAX_PENDING):
            self._seconds += self._pending.pop(0).seconds()

    def _fold_done(self) -> None:
        # Under self._mutex. Clocks finish out of order (async collectives end after later sync
        # ones): every finished one is folded (a scan: once a step, not once a call).
        still = []
        for clock in self._pending:
            if clock.done():
                self._seconds += clock.seconds()
            else:
                still.append(clock)
        self._pending = still

    def _add(self, name: str, nbytes: int, group: Any, seconds: "float | Clock" = 0.0) -> None:
        if not self._matches(group):
            return
        if self.timing_only:
            nbytes = 0
        with self._mutex:
            self._fold(seconds)
            self.bytes_sent += nbytes
            self.calls[name] += 1
            self.by_op[name] += nbytes

    def _add_seconds(self, group: Any, seconds: "float | Clock") -> None:
        if self._matches(group):
            with self._mutex:
                self._fold(seconds)

    def __repr__(self) -> str:
        return f"WireCounter(bytes_sent={self.bytes_sent}, calls={dict(self.calls)})"


def add_wait_seconds(seconds: "float | Clock", group: Any = None) -> None:
    """Count ``seconds`` spent waiting for an ``async_op`` collective on ``group`` in every open
    counter's ``seconds`` (no call, no bytes: its launch was counted already). A stopped
    :class:`~robust_plugins.timing.Clock` (``stop(wait=False)``, CUDA events around ``work.wait()``)
    is read when the counter's ``seconds`` is, so reporting never stalls the host.

    A counter times an asynchronous call to its completion itself (:func:`timing_path`); this is
    for waits on communication it cannot see (collectives issued from C++, another library's
    transport), so that time inside communication stays time inside communication for the
    watchdog's straggler detector (compute = step - communication) and telemetry's bandwidth.
    """
    with _lock:
        counters = list(_active)
    for counter in counters:
        counter._add_seconds(group, seconds)

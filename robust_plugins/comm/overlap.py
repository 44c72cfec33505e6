"""Overlapping gradient reductions with backward: ordered, host-agnostic, one driver per communicator.

A host integration (``patches/megatron.py`` for megatron-core's bucket groups,
``patches/deepspeed_overlap.py`` for DeepSpeed ZeRO 0) hands each gradient bucket to a
:class:`SyncThread` as soon as backward has finished it, and waits for the returned
:class:`SyncHandle` where the host would have reduced. Every rank submits the same buckets in the
same order (the hosts make sure of it), so every rank issues the same sequence of collectives. On
CUDA the work runs on the training thread, onto a side stream; on the CPU on one background thread
over clones of the host's groups (:class:`SyncThread` says why). :func:`plan_buckets` is the pure
planner of DeepSpeed's buckets.

Nothing here imports DeepSpeed or megatron-core.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch

from robust_plugins.device import (current_stream, device_type_for_backend, record_event, set_thread_device,
                                   side_stream)
from robust_plugins.device import on_stream as _on
from robust_plugins.errors import ConfigError, RobustPluginsError

#: Upper bound of a ``wait()`` on an overlapped sync. The collectives themselves time out with
#: their process group (torch's default: 30 min for gloo); this only keeps a lost thread from
#: blocking forever.
WAIT_TIMEOUT_S = 3600.0

#: ``on_event(event, name)``: ``start`` / ``done`` on the sync thread, ``wait`` on the caller's.
EventFn = Callable[[str, str], None]


class Completed:
    """A handle for a sync that already ran where it was started (nothing to wait for)."""

    def wait(self) -> None:
        """The sync already completed; nothing to wait for."""

    def is_completed(self) -> bool:
        """Always true."""
        return True


class SyncHandle:
    """The handle of one submitted item: completed by the sync thread, waited on by the caller.

    Args:
        name: names the item in events and errors (a bucket group, a bucket).
        what: what the item is, for error messages (``"megatron bucket group"``).
        on_event: told of ``wait`` (after the item finished, on the waiting thread).
    """

    def __init__(self, name: str, what: str, on_event: EventFn | None = None, device: Any = None):
        self.name = name
        self.what = what
        self._on_event = on_event
        self._device = device
        self._done = threading.Event()
        self._finished = None  # GPU: the event the sync thread recorded after the item
        self.error: BaseException | None = None

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the item finished; re-raise what failed on the sync thread."""
        if not self._done.wait(WAIT_TIMEOUT_S if timeout_s is None else timeout_s):
            raise RobustPluginsError(
                f"{self.what} {self.name}: the overlapped gradient sync did not finish in "
                f"{WAIT_TIMEOUT_S if timeout_s is None else timeout_s:.0f} s; a rank is probably hung "
                f"(see the other ranks' logs).")
        if self._on_event is not None:
            self._on_event("wait", self.name)
        if self.error is not None:
            raise RobustPluginsError(f"{self.what} {self.name}: the overlapped gradient sync failed on "
                                     f"the sync thread: {self.error!r}") from self.error
        if self._finished is not None:
            # The caller's stream (any stream, not only the default one) reads the reduced
            # tensors only after the sync thread's kernels: a device-side wait, no host stall.
            current_stream(self._device).wait_event(self._finished)

    def is_completed(self) -> bool:
        """True once the sync thread has finished this item."""
        return self._done.is_set()


def runs_inline(device: Any) -> bool:
    """Whether a :class:`SyncThread` for tensors on ``device`` runs its work on the submitting
    thread (pure): yes on a device whose collectives launch asynchronously (CUDA: NCCL), so that
    one host thread drives every communicator; no on the CPU (gloo blocks the host: a thread
    overlaps) and for None."""
    return device is not None and torch.device(device).type != "cpu"


class SyncThread:
    """Submitted work run one item at a time, in submission order, overlapping the caller. Where
    it runs is :func:`runs_inline`'s decision:

    - **CUDA (NCCL): on the training thread, onto a side stream.** NCCL launches are
      asynchronous, so the host needs no thread to overlap; the reduction is launched where it is
      submitted, on the thread's side stream, ordered by events: the side stream waits for an
      event the caller's current stream recorded at :meth:`SyncThread.submit` (the kernels that
      produced the gradients), the tensors are ``record_stream``-ed on the side stream, and
      :meth:`SyncHandle.wait` makes the caller's current stream wait for an event recorded after
      the item. One host thread then drives every communicator, in program order, the same on
      every rank: NCCL documents two threads issuing collectives on communicators in orders that
      differ between ranks (megatron's TP all-reduces during backward, parameter all-gathers
      beside the gradient reduction) as able to deadlock. The host's own process groups are used
      (:func:`clone_groups` clones none), and so is every group the reduction reaches (the
      hierarchy's node and rail groups, its flat fallback): all on the one thread.
    - **CPU (gloo): on one background thread.** A gloo collective blocks its host until done, so
      overlap needs a thread; it reduces over its own clones of the host's groups
      (:func:`clone_groups`, made on the main thread, in one order on every rank), never shared
      with the training thread (gloo matches collectives by their order on a group).

    Args:
        name: the thread's name (shows in py-spy dumps; CPU only).
        what: what the items are, for the handles' error messages.
        on_event: called with ``start`` and ``done`` around every item (on the thread that runs it).
        device: the device of the tensors the work reduces. CUDA (:func:`runs_inline`): the work
            runs on the submitting thread, on a side stream made here, ordered against the
            caller's stream by events; no thread is started. CPU or None: one background thread.
    """

    def __init__(self, name: str, what: str, on_event: EventFn | None = None, device: Any = None):
        self._what = what
        self._on_event = on_event
        self._device = torch.device(device) if device is not None else None
        self.inline = runs_inline(self._device)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if self.inline:
            self._stream = side_stream(self._device)  # on the caller's thread and device
        else:
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()

    def submit(self, name: str, work: Callable[[], None], tensors: Iterable[torch.Tensor] = ()) -> SyncHandle:
        """Run ``work`` after everything submitted before it; its handle.

        ``tensors``: the device tensors ``work`` reads or writes (GPU: ``record_stream``-ed on the
        side stream, so their memory is not reused before its kernels finished)."""
        handle = SyncHandle(name, self._what, self._on_event, self._device)
        # On the caller's thread: the side stream starts this item after what the caller's
        # current stream has queued so far (the kernels that produced these gradients).
        ready = record_event(current_stream(self._device))
        item = (handle, work, ready, tuple(tensors))
        if self.inline:
            self._run(item, self._stream)
        else:
            self._queue.put(item)
        return handle

    def _loop(self) -> None:
        set_thread_device(self._device)  # first: every kernel and collective below uses it
        stream = side_stream(self._device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run(item, stream)

    def _run(self, item: tuple, stream) -> None:
        handle, work, ready, tensors = item
        try:
            if self._on_event is not None:
                self._on_event("start", handle.name)
            with _on(stream):
                if ready is not None:
                    stream.wait_event(ready)
                work()
                if stream is not None:
                    for t in tensors:
                        t.record_stream(stream)
                    handle._finished = record_event(stream)
            if self._on_event is not None:
                self._on_event("done", handle.name)
        except BaseException as exc:  # handed to the waiting thread by wait()
            handle.error = exc
        finally:
            handle._done.set()

    @property
    def alive(self) -> bool:
        """Whether work can still be submitted (inline: always; else the thread is running)."""
        return self.inline or (self._thread is not None and self._thread.is_alive())

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after the work already submitted (bounded by ``timeout_s``)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)


def needs_eager_init(backend: str) -> bool:
    """Whether a new group of ``backend`` creates its communicator lazily, at its first
    collective (pure): NCCL and the other device-only backends do; gloo connects every pair
    inside ``new_group``."""
    return device_type_for_backend(backend) != "cpu"


def clone_groups(groups: list) -> dict:
    """The groups a :class:`SyncThread` reduces over, for each of ``groups``: ``{id(group): group
    to use}``.

    A group whose collectives move device tensors (:func:`needs_eager_init`: NCCL) is its own
    answer: its :class:`SyncThread` runs inline (:func:`runs_inline`), on the training thread,
    which already drives that group; a clone would be a second communicator for nothing. A gloo
    group gets a clone (same ranks, same backend) for the background thread, never shared with
    the training thread. ``new_group`` is collective over the whole job and must be called in the
    same order on every rank, also by ranks outside the group: the rank lists are gathered first
    and every rank creates the union, sorted (gloo connects in ``new_group``: nothing lazy is
    left for the thread to initialise).
    """
    import torch.distributed as dist

    mine = {tuple(dist.get_process_group_ranks(g)): dist.get_backend(g) for g in groups}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(mine.items()))
    clones = {}
    for ranks, backend in sorted({item for part in gathered for item in part}):
        if needs_eager_init(backend):
            continue  # the same decision on every rank: the backend is the group's
        group = dist.new_group(ranks=list(ranks), backend=backend)
        if ranks in mine:
            clones[ranks] = group
    return {id(g): clones.get(tuple(dist.get_process_group_ranks(g)), g) for g in groups}


def plan_buckets(params: Sequence[tuple[int, Hashable]], bucket_numel: int) -> list[list[int]]:
    """Buckets of parameter indices, in the order they are reduced (pure).

    ``params[i]`` is ``(numel, dtype)`` of the i-th parameter in registration order
    (``module.parameters()``). Backward produces gradients roughly in reverse registration order,
    so the parameters are taken from last to first; a bucket closes when it holds at least
    ``bucket_numel`` elements or when the next parameter has another dtype (a bucket is one flat
    tensor). Every parameter lands in exactly one bucket; within a bucket indices are ascending
    (the order DeepSpeed flattens a bucket in).
    """
    if bucket_numel < 1:
        raise ConfigError(f"bucket size must be at least 1 element, got {bucket_numel}.")
    buckets: list[list[int]] = []
    current: list[int] = []
    numel, dtype = 0, None
    for i in reversed(range(len(params))):
        n, dt = params[i]
        if n < 0:
            raise ConfigError(f"parameter {i} has a negative element count ({n}).")
        if current and dt != dtype:
            buckets.append(sorted(current))
            current, numel = [], 0
        current.append(i)
        numel += n
        dtype = dt
        if numel >= bucket_numel:
            buckets.append(sorted(current))
            current, numel = [], 0
    if current:
        buckets.append(sorted(current))
    return buckets

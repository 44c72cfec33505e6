"""Overlapping gradient reductions with backward: one ordered background thread, host-agnostic.

A host integration (``patches/megatron.py`` for megatron-core's bucket groups,
``patches/deepspeed_overlap.py`` for DeepSpeed ZeRO 0) hands each gradient bucket to a
:class:`SyncThread` as soon as backward has finished it, and waits for the returned
:class:`SyncHandle` where the host would have reduced. The pieces here are shared by both:

* :class:`SyncThread` runs submitted work one item at a time, in submission order. Every rank
  submits the same buckets in the same order (the hosts make sure of it), so every rank issues
  the same sequence of collectives.
* :func:`clone_groups` gives the thread its own copies of the process groups it reduces over, so
  that its collectives never interleave with collectives the training thread issues on the
  host's groups (gloo matches collectives by their order on a group).
* On a GPU the thread runs on its own device and stream (:class:`SyncThread`'s ``device``): the
  device is set first on the thread (a new thread starts on GPU 0, where Triton and NCCL would
  then run with another GPU's pointers); each item's stream waits for an event the caller
  recorded on its current stream at :meth:`SyncThread.submit` (the kernels that produced the
  gradients), the tensors it used are ``record_stream``-ed on the thread's stream, and
  :meth:`SyncHandle.wait` makes the caller's current stream wait for an event recorded after the
  item. Neither side blocks the host for the other's kernels, codec kernels do not queue behind
  backward, and a training loop on any stream reads reduced gradients only. On CPU none of that
  exists (no streams, no events) and the thread runs the work as it is.
* :func:`plan_buckets` is the pure planner of DeepSpeed's buckets: parameters in reverse order
  of registration (the order backward finishes them, as in PyTorch DDP), cut into buckets of
  about ``bucket_numel`` elements, one dtype a bucket.

Nothing here imports DeepSpeed or megatron-core.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch

from robust_plugins.device import (collective_device, current_stream, device_type_for_backend, record_event,
                                   set_thread_device, side_stream)
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


class SyncThread:
    """One background thread running submitted work in submission order.

    Args:
        name: the thread's name (shows in py-spy dumps).
        what: what the items are, for the handles' error messages.
        on_event: called with ``start`` and ``done`` around every item (on the sync thread).
        device: the device of the tensors the work reduces (None or CPU: no device handling).
            On a GPU the thread sets it as its current device before anything else and runs
            every item on its own stream, ordered against the caller's stream by events (see
            the module docstring).
    """

    def __init__(self, name: str, what: str, on_event: EventFn | None = None, device: Any = None):
        self._what = what
        self._on_event = on_event
        self._device = torch.device(device) if device is not None else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, name: str, work: Callable[[], None], tensors: Iterable[torch.Tensor] = ()) -> SyncHandle:
        """Queue ``work`` (run after everything submitted before it); its handle.

        ``tensors``: the device tensors ``work`` reads or writes (GPU: ``record_stream``-ed on the
        thread's stream, so their memory is not reused before its kernels finished)."""
        handle = SyncHandle(name, self._what, self._on_event, self._device)
        # On the caller's thread: the thread's stream starts this item after what the caller's
        # current stream has queued so far (the kernels that produced these gradients).
        ready = record_event(current_stream(self._device))
        self._queue.put((handle, work, ready, tuple(tensors)))
        return handle

    def _loop(self) -> None:
        set_thread_device(self._device)  # first: every kernel and NCCL call below uses it
        stream = side_stream(self._device)
        while True:
            item = self._queue.get()
            if item is None:
                return
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
        """Whether the thread is still running."""
        return self._thread.is_alive()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after the work already submitted (bounded by ``timeout_s``)."""
        self._queue.put(None)
        self._thread.join(timeout_s)


def _on(stream):
    """``stream`` as the current stream inside the block (nothing for None: CPU)."""
    if stream is None:
        return contextlib.nullcontext()
    return getattr(torch, stream.device.type).stream(stream)


def needs_eager_init(backend: str) -> bool:
    """Whether a new group of ``backend`` must be initialised by a first collective (pure).

    NCCL (and the other device-only backends) create a communicator lazily, at the group's
    first collective. For a sync thread's clone that would happen on the thread, during
    backward, interleaved with the training thread's first collectives on its own groups in an
    order that can differ between ranks: NCCL documents that as a possible deadlock. gloo
    connects every pair inside ``new_group``: nothing to do.
    """
    return device_type_for_backend(backend) != "cpu"


def clone_groups(groups: list) -> dict:
    """Clone each process group in ``groups`` (same ranks, same backend) for a sync thread.

    Returns ``{id(group): clone}``. ``new_group`` is collective over the whole job and must be
    called in the same order on every rank, also by ranks outside the group: the rank lists are
    gathered first and every rank creates the union, sorted. Clones of lazily initialised
    backends (:func:`needs_eager_init`) then run one tiny all-reduce each, here on the calling
    (main) thread, in that sorted order: every rank initialises its communicators in one global
    order, before any thread uses them.
    """
    import torch.distributed as dist

    mine = {tuple(dist.get_process_group_ranks(g)): dist.get_backend(g) for g in groups}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(mine.items()))
    clones = {}
    for ranks, backend in sorted({item for part in gathered for item in part}):
        group = dist.new_group(ranks=list(ranks), backend=backend)
        if ranks in mine:
            clones[ranks] = group
    # After every new_group (collective over the job), in the same sorted order on every rank:
    # a rank waits in a group's first all-reduce only for members, which finished the lower groups.
    for ranks in sorted(clones):
        if needs_eager_init(mine[ranks]):
            group = clones[ranks]
            dist.all_reduce(torch.zeros(1, device=collective_device(group)), group=group)
    return {id(g): clones[tuple(dist.get_process_group_ranks(g))] for g in groups}


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

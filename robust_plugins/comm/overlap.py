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
* :func:`plan_buckets` is the pure planner of DeepSpeed's buckets: parameters in reverse order
  of registration (the order backward finishes them, as in PyTorch DDP), cut into buckets of
  about ``bucket_numel`` elements, one dtype a bucket.

Nothing here imports DeepSpeed or megatron-core.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Hashable, Sequence

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

    def __init__(self, name: str, what: str, on_event: EventFn | None = None):
        self.name = name
        self.what = what
        self._on_event = on_event
        self._done = threading.Event()
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

    def is_completed(self) -> bool:
        """True once the sync thread has finished this item."""
        return self._done.is_set()


class SyncThread:
    """One background thread running submitted work in submission order.

    Args:
        name: the thread's name (shows in py-spy dumps).
        what: what the items are, for the handles' error messages.
        on_event: called with ``start`` and ``done`` around every item (on the sync thread).
    """

    def __init__(self, name: str, what: str, on_event: EventFn | None = None):
        self._what = what
        self._on_event = on_event
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, name: str, work: Callable[[], None]) -> SyncHandle:
        """Queue ``work`` (run after everything submitted before it); its handle."""
        handle = SyncHandle(name, self._what, self._on_event)
        self._queue.put((handle, work))
        return handle

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, work = item
            try:
                if self._on_event is not None:
                    self._on_event("start", handle.name)
                work()
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


def clone_groups(groups: list) -> dict:
    """Clone each process group in ``groups`` (same ranks, same backend) for a sync thread.

    Returns ``{id(group): clone}``. ``new_group`` is collective over the whole job and must be
    called in the same order on every rank, also by ranks outside the group: the rank lists are
    gathered first and every rank creates the union, sorted.
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

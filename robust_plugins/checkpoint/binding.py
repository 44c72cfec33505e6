"""The contract of a host's in-memory snapshot binding, and what every binding shares.

A binding (DeepSpeed's ``MemorySnapshots`` and megatron-core's ``MegatronMemory``, in
``patches/``) captures one training loop's state into a :class:`~robust_plugins.checkpoint.memory.SnapshotStore`
and restores it. :class:`SnapshotBinding` holds what does not depend on the host: the state the
script registers, the bounded wait of the next optimizer step for a background copy, the
replica check's two hooks, the end of the job (files kept after a crash or under ``robust run``,
removed after a normal end outside it). A binding sets the attributes declared below in its
``__init__``, defines :meth:`SnapshotBinding._module`, and calls :meth:`SnapshotBinding._track`.

The replica check is passed in as a :class:`ReplicaCheck` (the watchdog's ``SnapshotCheck``):
checkpoint never imports the watchdog.
"""

from __future__ import annotations

import abc
import atexit
import os
import random
import sys
import time
import weakref
from typing import Any, Callable, Optional, Protocol

import torch

from robust_plugins._logging import get_logger
from robust_plugins.checkpoint import replicas
from robust_plugins.device import device_rng_state, set_device_rng_state
from robust_plugins.errors import CheckpointError

log = get_logger(__name__)

_CRASHED = False

#: The snapshot bindings of this process (weak): :func:`finish_live` finishes their background work.
_LIVE: "weakref.WeakSet[SnapshotBinding]" = weakref.WeakSet()


class ReplicaCheck(Protocol):
    """Compares each snapshot's parameters across data-parallel replicas (``verify_replicas``)."""

    def before_snapshot(self, step: int, params: Callable[[], list]) -> None:
        """Before the snapshot of ``step``: the previous verdict (a mismatch holds the rank)."""

    def before_step(self) -> None:
        """Before the optimizer step after a snapshot: that snapshot's verdict."""

    def close(self) -> None:
        """Stop; no verdict is pending after it."""


class SnapshotBinding(abc.ABC):
    """What every host's snapshot binding shares (see the module's docstring)."""

    store: Any  # robust_plugins.checkpoint.memory.SnapshotStore
    peers: Any  # robust_plugins.checkpoint.peer.PeerBackup, or None
    timeout_s: float
    background: bool
    """Parameters and optimizer state copied on the snapshot thread (``memory_copy``)."""
    blocking_s: list[float]
    wait_s: list[float]
    _user: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]
    sdc: Optional[ReplicaCheck] = None
    """The replica check of every snapshot under robust run, or None."""
    pending_user: Optional[dict] = None
    """Registered state restored before the script registered it (name -> value), or None."""
    _unsettled: bool = False
    _replica_keys: Optional[set] = None
    persister: Any = None
    """robust_plugins.checkpoint.persist.SnapshotPersister writing every ``persist_every``-th
    committed snapshot to disk in the background, or None."""
    persist_every: int = 0
    _persisted_step: Optional[int] = None

    @abc.abstractmethod
    def _module(self) -> torch.nn.Module:
        """The model whose parameters a snapshot holds."""

    def register(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        """Snapshot ``get()`` (tensors / plain data) under ``name``; restore by calling ``set_(value)``."""
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"register(name={name!r}): the name must be a non-empty string.")
        self._user[name] = (get, set_)
        if self.pending_user and name in self.pending_user:
            set_(self.pending_user.pop(name))  # restored before the script could register it

    def _track(self) -> None:
        """Note an unhandled exception as a crash; close at interpreter exit. The host's patch
        also finishes live bindings before its process group goes (:func:`finish_live`)."""
        sys.excepthook = _note_crash(sys.excepthook)
        _LIVE.add(self)
        atexit.register(self._at_exit)

    def finish_pending(self) -> None:
        """Wait (bounded) until every handed-off snapshot is committed, sent and persisted."""
        try:
            self.store.flush(timeout_s=min(self.timeout_s, 60.0))
        except CheckpointError as exc:
            log.error("robust_plugins: %s", exc)

    def close(self, remove: bool) -> None:
        """Finish pending hand-offs; with ``remove`` delete this rank's shared-memory files."""
        self.finish_pending()
        self.store.close(remove=remove)
        if self.sdc is not None:
            self.sdc.close()
        if self.peers is not None:
            self.peers.close(remove=remove)

    def _replica_params(self) -> list:
        """The parameters every data-parallel replica holds alike (the replica check hashes them)."""
        return list(self._module().parameters())

    def _replicated(self) -> set | None:
        """Keys of those parameters for ``SnapshotStore.save`` (None without the replica check).
        Cached: parameters are not re-allocated while training (a stale key fails loudly in
        ``replicas.replica_ranges``), and listing them every step would be blocking time."""
        if self.sdc is None:
            return None
        if self._replica_keys is None:
            self._replica_keys = replicas.replicated_keys(self._replica_params())
        return self._replica_keys

    def _before_snapshot(self, step: int) -> None:
        # The previous snapshot's replica verdict (a mismatch holds), then an armed bit flip.
        if self.sdc is not None:
            self.sdc.before_snapshot(step, self._replica_params)

    def _after_commit(self, _index: int, slot) -> None:
        """The store's after-commit step, on the snapshot thread, in step order on every rank: the
        peer copy, then (every ``persist_every`` steps) the disk checkpoint written from the same
        committed slot. A second snapshot of one step is not persisted twice."""
        if self.peers is not None:
            self.store.keep_step = self.peers.exchange(slot)
        step = slot.header().step
        if self.persister is not None and step % self.persist_every == 0 and step != self._persisted_step:
            self._persisted_step = step
            self.persister.persist(slot, step)

    def stable_tensors(self, state: dict) -> set[int] | None:
        """``data_ptr()`` of the captured tensors only the optimizer step changes (parameters and
        the optimizer's state), copied on the snapshot thread; None with ``memory_copy: in_step``.
        Buffers, residuals, RNG and registered state can change in forward/backward: copied now."""
        if not self.background:
            return None
        ptrs = {p.data_ptr() for p in self._module().parameters() if p.numel()}
        collect_ptrs(state["optimizer"], ptrs)
        collect_ptrs(state.get("partitions"), ptrs)  # ZeRO-3's parameter partitions
        return ptrs

    def settle(self) -> float:
        """Wait until the newest snapshot is committed (before anything changes what it copies)."""
        return self.store.settle(self.timeout_s)

    def _settle_in_step(self, *_hook_args) -> None:
        # Only the first step after a background snapshot has something to wait for (an in_step
        # snapshot's tensors are all copied already); that wait is the snapshot's blocking too.
        if not self._unsettled:
            return
        self._unsettled = False
        t0 = time.perf_counter()
        self.store.settle(self.timeout_s)
        if self.sdc is not None:
            # The replicas' verdict on that snapshot, before this step changes anything: after a
            # mismatch the rank holds here, so the step before the bad one stays its newest
            # completed step (one step trained twice) and its snapshot stays in memory.
            self.sdc.before_step()
        waited = time.perf_counter() - t0
        self.wait_s.append(waited)
        if self.blocking_s:
            self.blocking_s[-1] += waited

    def _at_exit(self) -> None:
        # Under `robust run` the launcher removes the job's files once the whole job completed: a
        # rank that exits normally while a peer died must not take the restart's source with it.
        # Outside it, a normal end of the script ends the job; an unhandled exception does not.
        self.close(remove=not _CRASHED and not os.environ.get("ROBUST_RUN_DIR"))


def finish_live() -> None:
    """Finish the background work of every live binding of this process (before the process
    group a background save agrees over is destroyed)."""
    for binding in list(_LIVE):
        binding.finish_pending()


def _note_crash(previous):
    def hook(exc_type, exc, tb):
        # An unhandled exception (a peer died, a collective failed) is not a normal end: the
        # snapshots must survive it for the restart.
        global _CRASHED
        _CRASHED = True
        previous(exc_type, exc, tb)
    return hook


def collect_ptrs(obj: Any, out: set[int]) -> None:
    """``data_ptr()`` of every tensor in nested dicts, lists and tuples (objects are not entered:
    what they hold is copied in the step)."""
    if isinstance(obj, torch.Tensor):
        out.add(obj.data_ptr())
    elif isinstance(obj, dict):
        for v in obj.values():
            collect_ptrs(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            collect_ptrs(v, out)


def rng_state() -> dict:
    """torch (CPU and this rank's device), numpy and Python RNG states."""
    import numpy as np

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    device = device_rng_state()  # this rank's device only: a restart may see another device count
    if device is not None:
        state["cuda"] = device
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    set_device_rng_state(state.get("cuda"))

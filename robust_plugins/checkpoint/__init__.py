"""Verified, atomic disk checkpoints, independent of the training framework.

* :mod:`~robust_plugins.checkpoint.manifest`: the per-checkpoint manifest (every file's size and
  sha256, world size, layout) and verification of a directory against it.
* :mod:`~robust_plugins.checkpoint.store`: directory layout, atomic publish and ``latest``,
  choosing what to restore, pruning to ``keep``.
* :mod:`~robust_plugins.checkpoint.coord`: bounded agreement between ranks (JSON, no pickles).
* :mod:`~robust_plugins.checkpoint.disk`: the save / restore protocol a host integration drives
  (``patches/deepspeed.py`` for DeepSpeed).
* :mod:`~robust_plugins.checkpoint.elastic`: resuming at another data-parallel size (pure planners).
* :mod:`~robust_plugins.checkpoint.safe_pickle`: a torch.distributed.checkpoint directory checked
  to hold only data before megatron-core reads it (torch unpickles its ``.metadata`` plainly).

In-memory snapshots (``memory_every``), for any host:

* :mod:`~robust_plugins.checkpoint.flat`: nested state <-> tensors + JSON schema (never unpickles).
* :mod:`~robust_plugins.checkpoint.memory`: :class:`SnapshotStore`, ``/dev/shm`` slots written in
  turn (two; three with a peer backup); ``store.save(step, state)`` blocks for the copy only.
* :mod:`~robust_plugins.checkpoint.peer`: :func:`plan_peers` (pure) and :class:`PeerBackup`.
* :mod:`~robust_plugins.checkpoint.restore`: :func:`plan_restore` (pure) and
  :func:`restore_from_memory` (own memory -> peer copy; None means "load from disk").
* :mod:`~robust_plugins.checkpoint.persist`: background disk saves from committed snapshots.

A host binding (``patches/deepspeed_memory.py``; a megatron-core one would look the same) does::

    store = SnapshotStore(job_key(), rank, world, allowed=flat.allow(...))
    # with a peer backup: n_slots=3, and after_commit=lambda i, slot: setattr(
    #     store, "keep_step", peers.exchange(slot))   (PeerBackup on its own gloo group)
    store.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), ...})  # every N steps
    found = restore_from_memory(store, peers, timeout_s, disk_step=..., max_step=rollback_bound())
    if found: step, state, source = found; ...load state into the live objects...
    else: ...newest verified disk checkpoint (DiskCheckpointer.select)...
"""

from robust_plugins.checkpoint.disk import DiskCheckpointer
from robust_plugins.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, verify_files
from robust_plugins.checkpoint.store import choose, plan_prune, scan
from robust_plugins.checkpoint.memory import SnapshotStore, job_key
from robust_plugins.checkpoint.peer import PeerBackup, plan_peers
from robust_plugins.checkpoint.restore import plan_restore, restore_from_memory, rollback_bound

__all__ = ["DiskCheckpointer", "FileEntry", "MANIFEST_NAME", "Manifest", "PeerBackup", "SnapshotStore", "choose",
           "job_key", "plan_peers", "plan_prune", "plan_restore", "restore_from_memory", "rollback_bound", "scan",
           "verify_files"]

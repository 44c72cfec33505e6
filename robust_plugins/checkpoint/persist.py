"""Background persistence: committed in-memory snapshots written to disk off the training thread.

With ``memory_every`` and ``persist_every`` both set, every ``persist_every``-th snapshot is, once
committed in shared memory, also written to ``checkpoint.dir`` by the snapshot thread, through
the same verified, atomic protocol as a foreground save (:class:`DiskCheckpointer`: temporary
directory, fsync, sha256 manifest, rename, ``latest``, ``keep``), over its own process group so
its agreement collectives never interleave with training's. Each rank writes one file, the slot
as it is in shared memory (header, JSON schema, tensor bytes)::

    <dir>/global_step<N>/robust_snapshot_rank00000.bin
    <dir>/global_step<N>/robust_manifest.json          layout.format = "robust_snapshot"

The training thread is blocked only if a write is still running when its slot is needed again
(two snapshots later). A failed write is logged as an error on every rank at once, counted in
:attr:`SnapshotPersister.failures`, and leaves ``latest`` on the previous good checkpoint;
training and the in-memory snapshots go on.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

from robust_plugins._logging import get_logger
from robust_plugins.checkpoint import coord
from robust_plugins.checkpoint.disk import DiskCheckpointer
from robust_plugins.checkpoint.memory import Slot
from robust_plugins.device import collective_device
from robust_plugins.errors import CheckpointError

log = get_logger(__name__)

#: Value of ``layout["format"]`` in the manifest of a checkpoint written by this module.
FORMAT = "robust_snapshot"
FILE = "robust_snapshot_rank{rank:05d}.bin"


def _write(slot: Slot, path: str) -> None:
    h = slot.header()
    with open(path, "wb") as f:
        f.write(memoryview(slot.buf)[:h.total])


class SnapshotPersister:
    """Writes committed snapshot slots as disk checkpoints (called on the snapshot thread).

    ``ok_to_save(step)`` says whether this rank may write ``step`` (under ``robust run``:
    ``robust_plugins.watchdog.ok_to_save``, False once the monitor holds a fault for that step or
    an earlier one); a step is written only when every rank of the group says True.
    """

    def __init__(self, disk: DiskCheckpointer, root: str, ok_to_save: Callable[[int], bool]) -> None:
        self.disk, self.root = disk, root
        self.ok_to_save = ok_to_save
        self.failures: list[str] = []
        """One message per failed background save (also logged at error level)."""
        self.saved: list[dict] = []
        """``{"step", "tag", "seconds"}`` of every committed background save."""

    def persist(self, slot: Slot, step: int, tag: str | None = None) -> bool:
        """Write ``slot`` as checkpoint ``tag`` (default ``global_step<step>``); True if committed."""
        tag = tag or f"global_step{step}"
        t0 = time.perf_counter()
        if not self._agreed_ok(step):
            log.warning("robust_plugins: [rank %d] background save of step %d skipped: a rank's "
                        "ok_to_save refused it (under robust run: the monitor holds a fault for this "
                        "step or an earlier one, and the job rolls back).", self.disk.rank, step)
            return False
        try:
            staging = self.disk.begin(self.root, tag)
            path = os.path.join(staging, FILE.format(rank=self.disk.rank))
            try:
                _write(slot, path)
                self.disk.record(path)
            except OSError as exc:
                self.disk.fail(exc, path)
            self.disk.finish(self.root, tag, step)
        except CheckpointError as exc:
            msg = f"background save of step {step} into {self.root}: {exc}"
            self.failures.append(msg)
            log.error("robust_plugins: [rank %d] %s Training goes on from memory snapshots; the previous "
                      "disk checkpoint stays the newest.", self.disk.rank, msg)
            return False
        self.saved.append({"step": step, "tag": tag, "seconds": time.perf_counter() - t0})
        return True


    def _agreed_ok(self, step: int) -> bool:
        # The same rule as a foreground save: a fault is detected a little after its step, so
        # nothing is written that a rollback would have to skip. Every rank must agree, or some
        # would wait in the save's collectives alone.
        import torch
        import torch.distributed as dist

        ok = torch.tensor([1 if self.ok_to_save(step) else 0], dtype=torch.int32,
                          device=collective_device(self.disk.group))
        if dist.is_available() and dist.is_initialized():
            work = dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.disk.group, async_op=True)
            coord._wait(work, self.disk.config.timeout_s, f"background save of step {step}: agreeing")
        return bool(ok.item())


def is_snapshot_checkpoint(root: str, tag: str) -> bool:
    """Whether ``root/tag`` was written by :class:`SnapshotPersister` (its manifest says so)."""
    from robust_plugins.checkpoint.manifest import read_manifest

    try:
        return read_manifest(os.path.join(root, tag)).layout.get("format") == FORMAT
    except (OSError, ValueError):
        return False


def load_snapshot_checkpoint(root: str, tag: str, rank: int, job: str, world_size: int,
                             allowed: Mapping[str, type] | None = None) -> tuple[int, Any]:
    """(step, state) of ``rank`` from a verified snapshot-format checkpoint (no code runs)."""
    path = os.path.join(root, tag, FILE.format(rank=rank))
    slot = Slot(path)
    if not slot.open_existing():
        raise CheckpointError(f"{path} is missing from the verified checkpoint {root}/{tag}.")
    try:
        h = slot.header()
        # The job key differs after a relaunch: only the world size and the rank must match.
        problem = slot.problem(h.job if h is not None else job, world_size, rank)
        if problem is not None:
            raise CheckpointError(f"{path}: {problem}; it was not loaded.")
        return slot.read(allowed)
    finally:
        slot.unmap()

"""In-memory snapshots in POSIX shared memory that outlive the training process.

Each rank keeps two *slots* (a double buffer; three with a peer backup, below), each one file
in ``/dev/shm``::

    robust_plugins.<job>.r<rank>.s<i>              this rank's own snapshots
    robust_plugins.<job>.r<src>.at<holder>.s<i>    rank <src>'s snapshot kept by rank <holder>

``<job>`` comes from :func:`job_key` (the same for every incarnation of one job, different for
two jobs). The file's layout: :mod:`~robust_plugins.checkpoint.slot`.

A save first clears the slot's ``committed`` word, copies into the pre-allocated mapping the
tensors that may change before the next optimizer step (residuals, RNG, registered state: small),
writes the schema and header, then hands the slot to a background thread. That thread copies the
tensors the caller declared *stable* (``save(defer=...)``: parameters and optimizer state, which
only the optimizer step changes), overlapped with the next forward and backward, computes the
crc32, writes it, and writes ``committed = 1`` last. :meth:`SnapshotStore.settle` waits for that
(the bindings call it before the next optimizer step, or anything else that changes those
tensors, and count the wait as blocking). A process killed before the commit leaves that slot
uncommitted and the other slot, the previous step, intact: a snapshot is visible to restore, to
the peer backup and to the background disk save only once committed. CUDA tensors are copied
asynchronously on a side stream into the pinned mapping, the commit after an event
(:mod:`~robust_plugins.checkpoint.devcopy`).
Shared memory is the kernel's page cache: whatever the process stored before it died is there
for the next process to read; no flush is needed (a *node* reboot loses it, which is what the
peer copy of :mod:`~robust_plugins.checkpoint.peer` is for).

With a peer backup the copy of step N is sent in the background and may still be in flight when
this rank commits N+1 and N+2: the peer send never delays training. After a node loss the restore
needs one step that the survivors still hold themselves and the peers hold for the lost ranks.
So a store made with ``n_slots=3`` never overwrites the slot of :attr:`SnapshotStore.keep_step`,
the newest step every rank's peer copy is known to hold (:attr:`PeerBackup.agreed_step
<robust_plugins.checkpoint.peer.PeerBackup.agreed_step>`), and ``save(N)`` waits only when the
slot it would overwrite is still being handed off (the copy of N-2 not yet agreed).

Files are removed by :meth:`SnapshotStore.close` with ``remove=True`` (the host calls it at a
normal end of training) and by ``robust run`` when a job completes (:func:`remove_job`); never
when a rank dies, because then they are what the restart restores from.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from robust_plugins._logging import get_logger
from robust_plugins.checkpoint import devcopy, flat, replicas
from robust_plugins.checkpoint.slot import (  # noqa: F401  (re-exported: peer, persist and tests use them here)
    _ALIGN,
    _FIELDS,
    FORMAT,
    HEADER_SIZE,
    MAGIC,
    Header,
    Slot,
    _align,
    _crc,
    _nbytes,
    read_header,
)
from robust_plugins.errors import CheckpointError

log = get_logger(__name__)

#: Where snapshots live: POSIX shared memory (tmpfs) on Linux.
SHM_ROOT = "/dev/shm"
PREFIX = "robust_plugins"
ENV_JOB = "ROBUST_JOB_ID"

#: Niceness added to the snapshot threads (Linux sets it per thread). Their copy, crc32 and peer
#: send run beside the training threads of every rank of the node; at the default 0 they preempt
#: another rank's snapshot in its step (the blocking part) as readily as its forward. 10 gives
#: them about a tenth of a core that a training thread also wants, and all of an idle one; a copy
#: still not committed when the next optimizer step comes is waited for, and counted as blocking.
SNAPSHOT_THREAD_NICE = 10


def job_key(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """A short file-name-safe key for this job, the same in every incarnation.

    From, in order: ``explicit``; ``ROBUST_JOB_ID`` (``robust run`` sets it per run directory);
    torchrun's ``TORCHELASTIC_RUN_ID`` unless it is torchrun's default ``none``. Without any,
    CheckpointError: two unrelated jobs on a node would otherwise restore each other's state.
    """
    env = os.environ if env is None else env
    raw = explicit or env.get(ENV_JOB) or ""
    if not raw:
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        raw = run_id if run_id not in ("", "none") else ""
    if not raw:
        raise CheckpointError(
            "In-memory snapshots need a job id that stays the same across restarts: launch with "
            "`robust run` (sets ROBUST_JOB_ID), torchrun with --rdzv-id, or set ROBUST_JOB_ID yourself."
        )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def own_name(job: str, rank: int, slot: int) -> str:
    """File name of ``rank``'s own snapshot slot."""
    return f"{PREFIX}.{job}.r{rank:05d}.s{slot}"


def held_name(job: str, src: int, holder: int, slot: int) -> str:
    """File name of ``src``'s snapshot as kept by ``holder``."""
    return f"{PREFIX}.{job}.r{src:05d}.at{holder:05d}.s{slot}"


_NAME = re.compile(rf"^{PREFIX}\.([0-9A-Za-z_-]+)\.r(\d+)(?:\.at(\d+))?\.s(\d)$")


def job_files(job: str, root: str = SHM_ROOT) -> list[str]:
    """Every snapshot file of ``job`` under ``root``."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(os.path.join(root, n) for n in names if (m := _NAME.match(n)) and m.group(1) == job)


def remove_job(job: str, root: str = SHM_ROOT) -> int:
    """Delete every snapshot file of ``job`` (own and held); returns how many were removed."""
    n = 0
    for path in job_files(job, root):
        try:
            os.remove(path)
            n += 1
        except FileNotFoundError:
            pass
    return n



def committed_step_of(slot: Slot) -> int:
    """The step of a slot's committed snapshot, -1 when it holds none (checks the header only)."""
    h = slot.header()
    return h.step if h is not None and h.committed else -1


def overwritable(slots: list[Slot], keep: int | None) -> list[int]:
    """Indices of the slots a new snapshot (or copy) may overwrite: all but the one holding
    ``keep``, the step every peer copy holds. If every slot holds it (one a leftover of the same
    step), all but one."""
    kept = [i for i, s in enumerate(slots) if keep is not None and committed_step_of(s) == keep]
    return [i for i in range(len(slots)) if i not in kept] or kept[1:]


def retire_after(slots: list[Slot], max_step: int) -> list[Slot]:
    """Uncommit every slot holding a committed step newer than ``max_step`` (a rollback's last
    good step: those snapshots hold the bad state); returns the slots retired."""
    gone = [s for s in slots if committed_step_of(s) > max_step]
    for s in gone:
        s.set_committed(False)
    return gone


def retire_duplicates(slots: list[Slot], newest: Slot, step: int) -> None:
    """Uncommit every slot but ``newest`` that holds a committed ``step``: a second snapshot of
    a step (``replace_newest``) written into another slot supersedes the first once committed."""
    for other in slots:
        h = other.header() if other is not newest else None
        if h is not None and h.committed and h.step == step:
            other.set_committed(False)


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed, verified snapshot found in shared memory."""

    step: int
    slot: int
    path: str


class SnapshotStore:
    """This rank's snapshots: ``n_slots`` of them in turn (2: a double buffer; 3 with a peer backup).

    ``save(step, state)`` blocks only for the copy of what is not deferred; the deferred copy,
    checksum and commit run on one background thread, in order, and ``after_commit(slot)`` (the
    peer send) on a second one. A failure there is logged at once and raised as CheckpointError
    by the next ``save``, ``settle`` or ``flush``.

    ``verify(slot, step, ranges)``, when given, runs on the first thread after each commit of a
    save that named its ``replicated`` tensors (:mod:`~robust_plugins.checkpoint.replicas`): False
    means the replicas disagree, and that snapshot is neither handed to ``after_commit`` (no peer
    copy, no disk save of it) nor counted as good (:meth:`verdict`).
    """

    def __init__(self, job: str, rank: int, world_size: int, root: str = SHM_ROOT,
                 allowed: Mapping[str, type] | None = None,
                 after_commit: Callable[[int, Slot], None] | None = None,
                 verify: Callable[[Slot, int, list[tuple[int, int]]], bool] | None = None,
                 n_slots: int = 2) -> None:
        if n_slots < 2:
            raise ValueError(f"n_slots={n_slots}: a snapshot store needs at least 2 slots (one may be "
                             f"half-written when the process dies)")
        self.job, self.rank, self.world_size, self.root = job, rank, world_size, root
        self.allowed = dict(allowed or {})
        self.after_commit = after_commit
        self.verify = verify
        self._verified: threading.Event | None = None
        self.bad_step: int | None = None
        """Step of a snapshot whose replicas disagreed (``verify`` returned False), or None."""
        self.slots = [Slot(os.path.join(root, own_name(job, rank, i))) for i in range(n_slots)]
        for s in self.slots:
            s.open_existing()
        # Write order (oldest first is overwritten first). A new store starts from the steps
        # the slots hold, so the newest snapshot of a previous incarnation stays restorable until
        # a newer one is committed; then the order of this process's writes, so a slot left by
        # another run (another world size) is overwritten in turn, not kept forever.
        ages = [committed_step_of(s) for s in self.slots]
        order = sorted(range(n_slots), key=lambda i: (ages[i], i))
        self._stamp = [0] * n_slots
        for k, i in enumerate(order):
            self._stamp[i] = k - n_slots
        self._writes = 0
        self.keep_step: int | None = None
        """A step whose snapshot no save overwrites (the newest one every peer copy holds; set
        by the host after each :meth:`PeerBackup.exchange
        <robust_plugins.checkpoint.peer.PeerBackup.exchange>`), or None."""
        self._queue: queue.Queue = queue.Queue()
        self._after_queue: queue.Queue = queue.Queue()
        self._after: threading.Thread | None = None
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._layout_key: Any = None
        self._layout: tuple[list[int], int] = ([], 0)
        self.last_blocking_s = 0.0
        """Seconds the last :meth:`save` kept the caller waiting."""
        self.committed_step: int | None = None
        """Step of the newest snapshot committed by this process."""
        self._settled: threading.Event | None = None
        self.before_deferred_copy: Callable[[int], None] | None = None
        """Fault injection (tests): called on the snapshot thread with the step, before that
        snapshot's deferred tensors are copied; holding it keeps the copy in flight."""

    # --------------------------------------------------------------------------------- save
    def save(self, step: int, state: Any, replace_newest: bool = False, defer: set[int] | None = None,
             timeout_s: float = 600.0, replicated: set | None = None) -> float:
        """Snapshot ``state`` as ``step``; returns the seconds the caller was blocked.

        ``replace_newest``: write into the slot of the newest snapshot instead of the other one
        (a second snapshot of the same step, e.g. with more state; the older slot stays intact
        meanwhile, so a crash during the rewrite still leaves the previous step).

        ``defer``: ``data_ptr()`` of tensors that nothing changes until the caller's next
        :meth:`settle` (parameters and optimizer state, before the next optimizer step). Those
        are copied on the snapshot thread, after this call returns; each one's autograd version
        counter is read here and again after its copy, and a tensor changed in place in between
        fails the snapshot (never committed; the next ``save``/``settle`` raises). Writes through
        another alias (``.data``, a flat buffer the tensor is a view of) do not move the counter:
        ``settle`` before anything changes them is what keeps the copy exact.

        ``replicated``: :func:`~robust_plugins.checkpoint.replicas.replicated_keys` of the
        parameters every data-parallel replica holds alike; with a ``verify`` hook their bytes in
        the slot are checked against the replicas after the commit."""
        t0 = time.perf_counter()
        self._raise_if_failed()
        # The previous snapshot's deferred copy reads the same tensors this one will: let it
        # finish first (normally long done: the optimizer step before this save waited for it).
        self.settle(timeout_s)
        if self.verdict(timeout_s) is not None:
            # The slot this save would overwrite holds the newest snapshot the replicas agreed on.
            raise CheckpointError(
                f"rank {self.rank}: the replicas' parameters differed in the snapshot of step {self.bad_step} "
                f"(silent data corruption); no later snapshot is taken, so the one before it stays in memory "
                f"for the rollback. Under robust run the job is rolled back; restart it from that snapshot.")
        paths: list | None = [] if defer else None
        schema, tensors = flat.flatten(state, self.allowed, paths)
        key = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        if key != self._layout_key:
            offsets, off = [], 0
            for t in tensors:
                offsets.append(off)
                off = _align(off + t.numel() * t.element_size(), _ALIGN)
            self._layout_key, self._layout = key, (offsets, off)
        offsets, data_len = self._layout
        schema["offsets"] = offsets
        schema_bytes = json.dumps(schema, separators=(",", ":")).encode()
        index = self._pick(replace_newest, timeout_s)
        slot = self.slots[index]
        # Room for the schema to grow (step counters, scheduler values) without a re-layout.
        schema_cap = _align(max(len(schema_bytes) * 2, 64 << 10), 4096)
        h = slot.header()
        if h is not None and h.data_off - HEADER_SIZE >= len(schema_bytes) and len(slot.buf) >= h.data_off + data_len:
            data_off = h.data_off
        else:
            data_off = HEADER_SIZE + schema_cap
        slot.ensure(data_off + data_len)
        if slot.header() is not None:
            slot.set_committed(False)
        buf = slot.bytes()
        copier = devcopy.for_tensors(tensors, slot)  # CUDA state: async copies (None: host only)
        later = []  # (tensor, start, bytes, version at the save, path): the snapshot thread copies these
        for i, (t, off) in enumerate(zip(tensors, offsets)):
            n = t.numel() * t.element_size()
            if not n:
                continue
            if defer and t.data_ptr() in defer:
                later.append((t, data_off + off, n, t._version, paths[i]))
            else:
                devcopy.copy_into(buf[data_off + off:data_off + off + n].view(t.dtype).view(t.shape), t, copier)
        if copier is not None:
            copier.fence_inline()
        ranges = None
        if self.verify is not None and replicated:
            ranges = replicas.replica_ranges(tensors, offsets, data_off, replicated)
        buf[HEADER_SIZE:HEADER_SIZE + len(schema_bytes)] = torch.frombuffer(bytearray(schema_bytes), dtype=torch.uint8)
        slot.write_header(Header(False, step, self.rank, self.world_size, len(schema_bytes), data_off,
                                 data_len, 0, self.job))
        slot.busy.set()
        self._settled = settled = threading.Event()
        self._verified = verified = threading.Event() if ranges is not None else None
        self._ensure_thread()
        self._queue.put((index, slot, step, later, settled, copier, ranges, verified))
        self.last_blocking_s = time.perf_counter() - t0
        return self.last_blocking_s

    def settle(self, timeout_s: float = 600.0) -> float:
        """Wait until the newest snapshot is committed (deferred tensors copied, checksummed,
        ``committed`` written); returns the seconds waited. Raises CheckpointError if it failed
        or does not finish within ``timeout_s``. Call it before anything changes the tensors
        given to ``save(defer=...)``; the peer send is not waited for."""
        settled = self._settled
        if settled is None or settled.is_set():
            self._raise_if_failed()
            return 0.0
        t0 = time.perf_counter()
        if not settled.wait(timeout_s):
            raise CheckpointError(f"in-memory snapshot of rank {self.rank} not committed after {timeout_s:g} s "
                                  f"(its copy or checksum is stuck on the snapshot thread)")
        self._raise_if_failed()
        return time.perf_counter() - t0

    def verdict(self, timeout_s: float = 600.0) -> int | None:
        """Wait until the newest snapshot's replica check is done; the step of a snapshot whose
        replicas disagreed (this process's first), or None. Raises CheckpointError if the check
        failed (a replica did not answer) or does not end within ``timeout_s``."""
        verified = self._verified
        if verified is not None and not verified.wait(timeout_s):
            raise CheckpointError(f"replica check of rank {self.rank}'s newest snapshot not done after "
                                  f"{timeout_s:g} s (a replica does not answer)")
        self._raise_if_failed()
        return self.bad_step

    def _ensure_thread(self) -> None:
        # Two threads: one commits (crc32, committed flag), one runs after_commit (peer send,
        # background disk save). A slow disk save of step N must not delay the commit of N+1:
        # measured under robust run, a rank killed two steps after a persist step otherwise lost
        # 2 steps instead of at most 1 (its next snapshot sat uncommitted behind the save).
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name=f"robust-snapshot-r{self.rank}", daemon=True)
            self._thread.start()
        if self.after_commit is not None and (self._after is None or not self._after.is_alive()):
            self._after = threading.Thread(target=self._work_after, name=f"robust-snapshot-send-r{self.rank}",
                                           daemon=True)
            self._after.start()

    @staticmethod
    def _lower_priority() -> None:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + SNAPSHOT_THREAD_NICE))
        except (AttributeError, OSError) as exc:  # not Linux, or not permitted: only slower to finish
            log.debug("robust_plugins: snapshot thread keeps its priority (%s)", exc)

    def _fail(self, step: int, exc: BaseException) -> None:
        self._error = f"snapshot of step {step} on rank {self.rank}: {type(exc).__name__}: {exc}"
        log.error("robust_plugins: in-memory snapshot hand-off failed: %s", self._error)

    def _work(self) -> None:
        self._lower_priority()
        while True:
            item = self._queue.get()
            if item is None:
                if self.after_commit is not None:
                    self._after_queue.put(None)
                return
            index, slot, step, later, settled, copier, ranges, verified = item
            handed = False
            try:
                if self._error is None:
                    if later and self.before_deferred_copy is not None:
                        self.before_deferred_copy(step)
                    self._copy_deferred(slot, step, later, copier)
                    h = slot.header()
                    crc = _crc(slot.buf, HEADER_SIZE, h.total)
                    struct.pack_into("<I", slot.buf, 56, crc)
                    slot.set_committed(True)
                    retire_duplicates(self.slots, slot, step)
                    self.committed_step = step
                    # The next optimizer step may change the tensors now; the replicas' verdict
                    # is waited for only before the next snapshot (:meth:`verdict`).
                    settled.set()
                    if ranges is not None and not self.verify(slot, step, ranges):
                        # Every replica sees the same mismatch and uncommits the same step, so
                        # no restore can pick it, whatever the rollback bound says.
                        slot.set_committed(False)
                        self.bad_step = step
                    elif self.after_commit is not None:
                        self._after_queue.put((index, slot, step))
                        handed = True
            except Exception as exc:  # noqa: BLE001 - reported now and raised by the next save
                self._fail(step, exc)
            finally:
                settled.set()
                if verified is not None:
                    verified.set()
                if not handed:
                    slot.busy.clear()

    @staticmethod
    def _copy_deferred(slot: Slot, step: int, later: list, copier: devcopy.DeviceCopier | None) -> None:
        buf = slot.bytes()
        if copier is not None:
            copier.on_thread()
        for t, start, n, _, _ in later:
            devcopy.copy_into(buf[start:start + n].view(t.dtype).view(t.shape), t, copier)
        if copier is not None:
            copier.finish()  # every byte landed before the version check, the crc and the commit
        moved = [path for t, _, _, version, path in later if t._version != version]
        if moved:
            raise CheckpointError(
                f"{len(moved)} tensor(s) changed in place while the snapshot of step {step} was being copied, "
                f"first {flat.path_text(moved[0])}; the snapshot would mix two steps and was not committed (the previous one "
                f"stays the restore point). Something other than the optimizer step changed them before it "
                f"(the training loop, a forward hook): keep such changes inside the optimizer step, or set "
                f"checkpoint.memory_copy to \"in_step\" to copy everything inside the step.")

    def _work_after(self) -> None:
        self._lower_priority()
        while True:
            item = self._after_queue.get()
            if item is None:
                return
            index, slot, step = item
            try:
                if self._error is None:
                    self.after_commit(index, slot)
            except Exception as exc:  # noqa: BLE001 - reported now and raised by the next save
                self._fail(step, exc)
            finally:
                slot.busy.clear()

    def _pick(self, replace_newest: bool, timeout_s: float) -> int:
        """The slot a save writes: one holding no committed snapshot (none written yet, torn,
        retired), else the oldest; never the one of :attr:`keep_step`; with
        ``replace_newest`` the newest, unless it is the one kept (then the oldest, and the
        commit retires the kept slot's copy of the same step). A chosen slot still being handed
        off (peer send, disk save) is waited for, and the choice made again: the hand-off may
        move :attr:`keep_step`."""
        if replace_newest:
            self.flush(timeout_s)  # the newest snapshot's own hand-off reads the slot
        deadline = time.monotonic() + timeout_s
        while True:
            free = overwritable(self.slots, self.keep_step)
            newest = max(range(len(self.slots)), key=lambda i: self._stamp[i])
            # A slot without a committed snapshot (never written, torn, retired as a duplicate or
            # as newer than a rollback's bound) goes before any that holds one.
            index = newest if replace_newest and newest in free else min(
                free, key=lambda i: (committed_step_of(self.slots[i]) >= 0, self._stamp[i]))
            if not self.slots[index].busy.is_set():
                self._raise_if_failed()
                self._writes += 1
                self._stamp[index] = self._writes
                return index
            if time.monotonic() > deadline:
                raise CheckpointError(f"snapshot slot {self.slots[index].path} still busy after {timeout_s:g} s "
                                      f"(checksum or peer send stuck)")
            time.sleep(0.0005)

    def _wait_idle(self, slot: Slot, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while slot.busy.is_set():
            if time.monotonic() > deadline:
                raise CheckpointError(f"snapshot slot {slot.path} still busy after {timeout_s:g} s "
                                      f"(checksum or peer send stuck)")
            time.sleep(0.0005)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"An in-memory snapshot failed in the background ({self._error}); "
                                  f"snapshots stopped. Restart from the last committed one.")

    def flush(self, timeout_s: float = 600.0) -> None:
        """Wait until every handed-off snapshot is committed (and sent); raise if one failed."""
        for s in self.slots:
            self._wait_idle(s, timeout_s)

    # ------------------------------------------------------------------------------ restore
    def own_snapshots(self, why: dict[str, str] | None = None) -> list[SnapshotInfo]:
        """This rank's committed, verified snapshots, newest first; ``why`` collects the rest."""
        out = []
        for i, s in enumerate(self.slots):
            if s._map is None and not s.open_existing():
                continue
            problem = s.problem(self.job, self.world_size, self.rank)
            if problem is None:
                out.append(SnapshotInfo(s.header().step, i, s.path))
            elif why is not None:
                why[s.path] = problem
        return sorted(out, key=lambda x: x.step, reverse=True)

    def load(self, slot: int) -> tuple[int, Any]:
        """(step, state) of own slot ``slot``."""
        return self.slots[slot].read(self.allowed)

    def close(self, remove: bool = False) -> None:
        """Stop the background thread (after it finishes), unmap, and with ``remove`` delete the files."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=600)
        if self._after is not None and self._after.is_alive():
            self._after.join(timeout=600)
        for s in self.slots:
            s.unmap()
            if remove:
                try:
                    os.remove(s.path)
                except FileNotFoundError:
                    pass

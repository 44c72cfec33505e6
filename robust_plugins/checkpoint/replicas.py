"""Each in-memory snapshot checked against the other data-parallel replicas (silent data corruption).

The replicas of one data-parallel group hold bit-identical parameters after every optimizer step.
Once a snapshot is committed, the snapshot thread hashes the parameters' bytes *in the slot*
(:func:`slot_digest`: crc32, chained over the parameters in order; a crc32 changes for every single
flipped bit) and agrees on the hash with the other replicas over a gloo group of its own
(:class:`ReplicaCheck`): one all-reduce of ``(h, -h)`` with MAX, 16 bytes whatever the group's
size, and only after a mismatch an all-gather of every replica's hash, which names the ranks that
differ. It runs while the next forward and backward do; the binding waits for the verdict of
snapshot N at the next optimizer step, where it waits for N's copy already, and holds after a
mismatch (:mod:`robust_plugins.watchdog.snapshot_check`), so snapshot N+1, which would overwrite
the slot of N-1, the newest one known good, is never taken. A corruption found at snapshot N rolls
back to N-1, from memory, whatever ``sdc_every_steps`` says.

Why the bytes in the slot and not the live parameters: they are the bytes a restore would load,
already on the host (a GPU job's copy went to pinned memory anyway), and they do not change while
the next step runs.
"""

from __future__ import annotations

import datetime
import zlib
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from robust_plugins.checkpoint import coord
from robust_plugins.checkpoint.slot import Slot
from robust_plugins.device import collective_device
from robust_plugins.errors import CheckpointError

#: crc32 in 64 MiB pieces (zlib releases the GIL for each), as the slot's own checksum.
_CHUNK = 64 << 20


def replica_ranges(tensors: Sequence[torch.Tensor], offsets: Sequence[int], data_off: int,
                   replicated: set[tuple[int, tuple[int, ...], torch.dtype]]) -> list[tuple[int, int]]:
    """``(start, nbytes)`` in the slot of every tensor that is a replicated parameter, in order.

    ``replicated``: ``(data_ptr, shape, dtype)`` of the parameters every replica holds alike. The
    shape and dtype are part of the key because a flat buffer starts at its first parameter's
    address: the address alone would also match a view of the buffer (a ZeRO partition)."""
    out, found = [], set()
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if n and key in replicated:
            out.append((data_off + off, n))
            found.add(key)
    if len(found) != len(replicated):
        # Never a silent pass: hashing fewer parameters than asked (none, at worst) would agree.
        raise CheckpointError(f"replica check: {len(replicated) - len(found)} of {len(replicated)} parameters are "
                              f"not in the snapshot's state (were they re-allocated?). Set "
                              f"checkpoint.verify_replicas false if the parameters live outside the module.")
    return out


def replicated_keys(params: Iterable[torch.Tensor]) -> set[tuple[int, tuple[int, ...], torch.dtype]]:
    """The keys :func:`replica_ranges` matches, for ``params``."""
    return {(p.data_ptr(), tuple(p.shape), p.dtype) for p in params if p.numel()}


def slot_digest(slot: Slot, ranges: Sequence[tuple[int, int]]) -> int:
    """crc32 of the bytes at ``ranges`` of ``slot``, chained in order (0 <= h < 2**32)."""
    view = memoryview(slot.buf)
    crc = 0
    try:
        for start, n in ranges:
            for off in range(start, start + n, _CHUNK):
                crc = zlib.crc32(view[off:min(start + n, off + _CHUNK)], crc)
    finally:
        view.release()
    return crc


def plan_sets(reported: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The distinct replica sets of the job, in one order every rank computes alike.

    ``reported[r]``: the global ranks of rank r's data-parallel group (itself included). Raises
    CheckpointError when they do not partition the ranks (a rank in two sets, or a rank whose
    set does not hold it): the check would then compare ranks that are not replicas."""
    sets = sorted({tuple(sorted(int(x) for x in s)) for s in reported})
    seen: dict[int, tuple[int, ...]] = {}
    for s in sets:
        for r in s:
            if r in seen:
                raise CheckpointError(f"replica check: rank {r} is in two data-parallel groups {seen[r]} and {s}; "
                                      f"the groups must partition the ranks. Set checkpoint.verify_replicas false.")
            seen[r] = s
    for r, s in enumerate(reported):
        if r not in s:
            raise CheckpointError(f"replica check: rank {r} reported the data-parallel group {sorted(s)}, "
                                  f"which does not hold it.")
    return sets


class ReplicaCheck:
    """This rank's agreement with its replicas, on a gloo group of the snapshot thread's own.

    Collective when built (every rank of the job, in the same order): the replica sets are
    gathered and a gloo group is made for each. ``timeout_s`` bounds each agreement: a replica
    that does not answer (dead, or stuck) turns into a CheckpointError on the snapshot thread."""

    def __init__(self, my_set: Sequence[int], timeout_s: float) -> None:
        self.rank = dist.get_rank()
        self.timeout_s = timeout_s
        sets = plan_sets(coord.all_gather_json(sorted(int(r) for r in my_set), timeout_s,
                                               "replica check: gathering the data-parallel groups"))
        self.group: Any = None
        self.ranks: tuple[int, ...] = ()
        for s in sets:
            # new_group is collective over the whole job: every rank creates every group, in order.
            g = dist.new_group(ranks=list(s), backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            if self.rank in s:
                self.group, self.ranks = g, s
        self.size = len(self.ranks)

    def agree(self, digest: int) -> dict[int, int] | None:
        """None when every replica has ``digest``; else every replica's digest by global rank."""
        if self.size < 2:
            return None
        dev = collective_device(self.group)  # the group is gloo: CPU, whatever the job's backend
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=dev)
        coord._wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                    self.timeout_s, "replica check: agreeing on the snapshot's parameter hash")
        if int(both[0]) == -int(both[1]):  # max == min: all the same
            return None
        mine = torch.tensor([digest], dtype=torch.int64, device=dev)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        coord._wait(dist.all_gather(every, mine, group=self.group, async_op=True), self.timeout_s,
                    "replica check: gathering every replica's parameter hash")
        return {r: int(t) for r, t in zip(self.ranks, every)}

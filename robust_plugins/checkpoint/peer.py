"""Peer backup of in-memory snapshots: each rank's newest snapshot also lives on another rank.

:func:`plan_peers` (pure) chooses, for every rank, the rank that keeps its copy: on another node
whenever there is more than one, and outside the rank's own model/data-parallel groups when the
layout allows. The plan is a permutation (every rank keeps exactly one other rank's copy), so
shared memory use is the same on every node.

:class:`PeerBackup` moves bytes: after each snapshot commits, every rank sends its slot to its
holder and receives its source's slot, as raw uint8 tensors over a dedicated gloo group
(``isend``/``irecv``; never a pickled object), into one of three ``held`` slots whose
``committed`` word is written after the last byte arrived. Every wait is bounded.

After each exchange the ranks agree (a MIN all-reduce of one integer) on
:attr:`PeerBackup.agreed_step`: every rank then holds its source's copy of that step, and neither that copy nor the rank's own
snapshot of it is overwritten until a newer step is agreed (``SnapshotStore.keep_step``). A node
lost while a copy is in flight thus still leaves one step that every rank has, the agreed one,
at most two steps old (the sender overwrites its slot of step N only once the copy of N is
agreed, with three own slots).
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from robust_plugins._logging import get_logger
from robust_plugins.checkpoint.memory import (
    HEADER_SIZE,
    SHM_ROOT,
    Header,
    SnapshotInfo,
    Slot,
    committed_step_of,
    held_name,
    overwritable,
    retire_duplicates,
)
from robust_plugins.device import collective_device
from robust_plugins.errors import CheckpointError

log = get_logger(__name__)

#: Node moves and local rotations tried (each at most this many): plenty for the TP/PP layouts we
#: know, and it bounds the planner at O(world x 64 x 64) in the worst (no perfect holder) case.
_EXTRA_SHIFTS = 64


def plan_peers(hosts: Sequence[str], groups: Sequence[Sequence[int]] = ()) -> list[int]:
    """``holder[r]``: the rank that keeps rank ``r``'s snapshot copy.

    ``hosts[r]`` names rank ``r``'s node; ``groups`` lists rank groups (TP, PP, DP, ...) a copy
    should leave. With equal nodes the candidates move every rank ``s`` nodes on and ``j`` local
    slots round (node ``n``, local ``i`` -> node ``n+s``, local ``i+j``); with uneven nodes they are
    cyclic shifts of the node-major rank order. Each candidate is a permutation; the winner has,
    in this order, the fewest holders on the source's own node, the fewest holders sharing a group
    with their source, and the smallest move. Raises CheckpointError for a single rank.
    """
    world = len(hosts)
    if world < 2:
        raise CheckpointError("peer_backup needs at least 2 ranks: a single rank has no peer. "
                              "Set peer_backup to false.")
    nodes: dict[str, list[int]] = {}
    for r in sorted(range(world), key=lambda r: (hosts[r], r)):
        nodes.setdefault(hosts[r], []).append(r)
    table = list(nodes.values())
    member: dict[int, set[int]] = {r: set() for r in range(world)}
    for gi, g in enumerate(groups):
        for r in g:
            if 0 <= r < world:
                member[r].add(gi)

    def candidates():
        n, m = len(table), len(table[0])
        if all(len(t) == m for t in table):
            for s in range(min(n, _EXTRA_SHIFTS)):
                for j in range(min(m, _EXTRA_SHIFTS)):
                    if s == 0 and j == 0:
                        continue
                    holder = [0] * world
                    for a, ranks in enumerate(table):
                        for i, r in enumerate(ranks):
                            holder[r] = table[(a + s) % n][(i + j) % m]
                    yield (s, j), holder
        else:
            order = [r for t in table for r in t]
            for k in range(1, min(world, _EXTRA_SHIFTS * 2)):
                holder = [0] * world
                for i, r in enumerate(order):
                    holder[r] = order[(i + k) % world]
                yield (k, 0), holder

    best: tuple | None = None
    for move, holder in candidates():
        same_node = sum(hosts[r] == hosts[holder[r]] for r in range(world))
        shared = sum(bool(member[r] & member[holder[r]]) for r in range(world))
        score = (same_node, shared, move)
        if best is None or score < best[0]:
            best = (score, holder)
            if same_node == 0 and shared == 0:
                break
    return best[1]


def _wait(works: list, timeout_s: float, what: str) -> None:
    for w in works:
        try:
            w.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise CheckpointError(f"{what}: the peer did not answer within {timeout_s:g} s ({exc}).") from exc


def _meta(h: Header, device: Any) -> torch.Tensor:
    return torch.tensor([h.step, h.rank, h.world_size, h.schema_len, h.data_off, h.data_len, h.crc, 0],
                        dtype=torch.int64, device=device)


def _host_group(group: Any) -> torch.device:
    """The device of ``group``'s tensors, which must be the host: slots are shared host memory."""
    device = collective_device(group)
    if device.type != "cpu":
        raise CheckpointError(
            f"the peer backup sends shared-memory snapshot bytes (host memory), but its process group moves "
            f"{device.type} tensors ({dist.get_backend(group)}); give it a gloo group "
            f"(torch.distributed.new_group(backend=\"gloo\")), as the DeepSpeed and megatron-core bindings do.")
    return device


def send_slot(slot: Slot, dst: int, group: Any, timeout_s: float, what: str) -> None:
    """Send a committed slot's header fields and bytes to ``dst``."""
    h = slot.header()
    meta = _meta(h, _host_group(group))
    _wait([dist.isend(meta, dst=dst, group=group)], timeout_s, what)
    if h.total > HEADER_SIZE:
        _wait([dist.isend(slot.bytes()[HEADER_SIZE:h.total], dst=dst, group=group)], timeout_s, what)


def recv_slot(slot: Slot, src: int, job: str, group: Any, timeout_s: float, what: str) -> Header:
    """Receive what :func:`send_slot` sent into ``slot``; committed only after the last byte."""
    meta = torch.zeros(8, dtype=torch.int64, device=_host_group(group))
    _wait([dist.irecv(meta, src=src, group=group)], timeout_s, what)
    step, rank, world, slen, doff, dlen, crc, _ = (int(x) for x in meta.tolist())
    h = Header(False, step, rank, world, slen, doff, dlen, crc, job)
    slot.ensure(h.total)
    if slot.header() is not None:
        slot.set_committed(False)
    if h.total > HEADER_SIZE:
        _wait([dist.irecv(slot.bytes()[HEADER_SIZE:h.total], src=src, group=group)], timeout_s, what)
    slot.write_header(h)
    slot.set_committed(True)
    return h


class PeerBackup:
    """This rank's side of the peer backup: sends its snapshots, keeps its source's."""

    def __init__(self, job: str, rank: int, holders: Sequence[int], group: Any,
                 root: str = SHM_ROOT, timeout_s: float = 300.0, n_slots: int = 3) -> None:
        self.job, self.rank, self.group, self.timeout_s = job, rank, group, timeout_s
        _host_group(group)  # refused here, not later on the snapshot thread
        self.holders = list(holders)
        self.holder = self.holders[rank]
        """The rank that keeps this rank's copy."""
        self.source = self.holders.index(rank)
        """The rank whose copy this rank keeps."""
        self.held = [Slot(os.path.join(root, held_name(job, self.source, rank, i))) for i in range(n_slots)]
        for s in self.held:
            s.open_existing()
        self.sent_step: int | None = None
        """Step of the last snapshot this rank's holder acknowledged receiving (by completion)."""
        self.agreed_step: int | None = None
        """The newest step whose copy every rank holds (agreed after each exchange), or None
        before the first. Its held copy is not overwritten; the host passes it on as the own
        store's ``keep_step``."""

    def exchange(self, own: Slot) -> int:
        """Send ``own`` (just committed) to the holder, receive the source's newest snapshot, and
        agree with every rank on the step all copies hold; returns :attr:`agreed_step`.

        Called on the snapshot thread of every rank for every snapshot, in step order, so the
        pairs match. Sends and receives are posted together (a ring would deadlock otherwise).
        """
        h = own.header()
        what = f"peer backup of step {h.step} (rank {self.rank} -> {self.holder}, {self.source} -> {self.rank})"
        device = _host_group(self.group)
        meta_out, meta_in = _meta(h, device), torch.zeros(8, dtype=torch.int64, device=device)
        _wait([dist.isend(meta_out, dst=self.holder, group=self.group),
               dist.irecv(meta_in, src=self.source, group=self.group)], self.timeout_s, what)
        step, rank, world, slen, doff, dlen, crc, _ = (int(x) for x in meta_in.tolist())
        got = Header(False, step, rank, world, slen, doff, dlen, crc, self.job)
        # The oldest copy goes, never the agreed one. A second snapshot of a step held already
        # (save_checkpoint's client_state, SnapshotStore.save(replace_newest=True)) lands in
        # another slot and retires the first once committed, as on the source.
        slot = min((self.held[i] for i in overwritable(self.held, self.agreed_step)), key=committed_step_of)
        slot.ensure(got.total)
        if slot.header() is not None:
            slot.set_committed(False)
        works = []
        if h.total > HEADER_SIZE:
            works.append(dist.isend(own.bytes()[HEADER_SIZE:h.total], dst=self.holder, group=self.group))
        if got.total > HEADER_SIZE:
            works.append(dist.irecv(slot.bytes()[HEADER_SIZE:got.total], src=self.source, group=self.group))
        _wait(works, self.timeout_s, what)
        slot.write_header(got)
        slot.set_committed(True)
        retire_duplicates(self.held, slot, step)
        self.sent_step = h.step
        # Every rank has finished this exchange once the all-reduce returns anywhere: the
        # minimum step is held by every rank's holder, and every rank still has its own.
        agreed = torch.tensor([h.step], dtype=torch.int64, device=device)
        _wait([dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group, async_op=True)],
              self.timeout_s, f"{what}: agreeing on the step every copy holds")
        self.agreed_step = int(agreed.item())
        return self.agreed_step

    def held_snapshots(self, world_size: int, why: dict[str, str] | None = None) -> list[SnapshotInfo]:
        """Verified copies of the source's snapshots this rank keeps, newest first."""
        out = []
        for i, s in enumerate(self.held):
            if s.header() is None and not s.open_existing():
                continue
            problem = s.problem(self.job, world_size, self.source)
            if problem is None:
                out.append(SnapshotInfo(s.header().step, i, s.path))
            elif why is not None:
                why[s.path] = problem
        return sorted(out, key=lambda x: x.step, reverse=True)

    def close(self, remove: bool = False) -> None:
        """Unmap; with ``remove`` delete the held files."""
        for s in self.held:
            s.unmap()
            if remove:
                try:
                    os.remove(s.path)
                except FileNotFoundError:
                    pass

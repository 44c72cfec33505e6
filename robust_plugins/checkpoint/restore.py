"""Restore order on restart, for any host: own memory snapshot -> a peer's copy -> disk.

Every rank reports what it finds in shared memory (its own verified snapshots and the verified
copies it keeps for its peer source); :func:`plan_restore` (pure, run identically on every rank
from the gathered reports) picks the newest step that *every* rank can restore (all ranks must
resume from the same step), preferring each rank's own snapshot and else a holder's copy.
:func:`restore_from_memory` carries the plan out: holders send copies to the ranks that lost
theirs (raw bytes into the receiver's own slot, verified by crc32 before use), and each rank reads
its state. When no step is common to all ranks, or a disk checkpoint is newer, the memory tier is
skipped with one log line saying why and the host falls back to its newest verified disk
checkpoint (:class:`~robust_plugins.checkpoint.disk.DiskCheckpointer`), then older ones.

A host integration (``patches/deepspeed.py``; megatron-core likewise) calls::

    found = restore_from_memory(store, peers, world_size, timeout_s, disk_step=...)
    if found is None: ...load from disk...
    else: step, state, source = found; ...apply state...
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from robust_plugins._logging import get_logger
from robust_plugins.checkpoint import coord
from robust_plugins.checkpoint.memory import SnapshotStore, retire_after
from robust_plugins.checkpoint.peer import PeerBackup, recv_slot, send_slot
from robust_plugins.errors import CheckpointError

log = get_logger(__name__)

MEMORY, PEER = "memory", "peer"


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_restore` decided."""

    step: int | None
    """The step every rank restores; None when memory cannot serve (see ``reason``)."""

    sources: tuple[tuple[str, int, int], ...] = ()
    """Per rank: (``memory``, rank, own slot) or (``peer``, holder rank, held slot)."""

    reason: str = ""
    """Why the memory tier was skipped (``step`` None)."""


def plan_restore(reports: Sequence[dict], disk_step: int | None = None, max_step: int | None = None) -> Plan:
    """Choose the step and the source of every rank's state from the gathered reports.

    ``reports[r]`` is ``{"own": [[step, slot], ...], "held": {"<src>": [[step, slot], ...]}}``
    (verified snapshots only). ``disk_step``: step of the newest committed disk checkpoint; a
    memory step older than it is not used. ``max_step``: newest step known to be good (after a
    rollback, :func:`rollback_bound`); newer snapshots are not used.
    """
    world = len(reports)
    own = [{s: slot for s, slot in rep.get("own", [])} for rep in reports]
    held: list[dict[int, tuple[int, int]]] = [{} for _ in range(world)]
    for holder, rep in enumerate(reports):
        for src, entries in rep.get("held", {}).items():
            for step, slot in entries:
                held[int(src)].setdefault(step, (holder, slot))
    avail = [set(own[r]) | set(held[r]) for r in range(world)]
    lacking = [r for r in range(world) if not avail[r]]
    if lacking:
        return Plan(None, reason=f"ranks {lacking} have no snapshot in memory and no peer holds one")
    common = set.intersection(*avail)
    if max_step is not None and common and not any(s <= max_step for s in common):
        return Plan(None, reason=f"the job rolls back to step {max_step} or earlier and memory holds "
                                 f"only steps {sorted(common, reverse=True)} for every rank")
    if max_step is not None:
        common = {s for s in common if s <= max_step}
    if not common:
        have = "; ".join(f"rank {r}: {sorted(avail[r], reverse=True)}" for r in range(world))
        return Plan(None, reason=f"no step is held for every rank ({have})")
    step = max(common)
    if disk_step is not None and disk_step > step:
        return Plan(None, reason=f"the newest memory step {step} is older than the disk checkpoint of step {disk_step}")
    sources = tuple((MEMORY, r, own[r][step]) if step in own[r] else (PEER, *held[r][step]) for r in range(world))
    return Plan(step, sources)


def rollback_bound(env: Mapping[str, str] | None = None) -> int | None:
    """Newest step a restarted ``robust run`` incarnation may restore, or None (no limit).

    A ``rollback`` (nan, spike, sdc) means the state after some step is bad, and a snapshot taken
    every step holds it. ``robust run`` sets ``ROBUST_ROLLBACK_MAX_STEP`` for the restarted
    ranks; without it, ``faults.jsonl`` (``robust_plugins/watchdog/FORMAT.md``) of the run
    directory says which step (a relaunch with the same ``--run-dir``). For the previous incarnation's rollbacks: ``step - 1`` for nan and
    spike (the update of the step that tripped the detector is the bad one), ``step -
    check_every`` for sdc (the corruption happened since the previous check).
    """
    env = os.environ if env is None else env
    # robust run's monitor says it when it starts a rollback's incarnation (the fault's line in
    # faults.jsonl is written only once the restarted job reports its first step).
    if env.get("ROBUST_ROLLBACK_MAX_STEP", "").strip().lstrip("-").isdigit():
        return int(env["ROBUST_ROLLBACK_MAX_STEP"])
    run_dir, inc = env.get("ROBUST_RUN_DIR"), env.get("ROBUST_INCARNATION")
    path = os.path.join(run_dir, "faults.jsonl") if run_dir else None
    if not path or not inc or not os.path.exists(path):
        return None
    bound = None
    with open(path) as f:
        for line in f:
            try:
                fault = json.loads(line)
            except ValueError:
                continue
            if fault.get("incarnation") != int(inc) - 1 or fault.get("action") != "rollback":
                continue
            step = fault.get("step")
            if not isinstance(step, int):
                continue
            back = (fault.get("detail") or {}).get("check_every", 1) if fault.get("kind") == "sdc" else 1
            limit = step - int(back)
            bound = limit if bound is None else min(bound, limit)
    return bound


def restore_from_memory(store: SnapshotStore, peers: PeerBackup | None, timeout_s: float,
                        disk_step: int | None = None, device: Any = None,
                        max_step: int | None = None) -> tuple[int, Any, str] | None:
    """Carry out the plan on every rank (a collective); (step, state, source) or None.

    ``source`` is ``memory`` or ``peer:<holder>``. ``device``: of the agreement's tensors (None:
    what the default group's backend moves). Returns None (every rank alike) when memory
    cannot serve; the reason is logged once on rank 0, and each rank logs why its own slots
    were unusable. With ``max_step``, every own and held snapshot newer than it is retired
    (uncommitted) first, whatever the outcome: it holds a rollback's bad state.
    """
    rank, world = store.rank, store.world_size
    retired: set[str] = set()
    if max_step is not None:
        # Snapshots newer than a rollback's bound hold the bad state: retired here, before the
        # gather, so that once any rank is past it none is left for a later restore to pick
        # (the monitor bounds a rollback of a later incarnation by that fault's step only).
        for slots, whose in ((store.slots, "own"), (peers.held if peers is not None else [], "held")):
            for s in slots:
                if s.header() is None:
                    s.open_existing()
            gone = retire_after(slots, max_step)
            if gone:
                retired.update(s.path for s in gone)
                log.warning("robust_plugins: [rank %d] retired %s snapshot(s) of step(s) %s: newer than the "
                            "rollback's last good step %d", rank, whose, sorted(s.header().step for s in gone),
                            max_step)
    why: dict[str, str] = {}
    own = store.own_snapshots(why)
    held = peers.held_snapshots(world, why) if peers is not None else []
    for path in retired:
        why.pop(path, None)
    for path, problem in why.items():
        log.warning("robust_plugins: [rank %d] snapshot %s skipped: %s", rank, path, problem)
    report = {"own": [[s.step, s.slot] for s in own],
              "held": {str(peers.source): [[s.step, s.slot] for s in held]} if peers is not None else {}}
    reports = coord.all_gather_json(report, timeout_s, "restore: gathering in-memory snapshots", device=device)
    plan = plan_restore(reports, disk_step, max_step)
    if plan.step is None:
        if rank == 0:
            log.warning("robust_plugins: in-memory snapshots skipped: %s; trying disk checkpoints", plan.reason)
        return None
    group = peers.group if peers is not None else None
    # A copy coming from a peer lands in one of this rank's own slots: one that holds nothing
    # usable if there is one, else the oldest.
    mine = {s.slot: s.step for s in own}
    target = min(range(len(store.slots)), key=lambda i: mine.get(i, -1))
    for r, (kind, holder, slot) in enumerate(plan.sources):
        if kind != PEER:
            continue
        what = f"restore: rank {holder} sending rank {r}'s step {plan.step}"
        if rank == holder:
            send_slot(peers.held[slot], r, group, timeout_s, what)
        elif rank == r:
            h = recv_slot(store.slots[target], holder, store.job, group, timeout_s, what)
            problem = store.slots[target].problem(store.job, world, rank)
            if problem is not None:
                raise CheckpointError(f"{what}: the received copy does not verify ({problem}).")
            if h.step != plan.step:
                raise CheckpointError(f"{what}: received step {h.step}")
    kind, holder, slot = plan.sources[rank]
    if kind == PEER:
        slot = target
        log.warning("robust_plugins: [rank %d] own snapshot of step %d is not in memory; restored the "
                    "copy kept by rank %d", rank, plan.step, holder)
    step, state = store.load(slot)
    if step != plan.step:
        raise CheckpointError(f"restore: rank {rank}'s slot {slot} holds step {step}, the plan says {plan.step}")
    if rank == 0:
        n_peer = sum(1 for s in plan.sources if s[0] == PEER)
        log.warning("robust_plugins: restored step %d from memory (%d rank(s) from their own snapshot, "
                    "%d from a peer's copy)", step, world - n_peer, n_peer)
    source = MEMORY if kind == MEMORY else f"{PEER}:{holder}"
    return step, state, source


def resume_reason(resume: bool | None, under_robust_run: bool, has_dir: bool, has_memory: bool) -> str | None:
    """Whether a host resumes inside its own initialization (``checkpoint.resume``): the reason,
    as the resume line says it, or None (the script loads itself, or starts cold).

    ``True``: always (the config requires ``dir``). ``False``: never. ``None`` (unset): under
    ``robust run`` when there is something to resume from (``dir`` or memory snapshots), because
    a restarted rank that ignores its snapshots retrains from step 1; outside it a
    script's start is a fresh start unless it asks.
    """
    if resume is not None:
        return "checkpoint.resume = true" if resume else None
    if under_robust_run and (has_dir or has_memory):
        return "on by default under robust run"
    return None

"""Pure planner: rank records -> rank lists of the intra-node, rail and switch-tier groups.

No process group is touched here, so the rules are unit-tested on made-up clusters of thousands
of ranks; :mod:`robust_plugins.topology.builder` turns a plan into process groups.

"Node" means NVLink domain: the ranks that reduce among themselves over the fast fabric. On a
plain cluster a domain is a host; with multi-node NVLink it spans hosts. Within a domain, ranks are
ordered by (host, local index); the rail group ``k`` holds the ``k``-th rank of every domain, which
on hosts of equal size is the same local index on every host (the rail a NIC serves).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

from robust_plugins.topology.records import RankRecord, TopologyError, UnevenTopologyError

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class TopologyPlan:
    """Rank lists of every group, in the order the builder creates them."""

    world_size: int
    """Number of ranks."""
    intra: Groups
    """One group per NVLink domain, ranks ordered by (host, local index); domains ordered by their lowest rank."""
    rails: Groups
    """``rails[k]`` = the ``k``-th rank of every domain, domains in ``intra`` order."""
    switch_tiers: tuple[Groups, ...]
    """``switch_tiers[t]``: one group per switch of tier ``t`` (lowest first), all ranks below it."""
    domain_names: tuple[str, ...]
    """Name of each domain, parallel to ``intra``."""
    switch_names: tuple[tuple[str, ...], ...]
    """Switch names per tier, parallel to ``switch_tiers``."""

    @property
    def ranks_per_node(self) -> int:
        """Ranks in each NVLink domain (all equal in a plan)."""
        return len(self.intra[0])

    @property
    def num_nodes(self) -> int:
        """Number of NVLink domains."""
        return len(self.intra)

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The groups ``rank`` belongs to, by kind: ``intra``, ``rail``, ``switch<t>``."""
        node, index = divmod(self._position[rank], self.ranks_per_node)
        out = {"intra": self.intra[node], "rail": self.rails[index]}
        for t, groups in enumerate(self.switch_tiers):
            out[f"switch{t}"] = next(g for g in groups if rank in g)
        return out

    @cached_property
    def _position(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(r for g in self.intra for r in g)}


def check_records(records: Sequence[RankRecord]) -> tuple[RankRecord, ...]:
    """Sorted records, after checking ranks are exactly ``0..W-1`` and slots are not shared."""
    if not records:
        raise TopologyError("the topology is empty: no rank records.")
    by_rank: dict[int, RankRecord] = {}
    for rec in records:
        if rec.rank in by_rank:
            raise TopologyError(f"rank {rec.rank} appears twice (hosts {by_rank[rec.rank].host!r} and {rec.host!r}).")
        by_rank[rec.rank] = rec
    world = max(by_rank) + 1
    if len(by_rank) != world:
        missing = sorted(set(range(world)) - set(by_rank))
        raise TopologyError(
            f"{len(missing)} rank(s) missing from a topology of {len(by_rank)} records with ranks up to "
            f"{world - 1}: {_short(missing)}. Every rank 0..W-1 must report exactly once."
        )
    slots: dict[tuple[str, int], int] = {}
    for rec in by_rank.values():
        slot = (rec.host, rec.local_index)
        if slot in slots:
            raise TopologyError(
                f"ranks {slots[slot]} and {rec.rank} both claim local index {rec.local_index} on host "
                f"{rec.host!r}; check LOCAL_RANK or the topology file."
            )
        slots[slot] = rec.rank
    return tuple(by_rank[r] for r in range(world))


def plan_groups(records: Sequence[RankRecord], *, tp: int = 1) -> TopologyPlan:
    """Plan intra-node, rail and switch-tier groups for ``records``.

    ``tp`` is the tensor-parallel size that must fit inside one NVLink domain.

    Raises:
        TopologyError: a missing or duplicated rank, a host slot claimed twice, a domain smaller
            than (or not a multiple of) ``tp``, switch tiers of different depth.
        UnevenTopologyError: domains of different sizes (no rail groups); callers may fall back
            to flat collectives on this one.
    """
    recs = check_records(records)
    world = len(recs)
    domains: dict[str, list[RankRecord]] = defaultdict(list)
    for rec in recs:
        domains[rec.nvlink_domain].append(rec)
    # Domains in order of their lowest rank, ranks inside by (host, local index): deterministic on every rank.
    ordered = sorted(domains.items(), key=lambda kv: kv[1][0].rank)
    intra = tuple(
        tuple(r.rank for r in sorted(members, key=lambda r: (r.host, r.local_index))) for _, members in ordered
    )
    sizes = [len(g) for g in intra]
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TopologyError(f"tp = {tp!r} must be an int >= 1.")
    smallest = min(sizes)
    if tp > smallest or any(s % tp for s in sizes):
        name, size = next((n, len(m)) for n, m in ordered if len(m) < tp or len(m) % tp)
        raise TopologyError(
            f"tensor parallel size {tp} does not fit the NVLink domains: domain {name!r} has {size} "
            f"ranks (domain sizes: {_histogram(sizes)}); TP groups must lie inside one domain, so each "
            f"domain size must be a multiple of tp. Lower tp or fix the topology."
        )
    if len(set(sizes)) > 1:
        raise UnevenTopologyError(
            f"uneven nodes: {len(intra)} NVLink domains with rank counts {_histogram(sizes)} "
            f"(world size {world}); rail groups need the same number of ranks in every domain."
        )
    per = sizes[0]
    rails = tuple(tuple(g[k] for g in intra) for k in range(per))
    tiers, names = _switch_tiers(recs)
    return TopologyPlan(world, intra, rails, tiers, tuple(n for n, _ in ordered), names)


def _switch_tiers(recs: tuple[RankRecord, ...]) -> tuple[tuple[Groups, ...], tuple[tuple[str, ...], ...]]:
    depths = {len(r.switches) for r in recs}
    if len(depths) > 1:
        counts = defaultdict(int)
        for r in recs:
            counts[len(r.switches)] += 1
        raise TopologyError(
            f"switch tiers differ between ranks: {dict(sorted(counts.items()))} (tiers: ranks); "
            f"describe the same number of tiers for every host, or none."
        )
    depth = depths.pop()
    tiers, names = [], []
    for t in range(depth):
        under: dict[str, list[int]] = defaultdict(list)
        for r in recs:
            under[r.switches[t]].append(r.rank)
        order = sorted(under, key=lambda s: under[s][0])
        tiers.append(tuple(tuple(under[s]) for s in order))
        names.append(tuple(order))
    return tuple(tiers), tuple(names)


def _short(values: Iterable[int], n: int = 8) -> str:
    values = list(values)
    return str(values[:n])[:-1] + (f", ... ({len(values)} in all)]" if len(values) > n else "]")


def _histogram(sizes: Sequence[int]) -> str:
    counts: dict[int, int] = defaultdict(int)
    for s in sizes:
        counts[s] += 1
    return ", ".join(f"{c} x {s}" for s, c in sorted(counts.items()))


def check_dp_groups(dp_groups: Sequence[Sequence[int]], world_size: int) -> tuple[tuple[int, ...], ...]:
    """The data-parallel groups, each sorted, ordered by lowest rank, after checking they split
    ranks ``0..world_size-1`` into disjoint groups (every rank in exactly one)."""
    groups = tuple(sorted((tuple(sorted(g)) for g in dp_groups), key=lambda g: g[0] if g else -1))
    seen: dict[int, int] = {}
    for i, g in enumerate(groups):
        if not g:
            raise TopologyError("an empty data-parallel group was given; every group needs at least one rank.")
        for r in g:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
                raise TopologyError(f"data-parallel group {list(g)} names rank {r!r}, outside 0..{world_size - 1}.")
            if r in seen:
                raise TopologyError(
                    f"rank {r} is in two data-parallel groups ({_short(groups[seen[r]])} and {_short(g)}); "
                    f"data-parallel groups must split the job into disjoint groups."
                )
            seen[r] = i
    if len(seen) != world_size:
        missing = sorted(set(range(world_size)) - set(seen))
        raise TopologyError(
            f"the data-parallel groups leave out {len(missing)} rank(s) of {world_size}: {_short(missing)}; "
            f"pass the data-parallel group of every rank."
        )
    return groups


def plan_within(records: Sequence[RankRecord], members: Sequence[int]) -> TopologyPlan:
    """Plan the intra-node and rail groups of the data-parallel group ``members`` (global ranks).

    With tensor or pipeline parallelism a data-parallel group holds only some ranks of each node;
    its hierarchy is planned on those ranks alone: "node" = the group's ranks on one NVLink
    domain, rail ``k`` = the ``k``-th of them on every domain. The plan's rank lists are global
    ranks and its ``world_size`` is the group's size (what an average divides by).

    Raises:
        TopologyError: a member without a record; the errors of :func:`plan_groups`.
        UnevenTopologyError: the group holds different numbers of ranks on different domains.
    """
    recs = {r.rank: r for r in check_records(records)}
    order = sorted(members)
    absent = [m for m in order if m not in recs]
    if absent:
        raise TopologyError(f"data-parallel ranks {_short(absent)} have no topology record (world {len(recs)}).")
    local = [RankRecord(i, recs[g].host, recs[g].nvlink_domain, recs[g].local_index, recs[g].switches)
             for i, g in enumerate(order)]
    try:
        plan = plan_groups(local)
    except UnevenTopologyError as exc:
        raise UnevenTopologyError(f"data-parallel group {_short(order)}: {exc}") from None

    def glob(groups: Groups) -> Groups:
        return tuple(tuple(order[i] for i in g) for g in groups)

    return TopologyPlan(len(order), glob(plan.intra), glob(plan.rails),
                        tuple(glob(t) for t in plan.switch_tiers), plan.domain_names, plan.switch_names)


def reduce_scatter_order(plan: TopologyPlan, node: Sequence[int], group_ranks: Sequence[int]) -> tuple[int, ...]:
    """The order in which a rank of ``node`` stages the shards of a hierarchical reduce-scatter.

    ``group_ranks`` are the global ranks of the group the flat reduce-scatter runs on, in
    group-rank order (rank ``group_ranks[i]`` owns shard ``i``); ``node`` is the intra-node group
    of the caller. Process groups order their members by global rank (``new_group`` sorts them),
    so the intra-node reduce-scatter hands block ``i`` to the ``i``-th lowest rank of the node,
    and the rail reduce-scatter hands sub-block ``j`` to the ``j``-th lowest rank of the rail.
    Block ``i`` must therefore hold the shards of the rail of the node's ``i``-th rank, in that
    rail's rank order. Returns shard indices: staged row ``k`` is input shard ``order[k]``; every
    rank of one node gets the same order, and it is a permutation of ``range(len(group_ranks))``.

    Raises:
        TopologyError: ``group_ranks`` and the plan hold different ranks, or ``node`` is not one
            of the plan's nodes.
    """
    if sorted(group_ranks) != sorted(r for g in plan.intra for r in g):
        raise TopologyError(
            f"the reduce-scatter group {_short(group_ranks)} is not the planned group "
            f"{_short(sorted(r for g in plan.intra for r in g))}."
        )
    if tuple(sorted(node)) not in {tuple(sorted(g)) for g in plan.intra}:
        raise TopologyError(f"ranks {_short(node)} are not one node of the plan {[list(g) for g in plan.intra]}.")
    shard_of = {r: i for i, r in enumerate(group_ranks)}
    rail_of = {r: rail for rail in plan.rails for r in rail}
    return tuple(shard_of[r] for member in sorted(node) for r in sorted(rail_of[member]))

"""Thin builder: create the planned process groups once, cache and name them.

``torch.distributed.new_group`` is collective over the whole default group: every rank must
create every group, members or not, in the same order. The plan fixes that order (intra-node
groups, then rails, then switch tiers), so the builder only walks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from robust_plugins._logging import get_logger, log_rank0
from robust_plugins.errors import RobustPluginsError
from robust_plugins.topology.planner import TopologyPlan, check_dp_groups, plan_groups, plan_within
from robust_plugins.topology.records import RankRecord, UnevenTopologyError

_log = get_logger(__name__)
_CACHE: dict[tuple, "TopologyGroups"] = {}


@dataclass(frozen=True)
class TopologyGroups:
    """This rank's topology groups (or why there are none: then collectives fall back to flat)."""

    plan: TopologyPlan | None
    """The plan the groups were built from; ``None`` when the layout was uneven."""
    fallback_reason: str | None = None
    """Why no hierarchy was built (uneven layout); ``None`` when ``plan`` is set."""
    intra: Any = None
    """This rank's intra-node (NVLink domain) group."""
    rail: Any = None
    """This rank's inter-node rail group."""
    intra_ranks: tuple[int, ...] = ()
    """Global ranks of ``intra``, in group-rank order."""
    rail_ranks: tuple[int, ...] = ()
    """Global ranks of ``rail``, in group-rank order."""
    by_name: dict[str, Any] = field(default_factory=dict)
    """Every group this rank belongs to, by name (``intra/<domain>``, ``rail/<k>``, ``switch<t>/<name>``)."""
    group: Any = None
    """The group the hierarchy spans (a data-parallel group from :func:`build_dp_groups`); ``None``:
    the default group. The flat fallback reduces over it."""


def build_groups(records: Sequence[RankRecord], *, tp: int = 1) -> TopologyGroups:
    """Plan and create the groups for ``records`` (a collective: every rank calls it alike).

    Cached per (records, tp, default group): a second call returns the same groups without
    creating any. An uneven layout builds nothing and returns ``fallback_reason``; every other
    planning error is raised.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RobustPluginsError("build_groups needs an initialized torch.distributed default group.")
    key = (tuple(records), tp, id(dist.group.WORLD))
    if key in _CACHE:
        return _CACHE[key]
    try:
        plan = plan_groups(records, tp=tp)
    except UnevenTopologyError as exc:
        groups = TopologyGroups(plan=None, fallback_reason=str(exc))
        _CACHE[key] = groups
        return groups
    if plan.world_size != dist.get_world_size():
        raise RobustPluginsError(
            f"the topology has {plan.world_size} ranks but the default group has {dist.get_world_size()}."
        )
    me = dist.get_rank()
    mine: dict[str, Any] = {}
    named = [(f"intra/{n}", g) for n, g in zip(plan.domain_names, plan.intra)]
    named += [(f"rail/{k}", g) for k, g in enumerate(plan.rails)]
    for t, (names, tier) in enumerate(zip(plan.switch_names, plan.switch_tiers)):
        named += [(f"switch{t}/{n}", g) for n, g in zip(names, tier)]
    for name, ranks in named:
        pg = dist.new_group(ranks=list(ranks), group_desc=f"robust_topo:{name}")
        if me in ranks:
            mine[name] = pg
    of_me = plan.groups_of(me)
    intra_name = next(n for n, g in named if n.startswith("intra/") and g == of_me["intra"])
    rail_name = next(n for n, g in named if n.startswith("rail/") and g == of_me["rail"])
    groups = TopologyGroups(
        plan=plan,
        intra=mine[intra_name],
        rail=mine[rail_name],
        intra_ranks=of_me["intra"],
        rail_ranks=of_me["rail"],
        by_name=mine,
    )
    log_rank0(
        _log, 20, "topology groups: %d nodes x %d ranks, %d switch tier(s), %d groups created",
        plan.num_nodes, plan.ranks_per_node, len(plan.switch_tiers), len(named),
    )
    _CACHE[key] = groups
    return groups


def build_dp_groups(records: Sequence[RankRecord], dp_groups: Sequence[Sequence[int]], group: Any) -> TopologyGroups:
    """Hierarchies inside data-parallel groups smaller than the job (tensor/pipeline parallelism).

    ``dp_groups`` lists every data-parallel group of the job (global ranks; a partition of all
    ranks) and ``group`` is this rank's data-parallel process group. Each group's intra-node and
    rail groups are planned on its own ranks (:func:`~robust_plugins.topology.planner.plan_within`)
    and created; a collective over the whole job (``new_group``), so every rank calls it alike. A
    group whose ranks sit unevenly on the nodes gets no hierarchy (``fallback_reason``; the
    hierarchical all-reduce then reduces flat over ``group``). Cached like :func:`build_groups`.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RobustPluginsError("build_dp_groups needs an initialized torch.distributed default group.")
    groups = check_dp_groups(dp_groups, dist.get_world_size())
    key = ("dp", tuple(records), groups, id(dist.group.WORLD))
    if key in _CACHE:
        return _CACHE[key]
    me = dist.get_rank()
    result = None
    created = 0
    for members in groups:
        try:
            plan = plan_within(records, members)
        except UnevenTopologyError as exc:
            if me in members:
                result = TopologyGroups(plan=None, fallback_reason=str(exc), group=group)
            continue
        tag = f"dp{members[0]}"
        named = [(f"intra/{n}", g) for n, g in zip(plan.domain_names, plan.intra)]
        named += [(f"rail/{k}", g) for k, g in enumerate(plan.rails)]
        mine: dict[str, Any] = {}
        for name, ranks in named:
            pg = dist.new_group(ranks=list(ranks), group_desc=f"robust_topo:{tag}:{name}")
            created += 1
            if me in ranks:
                mine[name] = pg
        if me in members:
            of_me = plan.groups_of(me)
            intra_name = next(n for n, g in named if n.startswith("intra/") and g == of_me["intra"])
            rail_name = next(n for n, g in named if n.startswith("rail/") and g == of_me["rail"])
            result = TopologyGroups(plan=plan, intra=mine[intra_name], rail=mine[rail_name],
                                    intra_ranks=of_me["intra"], rail_ranks=of_me["rail"], by_name=mine, group=group)
    if result is None:
        raise RobustPluginsError(f"rank {me} is in none of the data-parallel groups {[list(g) for g in groups]}.")
    log_rank0(_log, 20, "topology groups inside %d data-parallel groups of %d ranks: %d groups created",
              len(groups), len(groups[0]), created)
    _CACHE[key] = result
    return result


def clear_cache() -> None:
    """Forget cached groups (after ``destroy_process_group``; the groups themselves die with it)."""
    _CACHE.clear()

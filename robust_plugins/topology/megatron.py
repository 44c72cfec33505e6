"""Which process should take which megatron-core rank, so that TP stays in a node and DP on rails.

megatron-core numbers ranks in the order ``tp-cp-ep-dp-pp`` with the leftmost dimension the
fastest-varying (``initialize_model_parallel(order=...)``): a TP group is ``tp`` consecutive
ranks, and DP peers are ``tp * cp`` ranks apart. Its docstring leaves placement to the launcher
("adjacent ranks should be on the same machine"). Launchers do not always number node-major
(round-robin launches, SLURM's cyclic distribution, a scheduler that shuffles hosts), so this
module computes the assignment from the discovered topology instead of assuming it.
"""

from __future__ import annotations

from typing import Sequence

from robust_plugins._logging import get_logger, warn_once
from robust_plugins.topology.planner import plan_groups
from robust_plugins.topology.records import RankRecord, TopologyError

_log = get_logger(__name__)


def megatron_rank_order(
    records: Sequence[RankRecord],
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    dp: int | None = None,
    etp: int | None = None,
) -> tuple[int, ...]:
    """The process (record rank) that should run each megatron-core rank under the default order.

    Returns ``order`` with ``order[m]`` = the current rank (``RankRecord.rank``) of the process
    that should become megatron rank ``m``. A launcher relaunches (or re-initializes) each process
    with ``RANK = order.index(current_rank)`` (:func:`inverse`) and keeps
    ``order="tp-cp-ep-dp-pp"``.

    Slots are filled node-major: NVLink domains grouped by their switches (top tier first), then by
    their lowest rank, ranks inside a domain by (host, local index). Then every TP group (and
    expert-TP group of size ``etp``, default ``tp``) lies inside one domain, and DP peers on
    different nodes share a local index (a rail) whenever ``tp * cp`` divides the node size or is a
    multiple of it; otherwise a warning says DP cannot be rail-aligned.

    Raises:
        TopologyError: sizes that do not multiply to the world size, ``ep`` not dividing
            ``tp * cp * dp / etp``, a domain not a multiple of ``tp`` (or ``etp``), uneven domains.
    """
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TopologyError(f"{name} = {value!r} must be an int >= 1.")
    world = len(records)
    if dp is None:
        if world % (tp * pp * cp):
            raise TopologyError(
                f"world size {world} is not divisible by tp({tp}) * pp({pp}) * cp({cp}) = {tp * pp * cp}."
            )
        dp = world // (tp * pp * cp)
    if tp * pp * cp * dp != world:
        raise TopologyError(
            f"tp({tp}) * pp({pp}) * cp({cp}) * dp({dp}) = {tp * pp * cp * dp} != world size {world}."
        )
    etp = tp if etp is None else etp
    if (tp * cp * dp) % (etp * ep):
        raise TopologyError(
            f"expert layout: tp({tp}) * cp({cp}) * dp({dp}) = {tp * cp * dp} is not divisible by "
            f"etp({etp}) * ep({ep}) = {etp * ep}."
        )
    plan = plan_groups(records, tp=tp)
    if etp != tp:
        plan_groups(records, tp=etp)
    by_rank = {r.rank: r for r in records}

    def domain_key(group: tuple[int, ...]) -> tuple:
        first = by_rank[group[0]]
        return tuple(reversed(first.switches)) + (group[0],)

    order = tuple(r for g in sorted(plan.intra, key=domain_key) for r in g)
    n, stride = plan.ranks_per_node, tp * cp
    if dp > 1 and n % stride and stride % n:
        warn_once(
            _log, f"megatron-dp-rails-{n}-{stride}",
            "megatron rank order: DP peers are tp(%d) * cp(%d) = %d ranks apart, which neither divides "
            "nor is a multiple of %d ranks per node, so DP groups cannot all run on rails.",
            tp, cp, stride, n,
        )
    return order


def inverse(order: Sequence[int]) -> tuple[int, ...]:
    """``inverse(order)[current_rank]`` = the megatron rank that process should take."""
    out = [0] * len(order)
    for m, r in enumerate(order):
        out[r] = m
    return tuple(out)

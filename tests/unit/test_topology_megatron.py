"""megatron_rank_order against the groups megatron-core's own RankGenerator builds (no process group)."""

from __future__ import annotations

import logging

import pytest

from robust_plugins.topology import RankRecord, TopologyError, inverse, megatron_rank_order, parse_sim

parallel_state = pytest.importorskip("megatron.core.parallel_state")
ORDER = "tp-cp-ep-dp-pp"  # megatron-core's default


def round_robin(nodes: int, per_node: int) -> list[RankRecord]:
    """A launch that deals ranks to hosts like cards: rank r on host r % nodes (not node-major)."""
    return [RankRecord(r, f"h{r % nodes}", f"h{r % nodes}", r // nodes) for r in range(nodes * per_node)]


def where(order, records, megatron_ranks):
    by_rank = {r.rank: r for r in records}
    return [by_rank[order[m]] for m in megatron_ranks]


def on_rails(recs: list[RankRecord]) -> bool:
    """Members on different hosts use the same set of local indices on every host."""
    per_host: dict[str, set[int]] = {}
    for r in recs:
        per_host.setdefault(r.host, set()).add(r.local_index)
    return len({frozenset(s) for s in per_host.values()}) == 1


SHAPES = [
    # nodes, per_node, tp, pp, cp, ep
    (2, 8, 2, 2, 1, 1),
    (4, 4, 4, 2, 1, 1),
    (4, 8, 2, 2, 2, 1),
    (8, 8, 8, 4, 1, 1),
    (4, 8, 2, 1, 1, 4),
    (2, 8, 1, 1, 1, 2),
    (16, 8, 4, 2, 1, 2),
]


@pytest.mark.parametrize("nodes,per_node,tp,pp,cp,ep", SHAPES)
@pytest.mark.parametrize("launch", ["round_robin", "node_major"])
def test_tp_inside_a_node_and_dp_on_rails(nodes, per_node, tp, pp, cp, ep, launch):
    records = round_robin(nodes, per_node) if launch == "round_robin" else list(parse_sim(f"{nodes}x{per_node}"))
    world = nodes * per_node
    dp = world // (tp * pp * cp)
    order = megatron_rank_order(records, tp=tp, pp=pp, cp=cp, ep=ep)
    assert sorted(order) == list(range(world))
    assert [order[m] for m in inverse(order)] == list(range(world))
    if launch == "node_major":
        assert order == tuple(range(world))

    gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER)
    for group in gen.get_ranks("tp"):
        assert len({r.nvlink_domain for r in where(order, records, group)}) == 1, group
    for group in gen.get_ranks("dp"):
        assert on_rails(where(order, records, group)), group
    for group in gen.get_ranks("tp-cp"):
        if tp * cp <= per_node:
            assert len({r.host for r in where(order, records, group)}) == 1, group

    expert_dp = tp * cp * dp // (tp * ep)
    egen = parallel_state.RankGenerator(tp=tp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=ORDER)
    for group in egen.get_ranks("tp"):
        assert len({r.nvlink_domain for r in where(order, records, group)}) == 1, group


def test_round_robin_launch_needs_the_permutation():
    records = round_robin(2, 8)
    gen = parallel_state.RankGenerator(tp=2, ep=1, dp=8, pp=1, cp=1, order=ORDER)
    identity = tuple(range(16))
    assert any(len({r.host for r in where(identity, records, g)}) > 1 for g in gen.get_ranks("tp"))
    order = megatron_rank_order(records, tp=2)
    assert order[:4] == (0, 2, 4, 6)  # host h0's slots first, by local index


def test_errors_print_the_sizes():
    recs = list(parse_sim("2x8"))
    with pytest.raises(TopologyError, match=r"tp\(2\) \* pp\(2\) \* cp\(1\) \* dp\(2\) = 8 != world size 16"):
        megatron_rank_order(recs, tp=2, pp=2, dp=2)
    with pytest.raises(TopologyError, match=r"not divisible by tp\(3\) \* pp\(1\) \* cp\(1\) = 3"):
        megatron_rank_order(recs, tp=3)
    with pytest.raises(TopologyError, match="tensor parallel size 16 .* has 8 ranks"):
        megatron_rank_order(recs, tp=16)
    with pytest.raises(TopologyError, match=r"etp\(2\) \* ep\(16\) = 32"):
        megatron_rank_order(recs, tp=2, ep=16)


def test_warns_when_dp_cannot_be_rail_aligned(caplog):
    recs = list(parse_sim("2x6"))
    with caplog.at_level(logging.WARNING, logger="robust_plugins"):
        megatron_rank_order(recs, tp=2, cp=2, pp=1, dp=3)
    assert any("tp(2) * cp(2) = 4" in m and "6 ranks per node" in m for m in caplog.messages)

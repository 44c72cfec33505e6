"""Topology records, discovery parsers and the pure planner, on made-up clusters up to 8k ranks."""

from __future__ import annotations

import json
import random

import pytest

from robust_plugins.topology import (
    RankRecord,
    TopologyError,
    UnevenTopologyError,
    discover,
    load_topology_file,
    parse_sim,
    parse_slurm_topology_addr,
    plan_groups,
    records_from_gathered,
    records_from_host_table,
)


def cluster(nodes: int, per_node: int, *, shuffle: int | None = None, switches: int = 0, fanout: int = 4):
    """Records of ``nodes`` hosts x ``per_node`` ranks; ranks optionally shuffled across slots."""
    slots = [(n, i) for n in range(nodes) for i in range(per_node)]
    ranks = list(range(len(slots)))
    if shuffle is not None:
        random.Random(shuffle).shuffle(ranks)
    recs = []
    for rank, (n, i) in zip(ranks, slots):
        sw = tuple(f"t{t}-{n // fanout ** (t + 1)}" for t in range(switches))
        recs.append(RankRecord(rank, f"h{n:05d}", f"h{n:05d}", i, sw))
    return recs


# ---------------------------------------------------------------- records and parsers


def test_record_rejects_bad_fields_with_the_value():
    with pytest.raises(TopologyError, match="local_index = -1"):
        RankRecord(0, "h", "h", -1)
    with pytest.raises(TopologyError, match="host = ''"):
        RankRecord(3, "", "h", 0)


def test_sim_layout_is_node_major():
    recs = parse_sim("2x4")
    assert [(r.rank, r.host, r.local_index) for r in recs][:5] == [
        (0, "sim-node0", 0), (1, "sim-node0", 1), (2, "sim-node0", 2), (3, "sim-node0", 3), (4, "sim-node1", 0)
    ]
    assert len(parse_sim(" 3X2 ")) == 6
    for bad in ("2", "0x4", "2x", "a x b", ""):
        with pytest.raises(TopologyError, match="NODESxRANKS_PER_NODE"):
            parse_sim(bad)


def test_slurm_topology_addr():
    assert parse_slurm_topology_addr("spine0.leaf3.node17", "switch.switch.node") == ("node17", ("leaf3", "spine0"))
    assert parse_slurm_topology_addr("node1", "node") == ("node1", ())
    with pytest.raises(TopologyError, match="3 components.*has 2"):
        parse_slurm_topology_addr("a.b.c", "switch.node")
    with pytest.raises(TopologyError, match="final 'node'"):
        parse_slurm_topology_addr("a.b", "node.switch")


def test_topology_file_json_and_yaml(tmp_path):
    table = {
        "a": {"nvlink_domain": "nvl0", "switches": ["leaf0", "spine"], "ranks": [2, 0]},
        "b": {"nvlink_domain": "nvl1", "switches": ["leaf0", "spine"], "ranks": [1, 3]},
    }
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(table))
    recs = records_from_host_table(load_topology_file(str(path)))
    assert [(r.rank, r.host, r.local_index, r.switches) for r in recs] == [
        (0, "a", 1, ("leaf0", "spine")), (1, "b", 0, ("leaf0", "spine")),
        (2, "a", 0, ("leaf0", "spine")), (3, "b", 1, ("leaf0", "spine")),
    ]
    ypath = tmp_path / "topo.yaml"
    pytest.importorskip("yaml")
    ypath.write_text("a:\n  ranks: [0, 1]\nb:\n  ranks: [2, 3]\n")
    recs = discover(str(ypath), env={})
    assert recs.source == f"file:{ypath}" and [r.nvlink_domain for r in recs.records] == ["a", "a", "b", "b"]


def test_topology_file_errors(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"a": {"nvlink_domian": "x"}}))
    with pytest.raises(TopologyError, match="did you mean 'nvlink_domain'"):
        load_topology_file(str(path))
    path.write_text(json.dumps({"a": {"ranks": [0]}, "b": {}}))
    with pytest.raises(TopologyError, match="1 of 2 hosts list their ranks"):
        load_topology_file(str(path))
    path.write_text("{not json")
    with pytest.raises(TopologyError, match="not valid JSON"):
        load_topology_file(str(path))
    path.write_text(json.dumps({"a": {}}))
    with pytest.raises(TopologyError, match="does not list ranks and torch.distributed is not initialized"):
        discover(str(path), env={})


def test_gathered_hostnames_with_and_without_local_rank():
    infos = [{"host": h, "local_rank": None} for h in ("x", "y", "x", "y")]
    recs = records_from_gathered(infos)
    assert [(r.host, r.local_index) for r in recs] == [("x", 0), ("y", 0), ("x", 1), ("y", 1)]
    infos = [{"host": "x", "local_rank": 1}, {"host": "x", "local_rank": 0}]
    assert [r.local_index for r in records_from_gathered(infos)] == [1, 0]
    table = {"x": {"nvlink_domain": "nvl", "switches": ("leaf",)}}
    assert records_from_gathered(infos, table)[0].switches == ("leaf",)
    with pytest.raises(TopologyError, match="host 'z', which the topology file does not name"):
        records_from_gathered([{"host": "z", "local_rank": 0}], table)


def test_discover_sim_without_process_group():
    topo = discover(env={"ROBUST_TOPOLOGY_SIM": "2x2"})
    assert topo.source == "sim:2x2" and len(topo.records) == 4


# ---------------------------------------------------------------- planner


@pytest.mark.parametrize("nodes,per_node", [(1, 8), (2, 4), (512, 8), (1024, 8), (128, 72)])
def test_plan_groups_large_and_shuffled(nodes, per_node):
    recs = cluster(nodes, per_node, shuffle=nodes)
    plan = plan_groups(recs, tp=per_node)
    world = nodes * per_node
    assert plan.world_size == world and plan.num_nodes == nodes and plan.ranks_per_node == per_node
    by_rank = {r.rank: r for r in recs}
    # Every rank in exactly one intra group and one rail group.
    assert sorted(r for g in plan.intra for r in g) == list(range(world))
    assert sorted(r for g in plan.rails for r in g) == list(range(world))
    for g in plan.intra:
        assert len({by_rank[r].host for r in g}) == 1
        assert [by_rank[r].local_index for r in g] == list(range(per_node))
    for k, g in enumerate(plan.rails):
        assert {by_rank[r].local_index for r in g} == {k}
        assert len({by_rank[r].host for r in g}) == nodes
    probe = recs[len(recs) // 2].rank
    mine = plan.groups_of(probe)
    assert probe in mine["intra"] and probe in mine["rail"]


def test_plan_is_the_same_whatever_order_records_arrive_in():
    recs = cluster(64, 8, shuffle=3)
    shuffled = list(recs)
    random.Random(7).shuffle(shuffled)
    assert plan_groups(recs) == plan_groups(shuffled)


def test_switch_tiers():
    recs = cluster(32, 4, switches=2, fanout=4)  # 8 leaves of 4 hosts, 2 spines of 16 hosts
    plan = plan_groups(recs)
    assert [len(t) for t in plan.switch_tiers] == [8, 2]
    assert all(len(g) == 16 for g in plan.switch_tiers[0]) and all(len(g) == 64 for g in plan.switch_tiers[1])
    assert plan.switch_names[1] == ("t1-0", "t1-1")
    assert "switch1" in plan.groups_of(0)
    bad = list(recs)
    bad[5] = RankRecord(bad[5].rank, bad[5].host, bad[5].nvlink_domain, bad[5].local_index, ("only-leaf",))
    with pytest.raises(TopologyError, match=r"switch tiers differ between ranks: \{1: 1, 2: 127\}"):
        plan_groups(bad)


def test_multi_node_nvlink_domain_spans_hosts():
    # NVL72-style: 18 hosts x 4 GPUs in one domain, two such domains.
    recs = [
        RankRecord(r, f"h{r // 4}", f"nvl{r // 72}", r % 4) for r in range(144)
    ]
    plan = plan_groups(recs, tp=8)
    assert plan.num_nodes == 2 and plan.ranks_per_node == 72
    assert plan.rails[5] == (5, 77)


def test_uneven_nodes_error_prints_the_counts():
    recs = cluster(1000, 8)[:-3]  # the last host lost 3 ranks
    msg = r"1000 NVLink domains with rank counts 1 x 5, 999 x 8 \(world size 7997\)"
    with pytest.raises(UnevenTopologyError, match=msg):
        plan_groups(recs)


def test_missing_and_duplicated_ranks():
    recs = cluster(512, 8)
    missing = [r for r in recs if r.rank not in (17, 4000)]
    with pytest.raises(TopologyError, match=r"2 rank\(s\) missing .*4094 records.*: \[17, 4000\]"):
        plan_groups(missing)
    dup = recs + [RankRecord(3, "other", "other", 0)]
    with pytest.raises(TopologyError, match="rank 3 appears twice"):
        plan_groups(dup)
    clash = [RankRecord(0, "h", "h", 0), RankRecord(1, "h", "h", 0)]
    with pytest.raises(TopologyError, match="ranks 0 and 1 both claim local index 0 on host 'h'"):
        plan_groups(clash)
    with pytest.raises(TopologyError, match="empty"):
        plan_groups([])


def test_domain_smaller_than_tp():
    msg = r"tensor parallel size 16 .*'h00000' has 8 ranks \(domain sizes: 256 x 8\)"
    with pytest.raises(TopologyError, match=msg):
        plan_groups(cluster(256, 8), tp=16)
    with pytest.raises(TopologyError, match="tensor parallel size 4 .* has 6 ranks"):
        plan_groups(cluster(4, 6), tp=4)
    with pytest.raises(TopologyError, match="tp = 0"):
        plan_groups(cluster(2, 2), tp=0)


# -- hierarchies inside data-parallel groups smaller than the job ---------------------------------
from robust_plugins.topology import check_dp_groups, parse_sim, plan_within  # noqa: E402
from robust_plugins.topology.records import TopologyError as _TopoErr, UnevenTopologyError as _Uneven  # noqa: E402


def test_plan_within_a_dp_group_uses_only_its_ranks():
    recs = parse_sim("4x8")  # 32 ranks; TP = 4 (blocks of 4 consecutive ranks), DP groups stride 4
    dp = check_dp_groups([range(s, 32, 4) for s in range(4)], 32)
    assert dp[1] == (1, 5, 9, 13, 17, 21, 25, 29)
    plan = plan_within(recs, dp[1])
    assert plan.world_size == 8 and plan.intra == ((1, 5), (9, 13), (17, 21), (25, 29))
    assert plan.rails == ((1, 9, 17, 25), (5, 13, 21, 29))
    assert plan.groups_of(13) == {"intra": (9, 13), "rail": (5, 13, 21, 29)}


def test_dp_groups_must_split_the_job_and_sit_evenly():
    with pytest.raises(_TopoErr, match="rank 2 is in two data-parallel groups"):
        check_dp_groups([[0, 2], [1, 2, 3]], 4)
    with pytest.raises(_TopoErr, match="leave out 1 rank"):
        check_dp_groups([[0, 2], [1]], 4)
    with pytest.raises(_TopoErr, match="outside 0..3"):
        check_dp_groups([[0, 2], [1, 3, 7]], 4)
    # Three ranks on node 0 and one on node 1: no rails; the error names the group.
    with pytest.raises(_Uneven, match=r"data-parallel group \[0, 1, 2, 4\]: uneven nodes"):
        plan_within(parse_sim("2x4"), [0, 1, 2, 4])
    with pytest.raises(_TopoErr, match="no topology record"):
        plan_within(parse_sim("2x2"), [0, 9])


def test_reduce_scatter_order_stages_each_rails_shards_node_major():
    from robust_plugins.topology import reduce_scatter_order

    plan = plan_groups(parse_sim("2x2"))
    # node {0,1}: block 0 for rank 0's rail {0,2}, block 1 for rank 1's rail {1,3}
    assert reduce_scatter_order(plan, (0, 1), range(4)) == (0, 2, 1, 3)
    assert reduce_scatter_order(plan, (2, 3), range(4)) == (0, 2, 1, 3)
    order = reduce_scatter_order(plan_groups(parse_sim("2x4")), (4, 5, 6, 7), range(8))
    assert order == (0, 4, 1, 5, 2, 6, 3, 7)
    big = plan_groups(parse_sim("16x8"))
    assert sorted(reduce_scatter_order(big, big.intra[3], range(128))) == list(range(128))
    # A data-parallel group planned within the job: shard i belongs to the group's i-th rank.
    within = plan_within(parse_sim("2x4"), [1, 3, 5, 7])
    assert reduce_scatter_order(within, (5, 7), [1, 3, 5, 7]) == (0, 2, 1, 3)
    with pytest.raises(TopologyError, match="not the planned group"):
        reduce_scatter_order(plan, (0, 1), range(5))
    with pytest.raises(TopologyError, match="not one node"):
        reduce_scatter_order(plan, (0, 2), range(4))

"""Hierarchical all-reduce on 4 and 8 gloo ranks under simulated topologies (2x2, 2x4).

One launch per layout runs every scenario and returns its observations (starting ranks costs
seconds of imports); the tests below assert on them.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from robust_plugins.comm import CompressionState, compressed_all_reduce
from robust_plugins.topology import RankRecord, build_groups, discover, hierarchical_all_reduce, plan_groups

pytestmark = pytest.mark.distributed

SIZES = (10_007, 4096, 3)  # not divisible by the node size / divisible / smaller than the node
CODECS = ("none", "bf16", "int8", "int4")
# Max |error| / max |input| after one compressed rail all-reduce (two quantizations).
TOL = {"bf16": 2**-7, "int8": 2 / 127, "int4": 2 / 7}


def rank_input(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randn(n, generator=g)


def _scenarios(rank: int, world: int) -> dict:
    topo = discover()
    groups = build_groups(topo.records)
    out: dict = {
        "source": topo.source,
        "intra_ranks": groups.intra_ranks,
        "rail_ranks": groups.rail_ranks,
        "intra_size": dist.get_world_size(groups.intra),
        "rail_size": dist.get_world_size(groups.rail),
        "cached": build_groups(topo.records) is groups,
        "results": {},
    }
    for n in SIZES:
        x = rank_input(rank, n)
        flat = x.clone()
        dist.all_reduce(flat)
        out["results"][(n, "flat")] = flat / world
        for codec in CODECS:
            out["results"][(n, codec)] = hierarchical_all_reduce(x.clone(), groups, codec=codec)
    x = rank_input(rank, 1000)
    out["sum_int8"] = hierarchical_all_reduce(x.clone(), groups, codec="int8", op="sum")
    out["bf16_tensor"] = hierarchical_all_reduce(x.to(torch.bfloat16).view(10, 100), groups, codec="int8")
    # Error feedback through the rail step: the residual is kept under ("hierarchical", key).
    st = CompressionState(codec="int4", block_size=64)
    for _ in range(2):
        hierarchical_all_reduce(x.clone(), groups, state=st, key=("bucket", 0))
    out["residual_keys"] = st.keys()
    out["residual_numel"] = st.residual_numel(("hierarchical", ("bucket", 0)))

    # Discovery over the process group: hostnames (+ LOCAL_RANK), then SLURM's tree address.
    host_topo = discover(env={"LOCAL_RANK": str(rank)})
    out["hostname_topo"] = host_topo
    slurm_env = {
        "SLURM_TOPOLOGY_ADDR": f"spine.leaf{rank // 2}.n{rank // 2}",
        "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node",
        "LOCAL_RANK": str(rank % 2),
    }
    out["slurm_topo"] = discover(env=slurm_env)
    # One node (every rank on this host): no rail step, so even int8 is the exact fp32 sum.
    one_node = build_groups(host_topo.records)
    x = rank_input(rank, 777)
    out["one_node_int8"] = hierarchical_all_reduce(x.clone(), one_node, codec="int8", op="sum")

    # An uneven layout (one node short by a rank) falls back to flat, loudly.
    uneven = [RankRecord(r, f"n{min(r // (world // 2 + 1), 1)}", f"n{min(r // (world // 2 + 1), 1)}",
                         r if r <= world // 2 else r - world // 2 - 1) for r in range(world)]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("robust_plugins").addHandler(handler)
    try:
        ugroups = build_groups(uneven)
        y = rank_input(rank, 999)
        out["uneven"] = hierarchical_all_reduce(y.clone(), ugroups, codec="int8")
        out["uneven_flat"] = compressed_all_reduce(y.clone(), codec="int8")
        hierarchical_all_reduce(y.clone(), ugroups, codec="int8")
    finally:
        logging.getLogger("robust_plugins").removeHandler(handler)
    out["uneven_warnings"] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    return out


@functools.lru_cache(maxsize=None)
def run_layout(layout: str) -> list[dict]:
    nodes, per = map(int, layout.split("x"))
    return run_ranks(_scenarios, nodes * per, 90, env={"ROBUST_TOPOLOGY_SIM": layout})


LAYOUTS = ("2x2", "2x4")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_match_the_plan(layout):
    outs = run_layout(layout)
    nodes, per = map(int, layout.split("x"))
    from robust_plugins.topology import parse_sim

    plan = plan_groups(parse_sim(layout))
    for rank, out in enumerate(outs):
        assert out["source"] == f"sim:{layout}"
        mine = plan.groups_of(rank)
        assert out["intra_ranks"] == mine["intra"] and out["rail_ranks"] == mine["rail"]
        assert (out["intra_size"], out["rail_size"]) == (per, nodes)
        assert out["cached"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hierarchical_matches_flat(layout):
    outs = run_layout(layout)
    world = len(outs)
    for n in SIZES:
        exact = torch.stack([rank_input(r, n) for r in range(world)]).double().mean(0)
        flat = outs[0]["results"][(n, "flat")]
        none = outs[0]["results"][(n, "none")]
        # fp32 sums of `world` terms in a different order: a few ulps of the largest partial sum.
        torch.testing.assert_close(none, flat, rtol=0, atol=4 * world * torch.finfo(torch.float32).eps * 4)
        for codec, tol in TOL.items():
            got = outs[0]["results"][(n, codec)].double()
            scale = max(rank_input(r, n).abs().max().item() for r in range(world))
            err = (got - exact).abs().max().item()
            assert err <= tol * scale, f"{layout} n={n} {codec}: max error {err:.3g} > {tol * scale:.3g}"
        for codec in ("none",) + tuple(TOL):
            for rank in range(1, world):
                assert torch.equal(outs[rank]["results"][(n, codec)], outs[0]["results"][(n, codec)]), (
                    f"{layout} n={n} {codec}: rank {rank} differs from rank 0"
                )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_discovery_over_the_process_group(layout):
    outs = run_layout(layout)
    world = len(outs)
    for out in outs:
        assert out["hostname_topo"] == outs[0]["hostname_topo"] and out["hostname_topo"].source == "hostname"
        assert [r.local_index for r in out["hostname_topo"].records] == list(range(world))
        slurm = out["slurm_topo"]
        assert slurm.source == "slurm" and slurm == outs[0]["slurm_topo"]
        assert [(r.host, r.local_index, r.switches) for r in slurm.records[:3]] == [
            ("n0", 0, ("leaf0", "spine")), ("n0", 1, ("leaf0", "spine")), ("n1", 0, ("leaf1", "spine"))
        ]
    exact = torch.stack([rank_input(r, 777) for r in range(world)]).sum(0)
    torch.testing.assert_close(outs[0]["one_node_int8"], exact, rtol=1e-6, atol=1e-5)
    assert all(torch.equal(o["one_node_int8"], outs[0]["one_node_int8"]) for o in outs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sum_dtype_shape_and_uneven_fallback(layout):
    outs = run_layout(layout)
    world = len(outs)
    exact = torch.stack([rank_input(r, 1000) for r in range(world)]).sum(0)
    assert (outs[0]["sum_int8"] - exact).abs().max() <= TOL["int8"] * exact.abs().max() * world
    bf = outs[0]["bf16_tensor"]
    assert bf.dtype == torch.bfloat16 and bf.shape == (10, 100)
    for out in outs[1:]:
        assert torch.equal(out["sum_int8"], outs[0]["sum_int8"])
        assert torch.equal(out["uneven"], outs[0]["uneven"])
    assert torch.equal(outs[0]["uneven"], outs[0]["uneven_flat"])
    per = len(outs[0]["intra_ranks"])
    for out in outs:
        assert out["residual_keys"] == [repr(("hierarchical", ("bucket", 0)))]
        assert out["residual_numel"] == -(-1000 // per)  # this rank's shard, not the bucket
    for out in outs:
        warnings = [w for w in out["uneven_warnings"] if "FLAT" in w]
        assert len(warnings) == 1 and "uneven nodes" in warnings[0], out["uneven_warnings"]

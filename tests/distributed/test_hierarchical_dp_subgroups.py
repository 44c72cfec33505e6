"""Hierarchical gradient all-reduce inside data-parallel groups smaller than the job (tensor
parallelism): 8 gloo ranks as 2 simulated nodes x 4, TP = 2, so DP groups {0,2,4,6} and {1,3,5,7}.

Each DP group's hierarchy is planned on its own ranks (two per node), both groups reduce at the
same time, and the result equals the flat all-reduce over the DP group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks

pytestmark = pytest.mark.distributed


def _dp_sync(rank: int, world: int) -> dict:
    from robust_plugins.comm.gradient_sync import GradientSync
    from robust_plugins.config import CompressionConfig, TopologyConfig

    # Every rank creates every DP group, in the same order (new_group is collective over the job).
    dp = {}
    for start in (0, 1):
        ranks = list(range(start, world, 2))
        pg = dist.new_group(ranks)
        if rank in ranks:
            dp = {"group": pg, "ranks": ranks}
    out = {}
    for codec in ("none", "int8"):
        sync = GradientSync(CompressionConfig(codec=codec), step_fn=lambda: 0,
                            topology=TopologyConfig(hierarchical=True))
        n = 10_007  # not a multiple of the two ranks a DP group has on a node: padded
        t = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        exact = t.clone()
        dist.all_reduce(exact, group=dp["group"])
        sync.all_reduce_sum(t, dp["group"], sync.compress_key("site", n))
        g = sync._hierarchy(dp["group"])
        out[codec] = {"intra": list(g.intra_ranks), "rail": list(g.rail_ranks), "plan": g.plan is not None,
                      "world": g.plan.world_size, "hier": sync.stats.hierarchical_elements,
                      "err": float((t - exact).norm() / exact.norm()), "bits": t.sum().item()}
    return out


def test_hierarchy_inside_dp_groups_smaller_than_the_job():
    out = run_ranks(_dp_sync, 8, 120, env={"ROBUST_TOPOLOGY_SIM": "2x4"})
    want_intra = [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    want_rail = [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]]
    for codec in ("none", "int8"):
        got = [o[codec] for o in out]
        assert [g["intra"] for g in got] == want_intra and [g["rail"] for g in got] == want_rail
        assert all(g["plan"] and g["world"] == 4 and g["hier"] == 10_007 for g in got)
        # Members of one DP group end with the same bits.
        assert len({got[r]["bits"] for r in (0, 2, 4, 6)}) == 1 and len({got[r]["bits"] for r in (1, 3, 5, 7)}) == 1
    assert max(o["none"]["err"] for o in out) < 1e-6  # fp32: summation order only
    assert 1e-3 < max(o["int8"]["err"] for o in out) < 3e-2

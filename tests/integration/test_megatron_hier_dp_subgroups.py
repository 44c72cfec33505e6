"""megatron-core with tensor parallelism and ``topology.hierarchical``: the hierarchy is planned
inside each data-parallel group, end to end.

4 gloo ranks as a simulated 2 x 2 cluster, TP 2 x DP 2 (megatron's default order: TP groups
{0,1} {2,3} inside the nodes, DP groups {0,2} {1,3} across them). The DP groups' hierarchy has
one rank per node, so a rank's node group is itself and its rail is its DP group; a hierarchy
planned on the whole job instead would put both ranks of a node, i.e. a TP pair holding
different gradient shards, into one node group and sum them. The test checks the groups the sync
used, that the hierarchical route carried every bucket, and that the reduced gradients of the
first step equal vanilla megatron-core's (fp32: up to summation order; int8: within the codec's
error).
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]

STEPS = 3


def _grads(ddp) -> torch.Tensor:
    return torch.cat([b.grad_data.detach().float().clone().view(-1) for g in ddp.bucket_groups for b in g.buckets])


def _tp2_dp2(rank: int, world: int, steps: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_worker import _preset
    from robust_plugins.recipes.megatron_gpt.train import build, train_step
    from robust_plugins.workloads import load_corpus

    preset, corpus = _preset(), load_corpus()
    out = {}
    for name, block in (("vanilla", None),
                        ("hier_none", {"compression": {"codec": "none"}, "topology": {"hierarchical": True}}),
                        ("hier_int8", {"compression": {"codec": "int8"}, "topology": {"hierarchical": True}})):
        parts = build(preset, tp=2, seed=0, codec=None, overlap=False, distopt=False, block=block,
                      optimizer="torch-adamw")
        losses, first = [], None
        for s in range(1, steps + 1):
            losses.append(train_step(parts, preset, corpus, 0, s))
            if s == 1:  # the reduced gradient of step 1: same parameters and batch in every variant
                first = _grads(parts["ddp"])
        res = {"losses": losses, "grads": first,
               "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
               "dp": dist.get_process_group_ranks(ps.get_data_parallel_group())}
        plugin = parts["plugin"]
        if plugin is not None:
            sync = plugin.sync
            g = sync._groups
            res.update(intra=list(g.intra_ranks), rail=list(g.rail_ranks), planned=g.plan is not None,
                       plan_world=g.plan.world_size if g.plan is not None else None,
                       hier=sync.stats.hierarchical_elements, by_codec=dict(sync.stats.by_codec),
                       step_elements=sum(b.grad_data.numel() for gr in parts["ddp"].bucket_groups for b in gr.buckets))
            plugin.close()
        out[name] = res
    return out


@pytest.mark.timeout(90)
def test_hierarchy_inside_tp2_dp2_megatron_matches_flat():
    res = run_ranks(_tp2_dp2, 4, 80, STEPS, env={"ROBUST_TOPOLOGY_SIM": "2x2"})
    for rank, r in enumerate(res):
        van = r["vanilla"]
        assert van["tp"] == [rank - rank % 2, rank - rank % 2 + 1] and van["dp"] == [rank % 2, rank % 2 + 2]
        for name in ("hier_none", "hier_int8"):
            h = r[name]
            # Planned on the DP group (2 ranks, one a node), not on the job (2 ranks a node).
            assert h["planned"] and h["plan_world"] == 2, h
            assert h["intra"] == [rank] and h["rail"] == van["dp"], (rank, h["intra"], h["rail"])
            # Every bucket of every step went through the hierarchy, with the configured codec.
            codec = name.split("_")[1]
            assert h["hier"] == STEPS * h["step_elements"] and h["by_codec"] == {codec: h["hier"]}, h
        ref = van["grads"]
        err = {name: float((r[name]["grads"] - ref).norm() / ref.norm()) for name in ("hier_none", "hier_int8")}
        assert err["hier_none"] < 1e-6, err
        assert 1e-4 < err["hier_int8"] < 3e-2, err
        assert abs(r["hier_int8"]["losses"][-1] / van["losses"][-1] - 1) < 0.02
    # The two ranks of a DP group hold the same reduced gradient (bitwise for the hierarchy).
    for name in ("hier_none", "hier_int8"):
        assert torch.equal(res[0][name]["grads"], res[2][name]["grads"])
        assert torch.equal(res[1][name]["grads"], res[3][name]["grads"])

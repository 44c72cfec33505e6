"""Hierarchical reduce-scatter on 4 gloo ranks as 2 simulated nodes x 2 (``ROBUST_TOPOLOGY_SIM=2x2``).

One launch runs every scenario and returns its observations; the tests assert on them against an
independent oracle, the fp64 sum of every rank's input computed here from the same seeds.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from robust_plugins.comm import CompressionState, WireCounter, compressed_reduce_scatter
from robust_plugins.comm.gradient_sync import GradientSync
from robust_plugins.config import CompressionConfig, TopologyConfig
from robust_plugins.topology import build_groups, discover, hierarchical_reduce_scatter, parse_sim

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

WORLD, NODES, PER_NODE = 4, 2, 2
SHARD = 1_003  # odd: each shard is padded to whole blocks separately
BLOCK = 256


def rank_input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(900 + rank)
    return torch.randn(WORLD * SHARD, generator=g)


def oracle() -> torch.Tensor:
    """The exact sum of every rank's input, fp64, as [world, shard]."""
    return torch.stack([rank_input(r).double() for r in range(WORLD)]).sum(0).view(WORLD, SHARD)


def _scenarios(rank: int, world: int) -> dict:
    groups = build_groups(discover().records)
    x = rank_input(rank)
    flat = torch.empty(SHARD)
    dist.reduce_scatter_tensor(flat, x.clone())
    out: dict = {"flat": flat, "intra": groups.intra_ranks, "rail": groups.rail_ranks}
    out["none"] = hierarchical_reduce_scatter(torch.empty(SHARD), x.clone(), groups, codec="none")
    out["int8"] = hierarchical_reduce_scatter(torch.empty(SHARD), x.clone(), groups, codec="int8")
    # megatron-core's call: the output is this rank's shard of the very buffer reduced, averaged
    buf = x.clone()
    local = buf[rank * SHARD:(rank + 1) * SHARD]
    hierarchical_reduce_scatter(local, buf, groups, codec="int8", op="avg")
    out["in_place_avg"] = local.clone()
    out["bf16_io"] = hierarchical_reduce_scatter(torch.empty(SHARD, dtype=torch.bfloat16), x.bfloat16(), groups,
                                                 codec="int8")
    # error feedback: two steps of the same gradient, with and without the residual
    ef = CompressionState(codec="int4", block_size=BLOCK, error_feedback=True)
    plain = CompressionState(codec="int4", block_size=BLOCK, error_feedback=False)
    out["ef_sum"] = sum(hierarchical_reduce_scatter(torch.empty(SHARD), x.clone(), groups, state=ef, key="b0")
                        for _ in range(2))
    out["plain_sum"] = sum(hierarchical_reduce_scatter(torch.empty(SHARD), x.clone(), groups, state=plain, key="b0")
                           for _ in range(2))
    out["residual_keys"] = ef.keys()
    out["residual_numel"] = ef.residual_numel(("hierarchical", "b0"))
    # wire bytes: across nodes only the rail's all-to-all; inside the node an fp32 reduce-scatter
    with WireCounter(filter_group=groups.rail) as rail, WireCounter(filter_group=groups.intra) as intra:
        hierarchical_reduce_scatter(torch.empty(SHARD), x.clone(), groups, codec="int8")
    out["rail_bytes"], out["intra_bytes"] = rail.bytes_sent, intra.bytes_sent
    with WireCounter() as flat_wire:
        compressed_reduce_scatter(torch.empty(SHARD), x.clone(), codec="int8")
    out["flat_bytes"] = flat_wire.bytes_sent
    # one node: exactly the flat compressed reduce-scatter (same bits)
    one_node = build_groups(parse_sim("1x4"))
    out["one_node"] = hierarchical_reduce_scatter(torch.empty(SHARD), x.clone(), one_node, codec="int8")
    out["one_node_flat"] = compressed_reduce_scatter(torch.empty(SHARD), x.clone(), codec="int8")
    # GradientSync, codec auto with the hierarchy: one decision per bucket, reduce-scatter model
    sync = GradientSync(CompressionConfig(codec="auto", auto_candidates=("int8",)), lambda: 0,
                        TopologyConfig(hierarchical=True))
    key = sync.compress_key("rs", x.numel())
    out["auto"] = sync.reduce_scatter_sum(torch.empty(SHARD), x.clone(), None, key)
    out["auto_decision"] = sync.decision_of(key).to_dict()
    return out


@functools.lru_cache(maxsize=None)
def run_2x2() -> list[dict]:
    return run_ranks(_scenarios, WORLD, 100, env={"ROBUST_TOPOLOGY_SIM": f"{NODES}x{PER_NODE}"})


def _int8_bound(codec_levels: int = 127) -> float:
    # One quantization of each node's partial sum on the rail: every element is off by at most half
    # a step, amax(block) / levels / 2, per node; the partial sums are bounded by the node's |x|.
    amax = max(float(rank_input(r).abs().max()) for r in range(WORLD))
    return NODES * PER_NODE * amax / codec_levels / 2


def test_none_is_the_flat_reduce_scatter_in_its_layout():
    exact = oracle()
    for rank, out in enumerate(run_2x2()):
        # fp32 sums of 4 terms in another order: a few ulps of the largest partial sum
        torch.testing.assert_close(out["none"], out["flat"], rtol=0, atol=16 * torch.finfo(torch.float32).eps * 4)
        torch.testing.assert_close(out["none"].double(), exact[rank], rtol=0, atol=1e-5)


def test_int8_within_the_codec_bound_of_the_oracle():
    exact, bound = oracle(), _int8_bound()
    for rank, out in enumerate(run_2x2()):
        err = float((out["int8"].double() - exact[rank]).abs().max())
        assert 0 < err <= bound, f"rank {rank}: {err:.3g} > {bound:.3g}"
        avg_err = float((out["in_place_avg"].double() - exact[rank] / WORLD).abs().max())
        assert avg_err <= bound / WORLD
        assert out["bf16_io"].dtype == torch.bfloat16
        assert float((out["bf16_io"].double() - exact[rank]).abs().max()) <= bound + 2**-7 * float(exact.abs().max())


def test_error_feedback_brings_two_steps_closer():
    exact = oracle()
    for rank, out in enumerate(run_2x2()):
        ef = float((out["ef_sum"].double() - 2 * exact[rank]).norm())
        plain = float((out["plain_sum"].double() - 2 * exact[rank]).norm())
        assert ef < 0.75 * plain, f"rank {rank}: with residual {ef:.3g}, without {plain:.3g}"
        assert out["residual_keys"] == [repr(("hierarchical", "b0"))]
        assert out["residual_numel"] == NODES * SHARD  # the rail step's input: the node's sums


def test_wire_bytes_across_nodes_by_hand():
    blocks = -(-SHARD // BLOCK)
    row = blocks * BLOCK + 4 * blocks  # int8 codes of whole blocks + one fp32 scale a block
    for out in run_2x2():
        assert out["rail_bytes"] == (NODES - 1) * row  # one shard to the other node
        assert out["intra_bytes"] == (PER_NODE - 1) * WORLD * SHARD * 4 // PER_NODE  # fp32 in the node
        # flat: 3 shards leave the rank, 2 of them to the other node: PER_NODE x the rail's
        assert out["flat_bytes"] == (WORLD - 1) * row
        assert out["flat_bytes"] * (WORLD - PER_NODE) // (WORLD - 1) == PER_NODE * out["rail_bytes"]


def test_one_node_is_the_flat_path():
    for out in run_2x2():
        assert torch.equal(out["one_node"], out["one_node_flat"])


def test_auto_decides_the_reduce_scatter_route():
    exact, bound = oracle(), _int8_bound()
    outs = run_2x2()
    for rank, out in enumerate(outs):
        d = out["auto_decision"]
        assert d["collective"] == "reduce_scatter" and d == outs[0]["auto_decision"]
        assert set(d["predicted_s"]) == {"flat none", "flat int8", "hier none", "hier int8"}
        assert float((out["auto"].double() - exact[rank]).abs().max()) <= bound

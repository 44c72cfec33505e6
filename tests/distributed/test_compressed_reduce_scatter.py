"""compressed_reduce_scatter on 2 and 3 gloo ranks against torch.distributed.reduce_scatter_tensor.

The oracle is gloo's own reduce-scatter of the same inputs: ``none`` must equal it bitwise, the
codecs must stay within one quantization of it, error feedback must carry the residual into the
next call, and the output may be a view into the input (how megatron-core calls it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from robust_plugins.comm import CompressionState, compressed_reduce_scatter
from robust_plugins.errors import RobustPluginsError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

SHARD = 1_003  # odd: every shard is padded to whole blocks separately
TOL = {"bf16": 2**-7, "int8": 1 / 127, "int4": 1 / 7}  # one quantization, |error| / max |input|


def _suite(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(world * SHARD, generator=g)
    exact = torch.empty(SHARD)
    dist.reduce_scatter_tensor(exact, x.clone())
    out: dict = {"exact": exact, "codecs": {}, "amax": float(x.abs().max())}
    for codec in ("none", "bf16", "int8", "int4"):
        out["codecs"][codec] = compressed_reduce_scatter(torch.empty(SHARD), x.clone(), codec=codec)
    # megatron-core's call: the output is this rank's shard of the very tensor being reduced
    buf = x.clone()
    local = buf[rank * SHARD:(rank + 1) * SHARD]
    compressed_reduce_scatter(local, buf, codec="int8", op="avg")
    out["in_place_avg"] = local.clone()
    # error feedback: the sum of the outputs of k calls approaches k x the exact sum
    state = CompressionState(codec="int4", error_feedback=True)
    plain = CompressionState(codec="int4", error_feedback=False)
    acc_ef, acc_plain = torch.zeros(SHARD), torch.zeros(SHARD)
    for _ in range(8):
        acc_ef += compressed_reduce_scatter(torch.empty(SHARD), x.clone(), state=state, key="b0")
        acc_plain += compressed_reduce_scatter(torch.empty(SHARD), x.clone(), state=plain, key="b0")
    out["ef_err"] = float((acc_ef - 8 * exact).abs().max())
    out["plain_err"] = float((acc_plain - 8 * exact).abs().max())
    out["residual_numel"] = state.residual_numel("b0")
    try:
        compressed_reduce_scatter(torch.empty(SHARD + 1), x.clone(), codec="int8")
        out["size_error"] = None
    except RobustPluginsError as exc:
        out["size_error"] = str(exc)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_matches_gloo(world):
    for rank, r in enumerate(run_ranks(_suite, world, 100)):
        assert torch.equal(r["codecs"]["none"], r["exact"])
        for codec, tol in TOL.items():
            err = float((r["codecs"][codec] - r["exact"]).abs().max())
            assert 0 < err <= tol * r["amax"] * world, (rank, codec, err)
        assert torch.allclose(r["in_place_avg"], r["exact"] / world, atol=TOL["int8"] * r["amax"])
        assert r["ef_err"] < 0.5 * r["plain_err"], (r["ef_err"], r["plain_err"])
        assert r["residual_numel"] == world * SHARD
        assert "expected world size" in r["size_error"]

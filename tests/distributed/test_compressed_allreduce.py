"""Compressed collectives on 2 and 4 gloo ranks: accuracy, agreement, bytes, calls, NaN, DDP hook.

Starting ranks costs seconds (imports), so one launch per world size runs every scenario and
returns its observations; the tests below assert on them.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from robust_plugins.comm import CompressionState, WireCounter, compressed_all_reduce, compressed_reduce, ddp_comm_hook

pytestmark = pytest.mark.distributed

N = 10_007  # odd: exercises padding
BIG = 1 << 20  # large enough that scale overhead and padding are what they are at scale
CODECS = ("none", "bf16", "int8", "int4", "sign")
# Max |error| / max |input| of one compressed average: two quantizations (sender, reducer).
TOL = {"bf16": 2**-7, "int8": 2 / 127, "int4": 2 / 7}
WIRE_RATIO_MAX = {"int8": 0.27, "int4": 0.14, "sign": 0.04}


def rank_input(rank: int, n: int = N, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g).to(dtype)


def _suite(rank: int, world: int) -> dict:
    out: dict = {"all_reduce": {}, "reduce": {}, "wire": {}, "calls": {}}
    x = rank_input(rank)
    for codec in CODECS:
        out["all_reduce"][codec] = compressed_all_reduce(x.clone(), codec=codec)
    plain = x.clone()
    dist.all_reduce(plain)
    plain /= world
    out["plain_avg"] = plain
    s = x.clone()
    out["sum_int8"] = compressed_all_reduce(s, codec="int8", op="sum")

    # Other float dtypes and shapes, written back in place.
    out["bf16_tensor"] = compressed_all_reduce(rank_input(rank, 6 * 331, torch.bfloat16).view(6, 331), codec="int8")
    out["fp16_tensor"] = compressed_all_reduce(rank_input(rank, 6 * 331, torch.float16).view(331, 6), codec="int4")

    # Bytes and calls on a large fp32 tensor.
    big = rank_input(rank, BIG)
    with WireCounter() as wc:
        dist.all_reduce(big.clone())
    out["wire"]["fp32_all_reduce"] = wc.bytes_sent
    for codec in CODECS:
        with WireCounter() as wc:
            compressed_all_reduce(big.clone(), codec=codec)
        out["wire"][codec] = wc.bytes_sent
        out["calls"][codec] = dict(wc.calls)

    # Reduce onto the last rank.
    dst = world - 1
    for codec in ("none", "int8", "sign"):
        t = x.clone()
        compressed_reduce(t, dst, codec=codec, op="sum")
        out["reduce"][codec] = t
    with WireCounter() as wc:
        compressed_reduce(big.clone(), dst, codec="int8")
    out["reduce_calls"] = dict(wc.calls)
    out["reduce_bytes"] = wc.bytes_sent

    # A NaN on rank 1 only.
    t = x.clone()
    if rank == 1:
        t[5] = float("nan")
    out["nan"] = compressed_all_reduce(t, codec="int8")

    # Error feedback through the real collective: two steps under one key.
    st = CompressionState(codec="int4", block_size=64)
    for _ in range(2):
        compressed_all_reduce(x.clone(), state=st, key=("bucket", 0))
    out["residual_norms"] = (
        st.sender_residual(("bucket", 0), N).norm().item(),
        st.server_residual(("bucket", 0), -(-N // (world * 64)) * 64).norm().item(),
    )

    # A subgroup of the odd ranks (4 ranks only): group-local ranks and dst.
    if world == 4:
        group = dist.new_group([1, 3])
        other = dist.new_group([1, 3])  # same ranks, another group: the counter must skip it
        if rank in (1, 3):
            t = x.clone()
            with WireCounter(filter_group=group) as wc:
                compressed_all_reduce(t, codec="int8", group=group)
                dist.all_reduce(torch.ones(4), group=other)
            out["sub_all_reduce"] = t
            out["sub_calls"] = dict(wc.calls)
            t = x.clone()
            compressed_reduce(t, 1, codec="int8", group=group)  # group rank 1 = global rank 3
            out["sub_reduce"] = t
        dist.barrier()
    return out


@functools.lru_cache(maxsize=None)
def _suite_results(world: int):
    return run_ranks(_suite, world, 240)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"W{w}")
def suite(request):
    return request.param, _suite_results(request.param)


@pytest.fixture(scope="module")
def suite4():
    """The 4-rank run (shared with ``suite[W4]``): the subgroup scenario needs 4 ranks."""
    return 4, _suite_results(4)


def exact_avg(world: int, n: int = N, dtype=torch.float32) -> torch.Tensor:
    return torch.stack([rank_input(r, n, dtype).float() for r in range(world)]).mean(0)


def test_results_close_to_the_exact_average(suite):
    world, res = suite
    exact = exact_avg(world)
    amax = max(rank_input(r).abs().max() for r in range(world))
    for codec, tol in TOL.items():
        err = (res[0]["all_reduce"][codec] - exact).abs().max()
        assert err <= tol * amax, (codec, err.item())
    # sign without error feedback only keeps direction: check it is positively correlated.
    y = res[0]["all_reduce"]["sign"]
    assert torch.nn.functional.cosine_similarity(y, exact, dim=0) > 0.5
    torch.testing.assert_close(res[0]["sum_int8"], exact * world, atol=TOL["int8"] * amax * world, rtol=0)


def test_all_ranks_bitwise_identical(suite):
    world, res = suite
    for name in ("nan", "sum_int8", "bf16_tensor", "fp16_tensor"):
        for r in range(1, world):
            assert torch.equal(res[r][name].view(torch.uint8), res[0][name].view(torch.uint8)), name
    for codec in CODECS:
        for r in range(1, world):
            assert torch.equal(res[r]["all_reduce"][codec], res[0]["all_reduce"][codec]), codec


def test_none_is_bitwise_all_reduce_then_divide(suite):
    world, res = suite
    for r in range(world):
        assert torch.equal(res[r]["all_reduce"]["none"], res[r]["plain_avg"])


def test_other_dtypes_and_shapes_are_written_back(suite):
    world, res = suite
    a, b = res[0]["bf16_tensor"], res[0]["fp16_tensor"]
    assert (a.dtype, a.shape, b.dtype, b.shape) == (torch.bfloat16, (6, 331), torch.float16, (331, 6))
    exact_a = exact_avg(world, 6 * 331, torch.bfloat16).view(6, 331)
    exact_b = exact_avg(world, 6 * 331, torch.float16).view(331, 6)
    assert (a.float() - exact_a).abs().max() <= 3 / 127 * 4.5
    assert (b.float() - exact_b).abs().max() <= 2 / 7 * 4.5


def test_wire_bytes_against_fp32_all_reduce(suite):
    world, res = suite
    wire = res[0]["wire"]
    assert wire["fp32_all_reduce"] == 2 * (world - 1) * BIG * 4 // world
    assert wire["none"] == wire["fp32_all_reduce"]
    for codec, bound in WIRE_RATIO_MAX.items():
        ratio = wire[codec] / wire["fp32_all_reduce"]
        assert ratio <= bound, (codec, ratio)
    assert wire["bf16"] / wire["fp32_all_reduce"] <= 0.51


def test_compressed_codecs_use_one_all_to_all_and_one_all_gather(suite):
    _, res = suite
    for codec in ("bf16", "int8", "int4", "sign"):
        assert res[0]["calls"][codec] == {"all_to_all_single": 1, "all_gather_into_tensor": 1}, codec
    assert res[0]["calls"]["none"] == {"all_reduce": 1}


def test_reduce_lands_on_dst_only(suite):
    world, res = suite
    dst = world - 1
    exact_sum = exact_avg(world) * world
    amax = max(rank_input(r).abs().max() for r in range(world))
    assert torch.allclose(res[dst]["reduce"]["none"], exact_sum, atol=1e-5)
    assert (res[dst]["reduce"]["int8"] - exact_sum).abs().max() <= world * 0.5 / 127 * amax * 1.01
    sign = res[dst]["reduce"]["sign"]
    assert torch.nn.functional.cosine_similarity(sign, exact_sum, dim=0) > 0.5
    # (dist.reduce itself, the `none` path, may overwrite non-destination tensors on gloo.)
    for r in range(world):
        if r != dst:
            for codec in ("int8", "sign"):
                assert torch.equal(res[r]["reduce"][codec], rank_input(r)), (r, codec)
    assert res[0]["reduce_calls"] == {"all_to_all_single": 1}
    # Non-destination ranks send their whole compressed tensor once; the destination sends nothing.
    assert res[dst]["reduce_bytes"] == 0
    assert res[0]["reduce_bytes"] == BIG + 4 * BIG // 256


def test_nan_on_one_rank_reaches_every_rank(suite):
    world, res = suite
    for r in range(world):
        y = res[r]["nan"]
        assert torch.isnan(y[5])
        assert torch.all(torch.isnan(y[:256]))  # the whole block: its scale is NaN
        assert torch.all(torch.isfinite(y[1024:]))


def test_error_feedback_residuals_are_kept(suite):
    world, res = suite
    for r in range(world):
        sender, server = res[r]["residual_norms"]
        assert 0 < sender < float("inf") and 0 < server < float("inf")


def test_subgroup_uses_group_local_ranks(suite4):
    world, res = suite4
    exact = (rank_input(1) + rank_input(3)) / 2
    assert (res[1]["sub_all_reduce"] - exact).abs().max() <= TOL["int8"] * 5
    assert torch.equal(res[1]["sub_all_reduce"], res[3]["sub_all_reduce"])
    assert res[1]["sub_calls"] == {"all_to_all_single": 1, "all_gather_into_tensor": 1}
    assert torch.equal(res[1]["sub_reduce"], rank_input(1))
    assert (res[3]["sub_reduce"] - exact * 2).abs().max() <= 2 * 0.5 / 127 * 5


# -- DDP comm hook ----------------------------------------------------------------------------------

STEPS = 5


def _train(rank: int, hook_state) -> list[torch.Tensor]:
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp(rank: int, world: int) -> dict:
    return {
        "default": _train(rank, None),
        "none": _train(rank, CompressionState(codec="none")),
        "int8": _train(rank, CompressionState(codec="int8")),
    }


@pytest.mark.timeout(120)
def test_ddp_comm_hook_matches_the_default_hook():
    res = run_ranks(_ddp, 2, 90)
    for r in range(2):
        for a, b in zip(res[r]["none"], res[r]["default"]):
            assert torch.equal(a, b)
        for a, b in zip(res[r]["int8"], res[r]["default"]):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=0)
        for a, b in zip(res[r]["int8"], res[0]["int8"]):
            assert torch.equal(a, b)  # replicas stay identical
    moved = sum((a - b).abs().sum() for a, b in zip(res[0]["int8"], _initial_params()))
    assert moved > 0


def _initial_params() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return [p.detach().clone() for p in model.parameters()]

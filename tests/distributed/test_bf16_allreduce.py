"""``bf16_all_reduce`` (the ``flat bf16_allreduce`` route of ``codec: auto``) on 2 gloo ranks:
the sum is the fp32 sum within bf16 rounding, error feedback keeps the accumulated error bounded,
and ``auto`` sends buckets through it with its residuals kept per bucket."""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks

pytestmark = pytest.mark.distributed

U = 2.0 ** -8  # bf16's unit roundoff (8 significant bits)


def _grad(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)) * (1 + rank)


def _numerics(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from robust_plugins.comm.collectives import bf16_all_reduce
    from robust_plugins.errors import RobustPluginsError

    n = 50_001  # odd: no size assumption
    out = {}
    # One call, with and without a (fresh) residual: the same bits on every rank.
    for name, residual in (("plain", None), ("ef", torch.zeros(n))):
        t = _grad(rank, n)
        bf16_all_reduce(t, op="sum", residual=residual)
        out[name] = t
    out["ef_residual"] = residual
    t = _grad(rank, n)
    out["avg"] = bf16_all_reduce(t, op="avg").clone()
    # A repeating gradient whose bf16 rounding has the same sign every step (what error feedback
    # is for): both ranks send g = 1/3 + linspace, T times; compare the accumulated sum with T * 2g.
    g = torch.linspace(0.1, 10.0, 4096) + 1 / 3
    steps = 50
    for name, residual in (("acc_plain", None), ("acc_ef", torch.zeros(g.numel()))):
        total = torch.zeros(g.numel(), dtype=torch.float64)
        for _ in range(steps):
            t = g.clone()
            bf16_all_reduce(t, op="sum", residual=residual)
            total += t.double()
        out[name] = float((total - steps * 2 * g.double()).abs().max())
        if residual is not None:
            out["acc_residual_max"] = float(residual.abs().max())
    # A NaN is sent as NaN (the host's overflow check must see it); its residual restarts at 0.
    t = torch.ones(1000)
    if rank == 0:
        t[7] = float("nan")
    res = torch.full((1000,), 1e-3)
    bf16_all_reduce(t, op="sum", residual=res)
    out["nan"] = (bool(torch.isnan(t[7])), int(torch.isnan(t).sum()), bool(torch.isfinite(res).all()),
                  float(res[7]))
    try:
        bf16_all_reduce(torch.ones(10), op="sum", residual=torch.zeros(9))
    except RobustPluginsError as e:
        out["bad_residual"] = str(e)
    dist.barrier()
    return out


@pytest.mark.timeout(60)
def test_bf16_all_reduce_sum_is_the_fp32_sum_within_bf16_rounding_and_error_feedback_bounds_the_drift():
    a, b = run_ranks(_numerics, 2, 45)
    n = 50_001
    g0, g1 = _grad(0, n), _grad(1, n)
    exact = g0.double() + g1.double()
    for name in ("plain", "ef"):
        assert torch.equal(a[name], b[name]), name  # every rank decodes the same bits
        err = (a[name].double() - exact).abs()
        # Three roundings (each rank's cast, the backend's bf16 addition), each <= U of its value.
        bound = 2.1 * U * (g0.double().abs() + g1.double().abs())
        assert bool((err <= bound).all()), (name, float((err / bound).max()))
        # ... and it is really bf16 on the wire: the result is not the fp32 sum.
        rel = float((a[name].double() - exact).norm() / exact.norm())
        assert 1e-4 < rel < 4e-3, (name, rel)
    # A fresh residual changes nothing in the first call; it then holds the cast's rounding.
    assert torch.equal(a["plain"], a["ef"])
    r = a["ef_residual"]
    assert torch.equal(r, g0 - g0.to(torch.bfloat16).float()) and float(r.abs().max()) > 0
    assert torch.allclose(a["avg"].double(), exact / 2, rtol=0, atol=float(2.1 * U * (g0.abs() + g1.abs()).max()))
    # Accumulated error over 50 steps: without error feedback it grows with the steps (the same
    # rounding repeats); with it, it stays at the last residual's size (<= U * 10.4 per rank).
    assert a["acc_ef"] <= 2 * U * 10.4 * 1.01 and a["acc_residual_max"] <= U * 10.4, a
    assert a["acc_plain"] > 10 * a["acc_ef"], (a["acc_plain"], a["acc_ef"])
    assert a["nan"] == (True, 1, True, 0.0) and b["nan"][:3] == (True, 1, True)  # rank 0 held the NaN
    assert "residual must be fp32 with the tensor's 10 elements; got torch.float32 with 9" in a["bad_residual"]


def _auto(rank: int, world: int, error_feedback: bool) -> dict:
    from robust_plugins.comm.gradient_sync import GradientSync
    from robust_plugins.config import CompressionConfig

    # Told a slow link, the model decides (no trial runs), among none and bf16_allreduce only.
    cfg = CompressionConfig(codec="auto", auto_candidates=("none", "bf16_allreduce"), auto_link_gbit=0.01,
                            auto_bf16_error_feedback=error_feedback)
    sync = GradientSync(cfg, step_fn=lambda: 0)
    n = 1 << 14
    errs = []
    for step in range(3):
        t = _grad(rank + 10 * step, n)
        exact = t.clone()
        torch.distributed.all_reduce(exact)
        sync.all_reduce_sum(t, None, sync.compress_key("bucket", n))
        errs.append(float((t - exact).norm() / exact.norm()))
    st = sync.states.get("bf16_allreduce")  # only with auto_bf16_error_feedback
    return {"by_route": dict(sync.stats.by_route), "by_codec": dict(sync.stats.by_codec),
            "decisions": sync.stats.auto_decisions, "errs": errs, "keys": st.keys() if st else [],
            "residual_sq": st.residual_sq_norm() if st else 0, "saved": sorted(sync.state_dict()["compression_auto"])}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error_feedback", [True, False], ids=["auto_bf16_error_feedback", "default"])
def test_auto_sends_buckets_through_bf16_allreduce_and_keeps_its_residuals(error_feedback):
    out = run_ranks(_auto, 2, 45, error_feedback)
    n = 1 << 14
    for o in out:
        # Three buckets at the same site and step: keys bucket:0..2, all through the route.
        assert o["by_route"] == {"flat bf16_allreduce": 3 * n} and o["by_codec"] == {"bf16_allreduce": 3 * n}
        d = o["decisions"]
        assert len(d) == 1 and d[0]["route"] == "flat bf16_allreduce" and not d[0]["measured_s"]
        assert "hier bf16_allreduce" not in d[0]["predicted_s"]
        assert d[0]["predicted_s"]["flat bf16_allreduce"] < 0.9 * d[0]["predicted_s"]["flat none"]
        assert max(o["errs"]) < 4e-3 and min(o["errs"]) > 1e-4
        assert ("bf16_allreduce" in o["saved"]) == error_feedback  # residuals are checkpointed
        if error_feedback:
            assert o["keys"] == ["'bucket:0'", "'bucket:1'", "'bucket:2'"] and o["residual_sq"] > 0
        else:
            assert o["keys"] == [] and o["residual_sq"] == 0
    assert out[0]["decisions"][0]["predicted_s"] == out[1]["decisions"][0]["predicted_s"]

"""The Triton codec kernels (run by Triton's CPU interpreter) against the plain-torch reference.

Not collected by the main test run: ``test_triton_kernels.py`` runs this file in a child pytest with
``TRITON_INTERPRET=1`` set from the start (see there why). Run it alone the same way:
``TRITON_INTERPRET=1 python -m pytest tests/unit/triton_kernels_cases.py``.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when a kernel
module is first imported, so this module sets it before importing them and restores it at once;
the ``_interpret`` fixture sets it again for the calls (the dispatcher checks it). Nothing else in
the test suite imports the kernel modules (CPU tensors go to the reference), so other tests are
unaffected. The interpreter runs numpy once per program, so sizes are small and every launch uses
few, large tiles.

What "matches" means: codes and scales are bit-identical, except ``sign`` scales, whose block
mean the kernel sums in another order than torch (measured: at most 2 ulp apart for blocks of
32..4096; tested at 2**-20 relative). Residuals are bit-identical for int8, int4 and bf16, and for
``sign`` differ only by that scale difference.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import triton_ops
from triton_ops import _backend
from triton_ops import reference as ref

_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton", reason="triton is not installed: the kernels cannot be tested")
    from triton.runtime.interpreter import InterpretedFunction

    from triton_ops.kernels import dequantize as k_dequantize
    from triton_ops.kernels import quantize_ef as k_quantize_ef
    from triton_ops.kernels import reduce_requantize as k_reduce_requantize
finally:
    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous

CODECS = ("int8", "int4", "sign", "bf16")
QMAX = {"int8": 127, "int4": 7}
SIGN_SCALE_RTOL = 2.0**-20
# (elements, block size): the sizes of the issue, each with another block size from 32 to 4096.
CASES = [(1, 32), (31, 32), (257, 64), (4099, 96), (4099, 4096), (100_003, 512)]


@pytest.fixture(autouse=True, scope="module")
def _interpret():
    for module in (k_quantize_ef, k_dequantize, k_reduce_requantize):
        if not isinstance(module.KERNEL, InterpretedFunction):
            pytest.fail(f"{module.__name__} was imported before TRITON_INTERPRET=1 was set: its kernel is compiled")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.delenv(_backend.ENV_TRITON_ON_CPU, raising=False)
        yield


def gradient(n: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Zero-padded to whole blocks; magnitudes over 6 decades; block 1 all zero, a NaN in block 2
    and an Inf in block 3 when there are that many blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)
    padded = torch.zeros(ref.padded_numel(n, block_size))
    padded[:n] = x
    blocks = padded.numel() // block_size
    if blocks > 1:
        padded[block_size : 2 * block_size] = 0
    if blocks > 2:
        padded[2 * block_size + 5] = float("nan")
    if blocks > 3:
        padded[3 * block_size] = -float("inf")
    return padded.to(dtype)


def same_codes(a: torch.Tensor, b: torch.Tensor, codec: str) -> bool:
    if codec != "bf16":
        return torch.equal(a, b)
    # NaN bit patterns may differ between torch's vectorised and scalar casts; any NaN is a NaN.
    nan = torch.isnan(b)
    return torch.equal(torch.isnan(a), nan) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def assert_scales_match(a: torch.Tensor, b: torch.Tensor, codec: str) -> None:
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    if codec == "sign":
        torch.testing.assert_close(a[~torch.isnan(a)], b[~torch.isnan(b)], rtol=SIGN_SCALE_RTOL, atol=0)
    else:
        assert torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)])


def assert_residuals_match(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, codec: str, block_size: int) -> None:
    assert torch.all(torch.isfinite(a))
    if codec != "sign":
        assert torch.equal(a, b)
        return
    # r = x - q * scale: the scale's last-bit difference, times |q| = 1, plus one rounding.
    absmax = torch.nan_to_num(x.float(), posinf=0, neginf=0).abs().view(-1, block_size).amax(dim=1)
    bound = 2 * SIGN_SCALE_RTOL * absmax.repeat_interleave(block_size)
    assert torch.all((a - b).abs() <= bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec", CODECS)
def test_quantize_ef_matches_reference(codec, dtype):
    for n, bs in CASES:
        g = gradient(n, bs, dtype, seed=n)
        res = torch.randn(g.numel(), generator=torch.Generator().manual_seed(1)) * 0.01
        res_t, res_r = res.clone(), res.clone()
        ct, st = triton_ops.quantize_ef(g, res_t, codec=codec, block_size=bs, backend="triton")
        cr, sr = ref.quantize_ef(g, res_r, codec=codec, block_size=bs)
        assert ct.dtype == cr.dtype and ct.shape == cr.shape and st.shape == sr.shape, (n, bs)
        assert same_codes(ct, cr, codec), (n, bs)
        assert_scales_match(st, sr, codec)
        assert_residuals_match(res_t, res_r, g + res, codec, bs)
        # Without error feedback the kernel is a plain quantize.
        ct, st = triton_ops.quantize_ef(g, None, codec=codec, block_size=bs, backend="triton")
        cr, sr = ref.quantize(g, codec=codec, block_size=bs)
        assert same_codes(ct, cr, codec), (n, bs)
        assert_scales_match(st, sr, codec)


@pytest.mark.parametrize("codec", ["int8", "int4", "sign"])
def test_zero_and_non_finite_blocks(codec):
    bs = 64
    g = gradient(6 * bs, bs, torch.float32)
    res = torch.zeros_like(g)
    res[2 * bs : 4 * bs] = 0.5
    codes, scales = triton_ops.quantize_ef(g, res, codec=codec, block_size=bs, backend="triton")
    assert scales[1] == 0 and torch.isnan(scales[2]) and torch.isnan(scales[3])
    per_block = ref.codes_nbytes(bs, codec=codec)
    zero = 0x88 if codec == "int4" else 0
    for b in (2, 3):  # non-finite blocks: codes 0, residual reset
        assert torch.all(codes[b * per_block : (b + 1) * per_block] == zero)
        assert torch.all(res[b * bs : (b + 1) * bs] == 0)
    y = triton_ops.dequantize(codes, scales, codec=codec, block_size=bs, numel=g.numel(), backend="triton")
    assert torch.all(y[bs : 2 * bs] == 0)
    assert torch.all(torch.isnan(y[2 * bs : 4 * bs])) and torch.all(torch.isfinite(y[4 * bs :]))


@pytest.mark.parametrize("codec", CODECS)
def test_dequantize_matches_reference(codec):
    for n, bs in CASES:
        g = gradient(n, bs, torch.float32, seed=n + 1)
        codes, scales = ref.quantize(g, codec=codec, block_size=bs)
        yt = triton_ops.dequantize(codes, scales, codec=codec, block_size=bs, numel=n, backend="triton")
        yr = ref.dequantize(codes, scales, codec=codec, block_size=bs, numel=n)
        torch.testing.assert_close(yt, yr, rtol=0, atol=0, equal_nan=True)
        base = torch.randn(n)
        out_t, out_r = base.clone(), base.clone()
        assert triton_ops.dequantize(codes, scales, codec=codec, block_size=bs, numel=n, out=out_t,
                                     accumulate=True, backend="triton") is out_t
        ref.dequantize(codes, scales, codec=codec, block_size=bs, numel=n, out=out_r, accumulate=True)
        torch.testing.assert_close(out_t, out_r, rtol=0, atol=0, equal_nan=True)


def _received(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ranks' chunks as rows ``[codes | scales]`` of one uint8 buffer (as an all-to-all delivers
    them), so the kernel reads them through one strided view instead of a stacked copy."""
    rows = torch.stack([torch.cat((c.view(torch.uint8), s.view(torch.uint8))) for c, s in parts])
    n_code = parts[0][0].view(torch.uint8).numel()
    dtype = parts[0][0].dtype
    return [r[:n_code].view(dtype) for r in rows], [r[n_code:].view(torch.float32) for r in rows]


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("codec", CODECS)
def test_reduce_requantize_matches_reference(codec, world):
    for n, bs in [(4099, 96), (100_003, 1024)] if world == 3 else [(4099, 64)]:
        chunk = ref.padded_numel(n, bs)
        xs = [gradient(n, bs, torch.float32, seed=10 * world + r) * (r + 1) for r in range(world)]
        if world > 2:
            xs[1][0] = float("nan")  # one rank's non-finite block poisons that block of the sum
            xs[2] = torch.nan_to_num(xs[2], nan=0.0, posinf=0.0, neginf=0.0)
        parts = [ref.quantize(x, codec=codec, block_size=bs) for x in xs]
        valid = n - 3
        for codes_list, scales_list in (([c for c, _ in parts], [s for _, s in parts]), _received(parts)):
            res = torch.randn(chunk, generator=torch.Generator().manual_seed(world)) * 0.01
            res_t, res_r = res.clone(), res.clone()
            kw = dict(codec=codec, block_size=bs, scale_factor=1.0 / world, valid_numel=valid)
            ct, st = triton_ops.reduce_requantize(codes_list, scales_list, residual=res_t, backend="triton", **kw)
            cr, sr = ref.reduce_requantize(codes_list, scales_list, residual=res_r, **kw)
            assert same_codes(ct, cr, codec), (world, n, bs)
            assert_scales_match(st, sr, codec)
            x = ref.dequantize_sum(codes_list, scales_list, codec=codec, block_size=bs, numel=chunk) / world + res
            assert_residuals_match(res_t, res_r, x, codec, bs)


def test_reduce_requantize_reads_received_rows_in_place():
    parts = [ref.quantize(torch.randn(256), codec="int8", block_size=64) for _ in range(3)]
    codes_list, scales_list = _received(parts)
    rows = k_reduce_requantize.as_rows(codes_list)
    assert rows.data_ptr() == codes_list[0].data_ptr() and rows.stride(0) > rows.shape[1]
    assert k_reduce_requantize.as_rows([c for c, _ in parts]).shape == (3, 256)  # separate tensors: stacked


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_stochastic_rounding_is_the_reference_and_reproducible(codec):
    g = gradient(4099, 128, torch.float32)
    runs = [triton_ops.quantize_ef(g, None, codec=codec, block_size=128, rounding="stochastic", seed=s,
                                   backend="triton") for s in (7, 7, 8)]
    cr, sr = ref.quantize(g, codec=codec, block_size=128, rounding="stochastic", seed=7)
    assert torch.equal(runs[0][0], cr)
    assert_scales_match(runs[0][1], sr, codec)
    assert torch.equal(runs[0][0], runs[1][0])
    assert not torch.equal(runs[0][0], runs[2][0])
    res_t, res_r = torch.zeros_like(g), torch.zeros_like(g)
    cr, _ = ref.reduce_requantize([cr, cr], [sr, sr], codec=codec, block_size=128, residual=res_r,
                                  rounding="stochastic", seed=3)
    ct, _ = triton_ops.reduce_requantize([runs[0][0]] * 2, [runs[0][1]] * 2, codec=codec, block_size=128,
                                         residual=res_t, rounding="stochastic", seed=3, backend="triton")
    assert torch.equal(ct, cr) and torch.equal(res_t, res_r)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased(codec):
    """Every block holds its absmax 1.0 once and one value v elsewhere, so each launch draws the
    rounding of the same v ~65,000 times (draws depend on the element index). For an unbiased
    rounding the mean of q - v*qmax is 0 up to the 2**-24 resolution of the draws, with standard
    deviation sqrt(p(1-p)/N) <= 0.5/sqrt(N) (p = frac(v*qmax)); 6 of those bound the mean error
    (a false alarm has probability ~1e-9; a nearest rounding misses by min(p, 1-p) >= 0.1 here)."""
    qmax, bs, blocks = QMAX[codec], 256, 256
    for v in (0.1 / qmax, 0.37 / qmax, 2.5 / qmax, -3.9 / qmax):
        x = torch.full((blocks, bs), v)
        x[:, 0] = 1.0
        target = (x / 1.0 * qmax)[:, 1:].double()  # the fp32 v * qmax the codec rounds
        total, draws = 0.0, 0
        for seed in range(2):
            codes, _ = triton_ops.quantize_ef(x.view(-1), None, codec=codec, block_size=bs, rounding="stochastic",
                                              seed=seed, backend="triton")
            if codec == "int4":
                c = codes.to(torch.int16)
                codes = torch.stack(((c & 0xF) - 8, (c >> 4) - 8), dim=1)
            q = codes.view(blocks, bs)[:, 1:].double()
            total += (q - target).sum().item()
            draws += q.numel()
        bound = 6 * 0.5 / draws**0.5 + 2.0**-24
        assert abs(total / draws) <= bound, (v, total / draws, bound)


def test_dequantize_sum_composes_dequantize_in_rank_order():
    parts = [ref.quantize(torch.randn(320) * (r + 1), codec="int4", block_size=32) for r in range(3)]
    codes, scales = [c for c, _ in parts], [s for _, s in parts]
    want = ref.dequantize_sum(codes, scales, codec="int4", block_size=32, numel=290, scale_factor=1 / 3)
    for backend in ("reference", "triton"):
        got = triton_ops.dequantize_sum(codes, scales, codec="int4", block_size=32, numel=290,
                                        scale_factor=1 / 3, backend=backend)
        assert torch.equal(got, want), backend


# -- dispatch -------------------------------------------------------------------------------------


def test_cpu_tensors_run_the_reference_unless_switched(monkeypatch):
    cpu = torch.device("cpu")
    assert _backend.resolve("auto", cpu) == "reference"
    monkeypatch.setenv(_backend.ENV_TRITON_ON_CPU, "1")
    assert _backend.resolve("auto", cpu) == "triton"
    assert _backend.resolve("reference", cpu) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(triton_ops.TritonUnavailableError, match="TRITON_INTERPRET=1"):
        _backend.resolve("auto", cpu)
    with pytest.raises(ValueError, match="'cuda-ish'"):
        _backend.resolve("cuda-ish", cpu)


def test_missing_triton_is_named_never_a_silent_fallback(monkeypatch):
    monkeypatch.setattr(_backend, "_checked", True)
    monkeypatch.setattr(_backend, "_import_error", "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(triton_ops.TritonUnavailableError, match="pip install triton"):
        _backend.resolve("auto", torch.device("cuda"))
    with pytest.raises(triton_ops.TritonUnavailableError, match="No module named 'triton'"):
        triton_ops.quantize_ef(torch.zeros(32), None, codec="int8", block_size=32, backend="triton")
    assert _backend.resolve("auto", torch.device("cpu")) == "reference"


def test_package_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, triton_ops\n"
        "codes, s = triton_ops.quantize_ef(torch.ones(32), None, codec='int8', block_size=32)\n"
        "assert codes.tolist() == [127] * 32\n"
        "try:\n"
        "    triton_ops.quantize_ef(torch.ones(32), None, codec='int8', block_size=32, backend='triton')\n"
        "except triton_ops.TritonUnavailableError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != _backend.ENV_TRITON_ON_CPU}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "triton cannot be imported" in out.stdout and "pip install triton" in out.stdout


def test_bad_arguments_raise_before_any_kernel_runs():
    with pytest.raises(ValueError, match="needs an integer seed"):
        triton_ops.quantize_ef(torch.zeros(32), None, codec="int8", block_size=32, rounding="stochastic",
                               backend="triton")
    with pytest.raises(ValueError, match="int8 and int4 only"):
        triton_ops.quantize_ef(torch.zeros(32), None, codec="sign", block_size=32, rounding="stochastic", seed=1)
    with pytest.raises(ValueError, match="multiple of 8"):
        triton_ops.quantize_ef(torch.zeros(30), None, codec="int8", block_size=30, backend="triton")


# -- torch.library / torch.compile -----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_custom_ops_pass_opcheck(backend):
    x = torch.randn(256)
    codes, scales = ref.quantize(x, codec="int4", block_size=64)
    ops = torch.ops.robust_plugins
    torch.library.opcheck(ops.quantize_ef.default, (x, torch.zeros(256), "int4", 64, "nearest", None, backend))
    torch.library.opcheck(ops.quantize_ef.default, (x.bfloat16(), None, "int8", 64, "stochastic", 5, backend))
    torch.library.opcheck(ops.dequantize.default, (codes, scales, "int4", 64, 250, backend))
    torch.library.opcheck(ops.dequantize_into.default, (codes, scales, torch.ones(256), "int4", 64, True, backend))
    torch.library.opcheck(ops.reduce_requantize.default,
                          ([codes, codes], [scales, scales], torch.zeros(256), "int4", 64, 0.5, 200, "nearest",
                           None, backend))


def test_ops_compose_with_torch_compile():
    def step(g, residual):
        codes, scales = triton_ops.quantize_ef(g * 2, residual, codec="int8", block_size=64)
        return triton_ops.dequantize(codes, scales, codec="int8", block_size=64, numel=g.numel())

    g = torch.randn(512)
    r_eager, r_compiled = torch.zeros(512), torch.zeros(512)
    want = step(g, r_eager)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(g, r_compiled)
    assert torch.equal(got, want) and torch.equal(r_compiled, r_eager)

"""Fused error-feedback quantization: one pass reads the gradient and the residual and writes the
codes, the scales and the new residual. Semantics: ``triton_ops.reference.quantize_ef``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.kernels import _tile
from triton_ops import reference as ref


# `key` is a random 32-bit value: never let Triton specialise on it (1, multiples of 16).
@triton.jit(do_not_specialize=["key"])
def _quantize_ef_kernel(
    grad_ptr, res_ptr, codes_ptr, scales_ptr, n_blocks, key,
    CODEC: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr,
    G: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    pid = tl.program_id(0)
    idx, mask, grp, grp_mask, rows, row_ok = _tile.tile_index(pid, n_blocks, BLOCK, PACK, G, ROWS)
    x = tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + idx, mask=mask, other=0.0)
    codes, scales, r = _tile.encode(x, idx, key, CODEC, QMAX, BLOCK, PACK, STOCHASTIC)
    tl.store(codes_ptr + grp, codes, mask=grp_mask)
    if CODEC != 0:
        tl.store(scales_ptr + rows, scales, mask=row_ok)
    if HAS_RES:
        tl.store(res_ptr + idx, r, mask=mask)


#: The kernel object (the dispatcher checks it was built for the interpreter on CPU tensors).
KERNEL = _quantize_ef_kernel


def launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    codec: str,
    block_size: int,
    rounding: str,
    seed: int | None,
) -> None:
    """Run the kernel on flat contiguous ``x`` (any float dtype), writing ``codes``/``scales`` and ``residual``."""
    n_blocks = x.numel() // block_size
    if n_blocks == 0:
        return
    if block_size > _tile.MAX_BLOCK:
        raise ValueError(f"block_size = {block_size} exceeds the Triton kernels' limit of {_tile.MAX_BLOCK}.")
    pack = _tile.PACK[codec]
    g, rows, num_warps = _tile.tile_shape(block_size, pack, triton.knobs.runtime.interpret)
    key = ref.seed_key(seed) if rounding == "stochastic" else 0
    # bf16 codes are written as their int16 bit patterns (see triton_ops/kernels/_tile.py).
    codes_arg = codes.view(torch.int16) if codec == "bf16" else codes
    # Unused pointers (no residual; bf16 has no scales) still need a real tensor behind them.
    _quantize_ef_kernel[(triton.cdiv(n_blocks, rows),)](
        x, residual if residual is not None else x, codes_arg, scales if scales.numel() else x, n_blocks, key,
        CODEC=_tile.CODEC_IDS[codec], QMAX=_tile.QMAX[codec], BLOCK=block_size, PACK=pack, G=g, ROWS=rows,
        HAS_RES=residual is not None, STOCHASTIC=rounding == "stochastic",
        num_warps=num_warps, enable_fp_fusion=False,
    )


def quantize_ef(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    codec: str,
    block_size: int,
    rounding: str = "nearest",
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`triton_ops.reference.quantize_ef` (same arguments, same results)."""
    ref._check_codec(codec)
    ref._check_block_size(block_size)
    ref._check_flat(grad, block_size, "grad")
    ref._check_rounding(codec, rounding, seed)
    if residual is not None and (residual.dtype != torch.float32 or residual.shape != grad.shape):
        raise ValueError(
            f"residual must be fp32 with the gradient's shape {tuple(grad.shape)}, got "
            f"{residual.dtype} {tuple(residual.shape)}."
        )
    if residual is not None and not residual.is_contiguous():
        raise ValueError("residual must be contiguous: the kernel updates it in place.")
    codes, scales = ref.empty_encoded(grad.numel(), codec=codec, block_size=block_size, device=grad.device)
    launch(grad.detach().contiguous(), residual, codes, scales,
           codec=codec, block_size=block_size, rounding=rounding, seed=seed)
    return codes, scales

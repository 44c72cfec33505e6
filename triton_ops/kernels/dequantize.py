"""Decoding kernel: codes and scales to fp32, written to ``out`` or added to it (``accumulate``).
Semantics: ``triton_ops.reference.dequantize``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.kernels import _tile
from triton_ops import reference as ref


@triton.jit
def _dequantize_kernel(
    codes_ptr, scales_ptr, out_ptr, numel, n_blocks,
    CODEC: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    idx, mask, grp, grp_mask, rows, row_ok = _tile.tile_index(pid, n_blocks, BLOCK, PACK, G, ROWS)
    codes = tl.load(codes_ptr + grp, mask=grp_mask, other=0)
    if CODEC == 0:
        scales = rows.to(tl.float32)  # bf16 has no scales; decode ignores them
    else:
        scales = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    values = _tile.decode(codes, scales, CODEC, PACK)
    mask = mask & (idx < numel)
    if ACCUMULATE:
        values = tl.load(out_ptr + idx, mask=mask, other=0.0) + values
    tl.store(out_ptr + idx, values, mask=mask)


#: The kernel object (the dispatcher checks it was built for the interpreter on CPU tensors).
KERNEL = _dequantize_kernel


def codes_numel(codes: torch.Tensor, codec: str) -> int:
    """Elements that ``codes`` of ``codec`` hold."""
    return codes.numel() * {"bf16": 1, "int8": 1, "int4": 2, "sign": 8}[codec]


def check(codes: torch.Tensor, scales: torch.Tensor, *, codec: str, block_size: int, numel: int) -> None:
    """Raise ``ValueError`` unless codes, scales and ``numel`` fit together (as the reference requires)."""
    ref._check_codec(codec)
    ref._check_block_size(block_size)
    n = codes_numel(codes, codec)
    if codec != "bf16" and n != scales.numel() * block_size:
        raise ValueError(
            f"{codec} codes hold {n} elements but {scales.numel()} scales of "
            f"block_size {block_size} cover {scales.numel() * block_size}."
        )
    if numel > n:
        raise ValueError(f"numel = {numel} exceeds the {n} elements the codes hold.")


def launch(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, codec: str, block_size: int,
           accumulate: bool) -> None:
    """Decode into ``out`` (fp32, contiguous, ``[numel]``); ``codes``/``scales`` contiguous."""
    numel = out.numel()
    n_blocks = triton.cdiv(numel, block_size)
    if n_blocks == 0:
        return
    if block_size > _tile.MAX_BLOCK:
        raise ValueError(f"block_size = {block_size} exceeds the Triton kernels' limit of {_tile.MAX_BLOCK}.")
    pack = _tile.PACK[codec]
    g, rows, num_warps = _tile.tile_shape(block_size, pack, triton.knobs.runtime.interpret)
    codes_arg = codes.view(torch.int16) if codec == "bf16" else codes
    _dequantize_kernel[(triton.cdiv(n_blocks, rows),)](
        codes_arg, scales if scales.numel() else out, out, numel, n_blocks,
        CODEC=_tile.CODEC_IDS[codec], BLOCK=block_size, PACK=pack, G=g, ROWS=rows, ACCUMULATE=accumulate,
        num_warps=num_warps, enable_fp_fusion=False,
    )


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    codec: str,
    block_size: int,
    numel: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Triton version of :func:`triton_ops.reference.dequantize` (same arguments, same results)."""
    check(codes, scales, codec=codec, block_size=block_size, numel=numel)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the fp32 tensor to add the decoded values to).")
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=codes.device)
    elif out.dtype != torch.float32 or out.shape != (numel,) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous fp32 of shape ({numel},), got {out.dtype} {tuple(out.shape)}.")
    launch(codes.contiguous(), scales.contiguous(), out, codec=codec, block_size=block_size, accumulate=accumulate)
    return out

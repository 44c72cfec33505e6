"""Phase two of the compressed all-reduce in one pass: decode every rank's chunk, sum in fp32 in rank
order, scale, zero the padding, add the server-side residual and requantize.
Semantics: ``triton_ops.reference.reduce_requantize``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.kernels import _tile
from triton_ops import reference as ref
from triton_ops.kernels.dequantize import check, codes_numel


@triton.jit(do_not_specialize=["key"])
def _reduce_requantize_kernel(
    codes_ptr, codes_stride, scales_ptr, scales_stride, world, res_ptr, out_codes_ptr, out_scales_ptr,
    n_blocks, valid_numel, scale_factor, key,
    CODEC: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr,
    G: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    pid = tl.program_id(0)
    idx, mask, grp, grp_mask, rows, row_ok = _tile.tile_index(pid, n_blocks, BLOCK, PACK, G, ROWS)
    acc = tl.zeros([ROWS, G, PACK], dtype=tl.float32)
    # Rank order, one rank at a time: the reference's sum, so every rank computes the same bits.
    # Each rank's row by advancing 64-bit pointers one stride at a time: ``r * codes_stride`` is
    # int32 (a loop counter times a stride below 2**31) and wraps once a row starts past 2**31
    # bytes, e.g. the third of three ranks' 1.1e9 int8 codes.
    codes_row = codes_ptr
    scales_row = scales_ptr
    for r in range(world):
        codes = tl.load(codes_row + grp, mask=grp_mask, other=0)
        if CODEC == 0:
            scales = rows.to(tl.float32)  # bf16 has no scales
        else:
            scales = tl.load(scales_row + rows, mask=row_ok, other=0.0)
        acc += _tile.decode(codes, scales, CODEC, PACK)
        codes_row += codes_stride
        scales_row += scales_stride
    acc = acc * scale_factor
    # Lanes past a block's end decode code 0 to nonzero values (int4: -8, sign: -1); zero them with the
    # padding past valid_numel so that neither enters a scale.
    x = tl.where(mask & (idx < valid_numel), acc, 0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + idx, mask=mask, other=0.0)
    out_codes, out_scales, r = _tile.encode(x, idx, key, CODEC, QMAX, BLOCK, PACK, STOCHASTIC)
    tl.store(out_codes_ptr + grp, out_codes, mask=grp_mask)
    if CODEC != 0:
        tl.store(out_scales_ptr + rows, out_scales, mask=row_ok)
    if HAS_RES:
        tl.store(res_ptr + idx, r, mask=mask)


#: The kernel object (the dispatcher checks it was built for the interpreter on CPU tensors).
KERNEL = _reduce_requantize_kernel


def as_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``[W, n]`` holding ``parts`` in order: a strided view when they are evenly spaced rows of one
    buffer (as the chunks of a received all-to-all buffer are), otherwise a stacked copy."""
    first = parts[0]
    n = first.numel()
    same = all(
        p.dtype == first.dtype and p.numel() == n and p.is_contiguous()
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts
    )
    if same and len(parts) > 1:
        step = parts[1].storage_offset() - first.storage_offset()
        if step >= n and all(p.storage_offset() - first.storage_offset() == i * step for i, p in enumerate(parts)):
            return first.as_strided((len(parts), n), (step, 1))
    if same and len(parts) == 1:
        return first.view(1, n)
    return torch.stack([p.reshape(-1) for p in parts])


def reduce_requantize(
    codes_list: list[torch.Tensor],
    scales_list: list[torch.Tensor],
    *,
    codec: str,
    block_size: int,
    residual: torch.Tensor | None = None,
    scale_factor: float = 1.0,
    valid_numel: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`triton_ops.reference.reduce_requantize` (same arguments, same results)."""
    if not codes_list or len(codes_list) != len(scales_list):
        raise ValueError(
            f"need one scales tensor per codes tensor and at least one of each, got "
            f"{len(codes_list)} codes and {len(scales_list)} scales."
        )
    ref._check_codec(codec)
    ref._check_rounding(codec, rounding, seed)
    numel = codes_numel(codes_list[0], codec)
    for codes, scales in zip(codes_list, scales_list):
        if codes_numel(codes, codec) != numel:
            raise ValueError(f"every rank's chunk must hold {numel} elements, got {codes_numel(codes, codec)}.")
        check(codes, scales, codec=codec, block_size=block_size, numel=numel)
    if residual is not None and (residual.dtype != torch.float32 or residual.shape != (numel,)
                                 or not residual.is_contiguous()):
        raise ValueError(
            f"residual must be contiguous fp32 of shape ({numel},), got {residual.dtype} {tuple(residual.shape)}."
        )
    if block_size > _tile.MAX_BLOCK:
        raise ValueError(f"block_size = {block_size} exceeds the Triton kernels' limit of {_tile.MAX_BLOCK}.")
    device = codes_list[0].device
    out_codes, out_scales = ref.empty_encoded(numel, codec=codec, block_size=block_size, device=device)
    n_blocks = numel // block_size
    if n_blocks == 0:
        return out_codes, out_scales
    codes = as_rows([c.view(torch.int16) if codec == "bf16" else c for c in codes_list])
    # bf16 has no scales; the kernel never reads them, but Triton wants a real pointer.
    scales = as_rows(scales_list) if codec != "bf16" else torch.zeros(1, 1, device=device)
    pack = _tile.PACK[codec]
    g, rows, num_warps = _tile.tile_shape(block_size, pack, triton.knobs.runtime.interpret)
    valid = numel if valid_numel is None else min(max(valid_numel, 0), numel)
    key = ref.seed_key(seed) if rounding == "stochastic" else 0
    _reduce_requantize_kernel[(triton.cdiv(n_blocks, rows),)](
        codes, codes.stride(0), scales, scales.stride(0), len(codes_list),
        residual if residual is not None else scales,
        out_codes.view(torch.int16) if codec == "bf16" else out_codes, out_scales if out_scales.numel() else scales,
        n_blocks, valid, float(scale_factor), key,
        CODEC=_tile.CODEC_IDS[codec], QMAX=_tile.QMAX[codec], BLOCK=block_size, PACK=pack, G=g, ROWS=rows,
        HAS_RES=residual is not None, STOCHASTIC=rounding == "stochastic",
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return out_codes, out_scales

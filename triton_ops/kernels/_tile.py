"""Device functions shared by the codec kernels, and the tile shape their launchers use.

Every kernel views its flat tensor as a 3-D tile ``[ROWS, G, PACK]``: ``ROWS`` whole blocks of
``BLOCK`` elements, each block as ``G`` groups of ``PACK`` consecutive elements, where a group is
what one code byte holds (``PACK`` = 8 for ``sign``, 2 for ``int4``, 1 for ``int8`` and
``bf16``). Element ``(r, g, p)`` of a tile is element ``r * BLOCK + g * PACK + p`` of its rows,
so loads stay contiguous and packing a byte is a sum over the last axis, inside one thread.

The arithmetic follows ``triton_ops/reference.py`` operation for operation, because the codes
must come out bit-identical:

* ``x / absmax`` and ``absmax / qmax`` use ``tl.math.div_rn``: plain ``/`` on fp32 may compile
  to an approximate division on NVIDIA GPUs, which moves codes that sit near a rounding tie.
* Round half to even is ``(v + 1.5 * 2**23) - 1.5 * 2**23``: for ``|v| <= 2**22`` the sum lands
  where the fp32 spacing is exactly 1, so the hardware's own round-to-nearest-even does the
  rounding. The launchers pass ``enable_fp_fusion=False`` so ``unit * qmax + C`` is never
  contracted into one FMA (that would round the exact product instead of the fp32 product the
  reference rounds).
* bf16 codes are produced by integer round-to-nearest-even on the fp32 bits (NaN -> 0x7FC0, as
  torch does), because the CPU interpreter's float cast truncates.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Codec ids passed to the kernels as a constexpr.
CODEC_IDS = {"bf16": 0, "int8": 1, "int4": 2, "sign": 3}
#: Elements one code byte (one int16 for bf16) holds.
PACK = {"bf16": 1, "int8": 1, "int4": 2, "sign": 8}
QMAX = {"bf16": 0, "int8": 127, "int4": 7, "sign": 0}

#: Largest block size the kernels take: one block must fit one program's registers.
MAX_BLOCK = 16384

# Elements a program handles. 4096 fp32 elements (16 KB of gradient plus 16 KB of residual) keep
# enough loads in flight per SM on H100/H200-class GPUs while fitting registers at 4 warps. The
# CPU interpreter pays ~1 ms of Python per program and op, so there a tile is as large as allowed.
_GPU_TILE = 4096
_INTERPRETER_TILE = 65536


def tile_shape(block_size: int, pack: int, interpret: bool) -> tuple[int, int, int]:
    """``(G, ROWS, num_warps)`` for a block size: ``G`` is ``block_size / pack`` rounded up to a power of 2."""
    g = triton.next_power_of_2(block_size // pack)
    tile = _INTERPRETER_TILE if interpret else _GPU_TILE
    rows = max(1, tile // (g * pack))
    num_warps = 4 if g * pack * rows <= 4096 else 8
    return g, rows, num_warps


@triton.jit
def tile_index(pid, n_blocks, BLOCK: tl.constexpr, PACK: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr):
    """Element indices ``[ROWS, G, PACK]`` (int64) of program ``pid``'s tile, the mask of real elements,
    the group index and mask ``[ROWS, G]`` (for code bytes), the row ids and the row mask ``[ROWS]``."""
    rows = pid * ROWS + tl.arange(0, ROWS)
    g = tl.arange(0, G)
    p = tl.arange(0, PACK)
    row_ok = rows < n_blocks
    grp_mask = row_ok[:, None] & (g[None, :] < BLOCK // PACK)
    grp = rows[:, None].to(tl.int64) * (BLOCK // PACK) + g[None, :]
    idx = grp[:, :, None] * PACK + p[None, None, :]
    mask = grp_mask[:, :, None] & (p[None, None, :] < PACK)
    return idx, mask, grp, grp_mask, rows, row_ok


@triton.jit
def _fmix32(h):
    # MurmurHash3's finalizer on uint32: the reference's `_fmix32`.
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def uniform(idx, key):
    """fp32 draws in ``[0, 1)`` for element indices ``idx`` (the reference's ``uniform_draws``)."""
    h = _fmix32(idx.to(tl.uint32) ^ key.to(tl.uint32))
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _row_all_finite(v):
    # Number of NaN / Inf elements per row is 0. |v| < inf is False for both.
    bad = (~(tl.abs(v) < float("inf"))).to(tl.int32)
    return tl.sum(tl.sum(bad, axis=2), axis=1) == 0


@triton.jit
def encode(x, idx, key, CODEC: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr,
           STOCHASTIC: tl.constexpr):
    """Quantize an fp32 tile (padding lanes hold 0). Returns ``(codes [ROWS, G] int32, scales [ROWS],
    residual tile)``: the residual is ``x - decode(codes)``, zeroed in rows where it is not finite."""
    p = tl.arange(0, PACK)
    if CODEC == 0:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        half = tl.where(x != x, 0x7FC0, rounded)
        deq = (half << 16).to(tl.float32, bitcast=True)
        codes = tl.sum(half.to(tl.int32), axis=2)
        scales = tl.sum(tl.sum(half, axis=2), axis=1).to(tl.float32)  # placeholder: bf16 has no scales, never stored
    else:
        finite = _row_all_finite(x)
        safe = tl.where(finite[:, None, None], x, 0.0)
        absmax = tl.max(tl.max(tl.abs(safe), axis=2), axis=1)
        nonzero = absmax > 0
        denom = tl.where(nonzero, absmax, 1.0)
        unit = tl.math.div_rn(safe, denom[:, None, None])
        if CODEC == 3:
            # Sum order differs from torch's, so this scale may differ from the reference's in the
            # last bits (codes never do: they depend on signs only).
            mean = tl.math.div_rn(tl.sum(tl.sum(tl.abs(unit), axis=2), axis=1), BLOCK * 1.0)
            scales = tl.where(finite, absmax * mean, float("nan"))
            bit = ((safe >= 0) & (nonzero & finite)[:, None, None]).to(tl.int32)
            codes = tl.sum(bit << p[None, None, :], axis=2)
            qf = (bit * 2 - 1).to(tl.float32)
        else:
            v = unit * QMAX
            if STOCHASTIC:
                f = tl.math.floor(v)
                u = uniform(idx, key)
                q = f + (u < v - f).to(tl.float32)
            else:
                q = (v + 12582912.0) - 12582912.0
            q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0)
            qi = q.to(tl.int32)
            # Through int32 so that a code of 0 decodes to +0.0, as the reference's int8 codes do.
            qf = qi.to(tl.float32)
            scales = tl.where(finite, tl.math.div_rn(absmax, QMAX * 1.0), float("nan"))
            if CODEC == 1:
                codes = tl.sum(qi, axis=2)
            else:
                codes = tl.sum((qi + 8) << (p[None, None, :] * 4), axis=2)
        deq = qf * scales[:, None, None]
    r = x - deq
    r = tl.where(_row_all_finite(r)[:, None, None], r, 0.0)
    return codes, scales, r


@triton.jit
def decode(codes, scales, CODEC: tl.constexpr, PACK: tl.constexpr):
    """Decode code words ``[ROWS, G]`` (loaded, any int type) with ``scales [ROWS]`` to fp32 ``[ROWS, G, PACK]``."""
    p = tl.arange(0, PACK)
    c = codes.to(tl.int32)[:, :, None]
    if CODEC == 0:
        out = ((c & 0xFFFF).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        if CODEC == 1:
            q = c
        elif CODEC == 2:
            q = ((c >> (p[None, None, :] * 4)) & 0xF) - 8
        else:
            q = ((c >> p[None, None, :]) & 1) * 2 - 1
        out = q.to(tl.float32) * scales[:, None, None]
    return out

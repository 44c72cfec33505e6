"""Plain-torch reference of the gradient codecs: the specification the Triton kernels must match.

Every function here works on flat 1-D tensors and computes in fp32 whatever the input dtype.
Quantizing functions take a length that is a multiple of ``block_size``; callers pad with zeros.
A later Triton implementation must reproduce these results bit for bit, so the arithmetic is
spelled out below and the code follows it literally.

Codecs
------
``int8``  One fp32 scale per block of ``block_size`` elements. ``absmax`` is the largest ``|x|``
          of the block, ``qmax = 127``, ``scale = absmax / qmax`` and the code is
          ``q = round((x / absmax) * qmax)`` clamped to ``[-qmax, qmax]``, stored as int8.
          Decoding is ``q * scale``. Dividing by ``absmax`` first (instead of by ``scale``) keeps
          ``x / absmax`` in ``[-1, 1]``, so nothing overflows or divides by an underflowed scale
          for magnitudes anywhere in the fp32 range. (Only a block whose absmax lies within a
          rounding error of the fp32 maximum can decode to +/-Inf, when ``qmax * scale`` rounds up.)
``int4``  As ``int8`` with ``qmax = 7``. Codes ``q`` in ``[-7, 7]`` are stored as ``q + 8`` in a
          nibble, two a byte (uint8, ``n / 2`` bytes): the even element in the low nibble, the
          odd element in the high nibble.
``sign``  One bit an element: 1 for ``x >= 0`` (so ``-0.0`` and ``+0.0`` are 1), 0 otherwise,
          packed eight a byte little-endian (element ``8k + i`` is bit ``i`` of byte ``k``;
          uint8, ``n / 8`` bytes). The scale is the block mean of ``|x|``, the L2-optimal scale
          for a +/-1 code, computed as ``absmax * mean(|x| / absmax)`` so that the sum cannot
          overflow. Decoding is ``scale * (+1 if bit else -1)``.
``bf16``  ``codes = x.to(torch.bfloat16)`` (round to nearest even), no scales (an empty fp32
          tensor). Values beyond the bf16 range become +/-Inf.

Rounding is ``torch.round``: round half to even. All arithmetic is fp32.

Stochastic rounding (``rounding="stochastic"``, ``int8`` and ``int4`` only) replaces
``round(v)`` with ``v = (x / absmax) * qmax``, ``f = floor(v)`` and
``q = f + (u < v - f)``, where ``u`` in ``[0, 1)`` is drawn for element ``i`` (its index in the
quantized tensor) from ``seed`` by a counter-based hash, so the result depends on ``(seed, i)``
only, never on block size, launch grid or device:

    key = fmix32((seed mod 2**32) XOR 0x9E3779B9)
    u   = (fmix32((i mod 2**32) XOR key) >> 8) * 2**-24

``fmix32`` is MurmurHash3's 32-bit finalizer (``h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13;
h *= 0xC2B2AE35; h ^= h >> 16``, all mod 2**32). ``v - f`` is exact in fp32 and ``u`` is a
multiple of ``2**-24``, so ``E[q] - v`` lies in ``[0, 2**-24)`` (unbiased to 24 bits), and every
implementation computes the same codes. ``sign`` has no rounding step (one bit a sign, scale the
L2-optimal mean) and ``bf16`` is a cast, so both reject ``"stochastic"``.

Special blocks
--------------
* All-zero block: ``scale = 0`` and every code is 0 (for ``sign``: every bit 0). It decodes to
  zeros.
* A block holding any NaN or Inf: ``scale = NaN`` and every code is 0, so the whole block decodes
  to NaN. A non-finite gradient must never turn into finite numbers: an fp16/bf16 loss scaler
  (DeepSpeed's overflow check) has to see it and skip the step. (``bf16`` keeps NaN and Inf
  element-wise, as the cast does.)
* Error feedback: a block whose new residual is not finite (non-finite input, or a bf16 overflow)
  gets residual 0, so one overflow step does not poison the residual for the rest of training.
"""

from __future__ import annotations

import math

import torch

#: Codecs implemented here (``none`` is not a codec: it is the host's own collective).
CODECS = ("bf16", "int8", "int4", "sign")

#: Rounding modes of :func:`quantize` (``stochastic`` for ``int8`` / ``int4`` only).
ROUNDINGS = ("nearest", "stochastic")

_QMAX = {"int8": 127, "int4": 7}

# Bit i of a packed sign byte is element 8k + i.
_BIT_WEIGHTS = [1 << i for i in range(8)]


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"codec = {codec!r} is not known here; allowed: {', '.join(CODECS)}.")


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 8 or block_size % 8:
        raise ValueError(
            f"block_size = {block_size!r} must be a positive integer multiple of 8 "
            f"(so that a block of sign bits fills whole bytes), e.g. 256."
        )


def _check_flat(x: torch.Tensor, block_size: int, what: str) -> None:
    if x.dim() != 1:
        raise ValueError(f"{what} must be a flat 1-D tensor, got shape {tuple(x.shape)}.")
    if x.numel() % block_size:
        raise ValueError(
            f"{what} has {x.numel()} elements, not a multiple of block_size = {block_size}: "
            f"pad it with zeros to {padded_numel(x.numel(), block_size)}."
        )


def _check_rounding(codec: str, rounding: str, seed: int | None) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding = {rounding!r} is not known here; allowed: {', '.join(ROUNDINGS)}.")
    if rounding == "stochastic":
        if codec not in _QMAX:
            raise ValueError(
                f"rounding='stochastic' applies to int8 and int4 only, not codec {codec!r} "
                f"(sign keeps one bit a sign, bf16 is a cast); use rounding='nearest'."
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(
                f"rounding='stochastic' needs an integer seed (e.g. the step number) so that the result "
                f"is reproducible, got seed = {seed!r}."
            )


_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # (h * c) mod 2**32 for int64 tensors holding uint32 values: split c in 16-bit halves so that
    # no product exceeds 2**48 (an int64 product of two 32-bit values could overflow).
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seed_key(seed: int) -> int:
    """``fmix32((seed mod 2**32) XOR 0x9E3779B9)``: the per-call key of stochastic rounding."""
    return int(_fmix32(torch.tensor([(seed & _M32) ^ 0x9E3779B9], dtype=torch.int64)).item())


def uniform_draws(numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 ``u`` in ``[0, 1)`` that stochastic rounding uses for elements ``0 .. numel-1``."""
    idx = torch.arange(numel, dtype=torch.int64, device=device) & _M32
    h = _fmix32(idx ^ seed_key(seed))
    return (h >> 8).to(torch.float32) * 2.0**-24


def padded_numel(numel: int, block_size: int) -> int:
    """Return ``numel`` rounded up to a whole number of blocks."""
    return -(-numel // block_size) * block_size


def codes_nbytes(numel: int, *, codec: str) -> int:
    """Bytes of the codes of ``numel`` elements (``numel`` already padded to whole blocks)."""
    _check_codec(codec)
    if codec == "bf16":
        return 2 * numel
    if codec == "int8":
        return numel
    if codec == "int4":
        return numel // 2
    return numel // 8


def scales_numel(numel: int, *, codec: str, block_size: int) -> int:
    """Number of fp32 scales for ``numel`` elements (0 for ``bf16``)."""
    _check_codec(codec)
    return 0 if codec == "bf16" else -(-numel // block_size)


def empty_encoded(
    numel: int, *, codec: str, block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised ``(codes, scales)`` with the dtypes and shapes :func:`quantize` returns for
    ``numel`` elements (a multiple of ``block_size``)."""
    _check_codec(codec)
    dtype = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8, "sign": torch.uint8}[codec]
    n_codes = numel if codec in ("bf16", "int8") else codes_nbytes(numel, codec=codec)
    return (
        torch.empty(n_codes, dtype=dtype, device=device),
        torch.empty(scales_numel(numel, codec=codec, block_size=block_size), dtype=torch.float32, device=device),
    )


def wire_nbytes(numel: int, *, codec: str, block_size: int) -> int:
    """Bytes of codes plus fp32 scales for ``numel`` elements, padded to whole blocks.

    ``codec="none"`` is accepted and returns the fp32 size, ``4 * numel``.
    """
    if codec == "none":
        return 4 * numel
    _check_block_size(block_size)
    n = padded_numel(numel, block_size)
    return codes_nbytes(n, codec=codec) + 4 * scales_numel(n, codec=codec, block_size=block_size)


def quantize(
    x: torch.Tensor, *, codec: str, block_size: int, rounding: str = "nearest", seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a flat tensor; return ``(codes, scales)`` as described in the module docstring.

    Args:
        x: 1-D float tensor (any float dtype) whose length is a multiple of ``block_size``.
        codec: ``bf16``, ``int8``, ``int4`` or ``sign``.
        block_size: elements sharing one scale.
        rounding: ``nearest`` (half to even) or ``stochastic`` (int8 / int4, needs ``seed``).
        seed: the stochastic draws' seed; element ``i`` of ``x`` always gets the same draw.

    Returns:
        ``codes`` (bf16 ``[n]``, int8 ``[n]``, uint8 ``[n/2]`` or uint8 ``[n/8]``) and fp32
        ``scales`` ``[n / block_size]`` (empty for ``bf16``), on ``x``'s device.
    """
    _check_codec(codec)
    _check_block_size(block_size)
    _check_flat(x, block_size, "x")
    _check_rounding(codec, rounding, seed)
    xf = x.detach().to(torch.float32)
    if codec == "bf16":
        return xf.to(torch.bfloat16), torch.empty(0, dtype=torch.float32, device=x.device)

    blocks = xf.view(-1, block_size)
    finite = torch.isfinite(blocks).all(dim=1)
    # Non-finite blocks are encoded from zeros (codes 0) and flagged by a NaN scale below.
    safe = torch.where(finite[:, None], blocks, torch.zeros((), device=x.device))
    absmax = safe.abs().amax(dim=1)
    nonzero = absmax > 0
    denom = torch.where(nonzero, absmax, torch.ones((), device=x.device))
    unit = safe / denom[:, None]  # in [-1, 1]
    nan = torch.full((), float("nan"), device=x.device)

    if codec in _QMAX:
        qmax = _QMAX[codec]
        v = unit * qmax
        if rounding == "nearest":
            q = torch.round(v)
        else:
            f = torch.floor(v)
            u = uniform_draws(x.numel(), seed, x.device).view(-1, block_size)
            q = f + (u < v - f).to(torch.float32)
        q = q.clamp_(-qmax, qmax).to(torch.int8).view(-1)
        scales = torch.where(finite, absmax / qmax, nan)
        if codec == "int8":
            return q, scales
        nib = (q.to(torch.int16) + 8).to(torch.uint8)
        return nib[0::2] | (nib[1::2] << 4), scales

    scales = torch.where(finite, absmax * unit.abs().mean(dim=1), nan)
    bits = (safe >= 0) & (nonzero & finite)[:, None]
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    codes = (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)
    return codes, scales


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
    """Decode ``(codes, scales)`` from :func:`quantize`; return the first ``numel`` values in fp32.

    With ``out`` (fp32, ``[numel]``) the values are written there (``accumulate=True``: added to
    it, ``out += q * scale``, the product rounded to fp32 first) and ``out`` is returned.
    """
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the fp32 tensor to add the decoded values to).")
    if out is not None and (out.dtype != torch.float32 or out.shape != (numel,)):
        raise ValueError(f"out must be fp32 of shape ({numel},), got {out.dtype} {tuple(out.shape)}.")
    values = _decode(codes, scales, codec=codec, block_size=block_size, numel=numel)
    if out is None:
        return values
    if accumulate:
        out += values
    else:
        out.copy_(values)
    return out


def _decode(codes: torch.Tensor, scales: torch.Tensor, *, codec: str, block_size: int, numel: int) -> torch.Tensor:
    _check_codec(codec)
    _check_block_size(block_size)
    if codec == "bf16":
        return codes.to(torch.float32)[:numel]
    if codec == "int8":
        q = codes.to(torch.float32)
    elif codec == "int4":
        c = codes.to(torch.int16)
        q = torch.stack(((c & 0xF) - 8, (c >> 4) - 8), dim=1).view(-1).to(torch.float32)
    else:
        shifts = torch.arange(8, dtype=torch.int16, device=codes.device)
        bits = (codes.to(torch.int16)[:, None] >> shifts) & 1
        q = (bits * 2 - 1).view(-1).to(torch.float32)
    if q.numel() != scales.numel() * block_size:
        raise ValueError(
            f"{codec} codes hold {q.numel()} elements but {scales.numel()} scales of "
            f"block_size {block_size} cover {scales.numel() * block_size}."
        )
    if numel > q.numel():
        raise ValueError(f"numel = {numel} exceeds the {q.numel()} elements the codes hold.")
    return (q.view(-1, block_size) * scales[:, None]).view(-1)[:numel]


def _reset_nonfinite_blocks(residual: torch.Tensor, block_size: int) -> None:
    blocks = residual.view(-1, block_size)
    bad = ~torch.isfinite(blocks).all(dim=1)
    blocks[bad] = 0.0


def quantize_ef(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    codec: str,
    block_size: int,
    rounding: str = "nearest",
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``grad + residual`` and store the new quantization error in ``residual``.

    ``residual`` (fp32, same length as ``grad``) is updated in place to
    ``x - dequantize(quantize(x))`` with ``x = grad + residual``; blocks where that is not finite
    are reset to 0. With ``residual=None`` this is :func:`quantize` of ``grad`` in fp32.
    ``rounding`` and ``seed`` are :func:`quantize`'s.
    """
    x = grad.detach().to(torch.float32)
    if residual is None:
        return quantize(x, codec=codec, block_size=block_size, rounding=rounding, seed=seed)
    if residual.dtype != torch.float32 or residual.shape != x.shape:
        raise ValueError(
            f"residual must be fp32 with the gradient's shape {tuple(x.shape)}, got "
            f"{residual.dtype} {tuple(residual.shape)}."
        )
    x = x + residual
    codes, scales = quantize(x, codec=codec, block_size=block_size, rounding=rounding, seed=seed)
    torch.sub(x, dequantize(codes, scales, codec=codec, block_size=block_size, numel=x.numel()), out=residual)
    _reset_nonfinite_blocks(residual, block_size)
    return codes, scales


def dequantize_sum(
    codes_list: list[torch.Tensor],
    scales_list: list[torch.Tensor],
    *,
    codec: str,
    block_size: int,
    numel: int,
    scale_factor: float = 1.0,
) -> torch.Tensor:
    """Decode one chunk from each rank and add them in fp32, in list (rank) order.

    The fixed order makes every rank compute the same bits. The sum is multiplied by
    ``scale_factor`` (``1 / world_size`` to average) unless it is 1.
    """
    if len(codes_list) != len(scales_list) or not codes_list:
        raise ValueError(
            f"need one scales tensor per codes tensor and at least one of each, got "
            f"{len(codes_list)} codes and {len(scales_list)} scales."
        )
    acc = dequantize(codes_list[0], scales_list[0], codec=codec, block_size=block_size, numel=numel).clone()
    for codes, scales in zip(codes_list[1:], scales_list[1:]):
        acc += dequantize(codes, scales, codec=codec, block_size=block_size, numel=numel)
    if scale_factor != 1.0:
        acc *= scale_factor
    return acc


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
    """The reducing side of a compressed all-reduce for one chunk.

    Decodes each rank's chunk, sums in fp32 in rank order, multiplies by ``scale_factor``, adds
    the server-side ``residual`` and requantizes, updating ``residual`` in place as
    :func:`quantize_ef` does. Elements at index ``>= valid_numel`` are padding: they are zeroed
    before requantization so that they neither enter a block's scale nor the residual.
    ``rounding`` and ``seed`` (draws indexed by position in the chunk) are :func:`quantize`'s.
    """
    if not codes_list:
        raise ValueError("codes_list is empty: need one chunk from each rank.")
    _check_codec(codec)
    numel = _codes_numel(codes_list[0], codec)
    acc = dequantize_sum(
        codes_list, scales_list, codec=codec, block_size=block_size, numel=numel, scale_factor=scale_factor
    )
    if valid_numel is not None and valid_numel < numel:
        acc[max(valid_numel, 0):] = 0.0
    return quantize_ef(acc, residual, codec=codec, block_size=block_size, rounding=rounding, seed=seed)


def _codes_numel(codes: torch.Tensor, codec: str) -> int:
    per_byte = {"bf16": 1, "int8": 1, "int4": 2, "sign": 8}[codec]
    return codes.numel() * per_byte


def relative_error_bound(codec: str) -> float:
    """Worst-case ``|x - decode(encode(x))| / absmax`` of a finite block, for tests and docs.

    Half a quantization step: ``0.5 / qmax`` for int8 / int4; for bf16 (8 significant bits) half
    an ulp, ``2**-8`` relative to the value itself. ``sign`` has no such bound (it keeps one bit) and returns ``inf``.
    """
    _check_codec(codec)
    if codec in _QMAX:
        return 0.5 / _QMAX[codec]
    return 2.0**-8 if codec == "bf16" else math.inf

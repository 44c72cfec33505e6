"""The pure (communication-free) steps of the two-phase compressed all-reduce.

The collective in :mod:`robust_plugins.comm.collectives` is these steps with one
``all_to_all_single`` between :func:`encode` and :func:`reduce_chunk` and one
``all_gather_into_tensor`` between :func:`reduce_chunk` and :func:`decode`. Tests and benchmarks
call :func:`simulate_all_reduce` to run W ranks in one process with exactly the same arithmetic.
The ``*_piece`` forms do the same for a range of whole blocks of every chunk (see :func:`pieces`),
which the collective uses to pipeline a long chunk; the whole-chunk forms are their one-piece case.

Wire layout: the flat gradient of ``numel`` elements is padded with zeros to ``padded``, a
multiple of ``world_size * block_size``, and cut into ``world_size`` chunks of ``chunk``
elements; rank ``r`` reduces chunk ``r``. A chunk travels as one uint8 row
``[codes bytes | fp32 scale bytes]``. Every part is a multiple of 4 bytes, so the scales can be
viewed as fp32 in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_ops import ops
from triton_ops import reference as ref

_CODE_DTYPE = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8, "sign": torch.uint8}


@dataclass(frozen=True)
class Layout:
    """Sizes of one compressed all-reduce (or, with ``world_size=1``, one compressed reduce)."""

    numel: int
    world_size: int
    codec: str
    block_size: int
    padded: int
    """``numel`` rounded up to a multiple of ``world_size * block_size``."""
    chunk: int
    """Elements each rank reduces: ``padded / world_size``."""
    code_bytes: int
    """Bytes of one chunk's codes."""
    scale_bytes: int
    """Bytes of one chunk's fp32 scales."""

    @property
    def row_bytes(self) -> int:
        """Bytes of one packed chunk."""
        return self.code_bytes + self.scale_bytes

    def valid_in_chunk(self, rank: int) -> int:
        """How many elements of chunk ``rank`` are real (the rest is padding)."""
        return min(max(self.numel - rank * self.chunk, 0), self.chunk)


def plan(numel: int, world_size: int, codec: str, block_size: int) -> Layout:
    """Compute the :class:`Layout` for ``numel`` elements over ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size = {world_size} must be >= 1.")
    unit = world_size * block_size
    padded = max(-(-numel // unit), 1) * unit
    chunk = padded // world_size
    return Layout(
        numel=numel,
        world_size=world_size,
        codec=codec,
        block_size=block_size,
        padded=padded,
        chunk=chunk,
        code_bytes=ref.codes_nbytes(chunk, codec=codec),
        scale_bytes=4 * ref.scales_numel(chunk, codec=codec, block_size=block_size),
    )


def unpack(row: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one packed row into its codes and fp32 scales (views, no copy)."""
    codes = row[: layout.code_bytes].view(_CODE_DTYPE[layout.codec])
    scales = row[layout.code_bytes :].view(torch.float32)
    return codes, scales


def pieces(layout: Layout, piece_numel: int) -> list[tuple[int, int]]:
    """Cut every chunk into the same ``(start, length)`` pieces of at most ``piece_numel`` elements.

    Lengths are whole blocks (the last piece takes the rest), so a piece's codes and scales are
    exactly the ones the whole chunk would get: the codecs work block by block. A collective can
    then send piece ``p`` while piece ``p + 1`` is encoded (see :func:`encode_piece`).
    """
    bs = layout.block_size
    step = max(bs, piece_numel // bs * bs)
    return [(start, min(step, layout.chunk - start)) for start in range(0, layout.chunk, step)]


def _piece_rows(layout: Layout, start: int, length: int) -> list[tuple[int, int, int]]:
    """``(row, offset in the flat vector, real elements)`` of piece ``[start, start + length)`` of
    every chunk that holds real elements (the rest of the piece is padding)."""
    rows = []
    for r in range(layout.world_size):
        offset = r * layout.chunk + start
        valid = min(max(layout.numel - offset, 0), length)
        if valid:
            rows.append((r, offset, valid))
    return rows


def _pack_piece(codes: torch.Tensor, scales: torch.Tensor, layout: Layout, length: int) -> torch.Tensor:
    w = layout.world_size
    code_bytes = ref.codes_nbytes(length, codec=layout.codec)
    code_rows = codes.contiguous().view(torch.uint8).view(w, code_bytes)
    scale_rows = scales.contiguous().view(torch.uint8).view(w, -1)
    return torch.cat((code_rows, scale_rows), dim=1)


def _unpack_piece(row: torch.Tensor, layout: Layout, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    code_bytes = ref.codes_nbytes(length, codec=layout.codec)
    return row[:code_bytes].view(_CODE_DTYPE[layout.codec]), row[code_bytes:].view(torch.float32)


def encode_piece(
    x: torch.Tensor, layout: Layout, residual: torch.Tensor | None, start: int, length: int
) -> torch.Tensor:
    """Phase one, sending side, for elements ``[start, start + length)`` of every chunk.

    ``x`` is the flat gradient (``numel``); ``residual`` (fp32 ``[numel]`` or ``None``) is updated
    in place for those elements only. Padding carries no residual: its quantization error concerns
    no gradient. Returns ``[world_size, piece row bytes]``: row ``r`` goes to rank ``r``.
    """
    w = layout.world_size
    rows = _piece_rows(layout, start, length)
    whole = length == layout.chunk  # the rows are one contiguous range of x: one copy
    buf = torch.zeros(w * length, dtype=torch.float32, device=x.device)
    res = None if residual is None else torch.zeros_like(buf)
    if whole:
        buf[: layout.numel] = x
        if res is not None:
            res[: layout.numel] = residual
    else:
        for r, offset, valid in rows:
            buf[r * length : r * length + valid] = x[offset : offset + valid]
            if res is not None:
                res[r * length : r * length + valid] = residual[offset : offset + valid]
    codes, scales = ops.quantize_ef(buf, res, codec=layout.codec, block_size=layout.block_size)
    if residual is not None:
        if whole:
            residual.copy_(res[: layout.numel])
        else:
            for r, offset, valid in rows:
                residual[offset : offset + valid] = res[r * length : r * length + valid]
    return _pack_piece(codes, scales, layout, length)


def encode(x: torch.Tensor, layout: Layout, residual: torch.Tensor | None) -> torch.Tensor:
    """Phase one, sending side: quantize ``x`` (flat, ``numel``) with error feedback.

    ``residual`` (fp32 ``[numel]`` or ``None``) is updated in place. Padding carries no residual:
    its quantization error concerns no gradient. Returns the send buffer
    ``[world_size, row_bytes]``: row ``r`` goes to rank ``r``.
    """
    return encode_piece(x, layout, residual, 0, layout.chunk)


def reduce_piece(
    received: torch.Tensor, layout: Layout, rank: int, residual: torch.Tensor | None, scale_factor: float,
    start: int, length: int,
) -> torch.Tensor:
    """Phase one, reducing side, for elements ``[start, start + length)`` of chunk ``rank``.

    ``received[r]`` is the piece rank ``r`` sent. The sum is in fp32 in rank order, times
    ``scale_factor``, plus the reducing-side ``residual`` (fp32 ``[chunk]``; its elements of this
    piece are updated in place). Returns this rank's packed piece for the all-gather.
    """
    parts = [_unpack_piece(received[r], layout, length) for r in range(layout.world_size)]
    valid = min(max(layout.valid_in_chunk(rank) - start, 0), length)
    codes, scales = ops.reduce_requantize(
        [c for c, _ in parts],
        [s for _, s in parts],
        codec=layout.codec,
        block_size=layout.block_size,
        residual=None if residual is None else residual[start : start + length],
        scale_factor=scale_factor,
        valid_numel=valid,
    )
    return torch.cat((codes.view(torch.uint8), scales.view(torch.uint8)))


def reduce_chunk(
    received: torch.Tensor, layout: Layout, rank: int, residual: torch.Tensor | None, scale_factor: float
) -> torch.Tensor:
    """Phase one, reducing side: sum the ``world_size`` copies of chunk ``rank`` and requantize.

    ``received[r]`` is the row rank ``r`` sent. The sum is in fp32 in rank order, times
    ``scale_factor``, plus the reducing-side ``residual`` (fp32 ``[chunk]``, updated in place).
    Returns this rank's packed row for the all-gather.
    """
    return reduce_piece(received, layout, rank, residual, scale_factor, 0, layout.chunk)


def decode_piece(gathered: torch.Tensor, layout: Layout, out: torch.Tensor, start: int, length: int) -> None:
    """Phase two for elements ``[start, start + length)`` of every chunk: decode the gathered
    pieces ``[world_size, piece row bytes]`` into the flat ``out`` (``numel``, any float dtype)."""
    for r, offset, valid in _piece_rows(layout, start, length):
        codes, scales = _unpack_piece(gathered[r], layout, length)
        target = out[offset : offset + valid]
        if valid == length and out.dtype == torch.float32:
            ops.dequantize(codes, scales, codec=layout.codec, block_size=layout.block_size, numel=length,
                           out=target)
        else:
            values = ops.dequantize(codes, scales, codec=layout.codec, block_size=layout.block_size, numel=length)
            target.copy_(values[:valid])


def decode(gathered: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Phase two: decode the gathered rows ``[world_size, row_bytes]``; return fp32 ``[numel]``."""
    out = torch.empty(layout.numel, dtype=torch.float32, device=gathered.device)
    decode_piece(gathered, layout, out, 0, layout.chunk)
    return out


def decode_sum(received: torch.Tensor, layout: Layout, scale_factor: float) -> torch.Tensor:
    """Compressed reduce: decode every rank's whole vector (``world_size=1`` layout) and sum them.

    ``received`` is ``[senders, row_bytes]``; the sum is fp32, in sender order, times
    ``scale_factor``. Returns fp32 ``[numel]``.
    """
    parts = [unpack(received[r], layout) for r in range(received.shape[0])]
    return ops.dequantize_sum(
        [c for c, _ in parts],
        [s for _, s in parts],
        codec=layout.codec,
        block_size=layout.block_size,
        numel=layout.numel,
        scale_factor=scale_factor,
    )


def simulate_all_reduce(
    inputs: list[torch.Tensor],
    *,
    codec: str,
    block_size: int,
    op: str = "avg",
    sender_residuals: list[torch.Tensor] | None = None,
    server_residuals: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the compressed all-reduce of ``len(inputs)`` ranks in one process.

    Same steps and arithmetic as :func:`robust_plugins.comm.compressed_all_reduce`; the
    collectives are replaced by indexing. Residual lists (one fp32 tensor per rank, ``[numel]``
    for senders and ``[chunk]`` for the reducing side, see :func:`plan`) are updated in place;
    ``None`` turns that side's error feedback off. Returns the fp32 result every rank would get.
    """
    w = len(inputs)
    numel = inputs[0].numel()
    layout = plan(numel, w, codec, block_size)
    sends = [
        encode(x.reshape(-1), layout, None if sender_residuals is None else sender_residuals[r])
        for r, x in enumerate(inputs)
    ]
    scale = 1.0 / w if op == "avg" else 1.0
    rows = [
        reduce_chunk(
            torch.stack([sends[src][dst] for src in range(w)]),
            layout,
            dst,
            None if server_residuals is None else server_residuals[dst],
            scale,
        )
        for dst in range(w)
    ]
    return decode(torch.stack(rows), layout)

"""The pure (communication-free) steps of the two-phase compressed all-reduce.

The collective in :mod:`robust_plugins.comm.collectives` is these steps with one
``all_to_all_single`` between :func:`encode` and :func:`reduce_chunk` and one
``all_gather_into_tensor`` between :func:`reduce_chunk` and :func:`decode`. Tests and benchmarks
call :func:`simulate_all_reduce` to run W ranks in one process with exactly the same arithmetic.

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


def pack(codes: torch.Tensor, scales: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Pack codes and scales of the whole padded vector into uint8 rows ``[world_size, row_bytes]``."""
    w = layout.world_size
    code_rows = codes.contiguous().view(torch.uint8).view(w, layout.code_bytes)
    scale_rows = scales.contiguous().view(torch.uint8).view(w, layout.scale_bytes)
    return torch.cat((code_rows, scale_rows), dim=1)


def unpack(row: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one packed row into its codes and fp32 scales (views, no copy)."""
    codes = row[: layout.code_bytes].view(_CODE_DTYPE[layout.codec])
    scales = row[layout.code_bytes :].view(torch.float32)
    return codes, scales


def encode(x: torch.Tensor, layout: Layout, residual: torch.Tensor | None) -> torch.Tensor:
    """Phase one, sending side: quantize ``x`` (flat, ``numel``) with error feedback.

    ``residual`` (fp32 ``[numel]`` or ``None``) is updated in place. Padding carries no residual:
    its quantization error concerns no gradient. Returns the send buffer
    ``[world_size, row_bytes]``: row ``r`` goes to rank ``r``.
    """
    padded = torch.zeros(layout.padded, dtype=torch.float32, device=x.device)
    padded[: layout.numel] = x
    res = None
    if residual is not None:
        res = torch.zeros_like(padded)
        res[: layout.numel] = residual
    codes, scales = ops.quantize_ef(padded, res, codec=layout.codec, block_size=layout.block_size)
    if residual is not None:
        residual.copy_(res[: layout.numel])
    return pack(codes, scales, layout)


def reduce_chunk(
    received: torch.Tensor, layout: Layout, rank: int, residual: torch.Tensor | None, scale_factor: float
) -> torch.Tensor:
    """Phase one, reducing side: sum the ``world_size`` copies of chunk ``rank`` and requantize.

    ``received[r]`` is the row rank ``r`` sent. The sum is in fp32 in rank order, times
    ``scale_factor``, plus the reducing-side ``residual`` (fp32 ``[chunk]``, updated in place).
    Returns this rank's packed row for the all-gather.
    """
    parts = [unpack(received[r], layout) for r in range(layout.world_size)]
    codes, scales = ops.reduce_requantize(
        [c for c, _ in parts],
        [s for _, s in parts],
        codec=layout.codec,
        block_size=layout.block_size,
        residual=residual,
        scale_factor=scale_factor,
        valid_numel=layout.valid_in_chunk(rank),
    )
    return torch.cat((codes.view(torch.uint8), scales.view(torch.uint8)))


def decode(gathered: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Phase two: decode the gathered rows ``[world_size, row_bytes]``; return fp32 ``[numel]``."""
    chunks = []
    for r in range(layout.world_size):
        codes, scales = unpack(gathered[r], layout)
        chunks.append(
            ops.dequantize(codes, scales, codec=layout.codec, block_size=layout.block_size, numel=layout.chunk)
        )
    return torch.cat(chunks)[: layout.numel]


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

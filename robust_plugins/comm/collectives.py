"""Compressed all-reduce and reduce over ``torch.distributed``.

NCCL and gloo cannot add quantized payloads, so a compressed all-reduce is two collectives
(as in 1-bit Adam and ZeRO++): every rank quantizes its gradient and sends chunk ``r`` to rank
``r`` (one ``all_to_all_single``); rank ``r`` decodes the ``W`` copies of its chunk, sums them in
fp32, requantizes, and one ``all_gather_into_tensor`` hands every rank every reduced chunk. Each
rank sends ``2 (W-1)/W`` times the compressed size, the same bus traffic as a ring all-reduce of the
compressed tensor. All ranks decode the same gathered bytes, so their results are bitwise equal.
A chunk longer than :data:`PIECE_NUMEL` elements goes piece by piece (one all-to-all and one
all-gather a piece, asynchronous), so that encoding overlaps the transfers; same bytes, same bits.

Collectives are looked up as ``torch.distributed.<name>`` at call time so that
:class:`~robust_plugins.comm.wire.WireCounter` (and any host patch) sees them.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.distributed as dist

from robust_plugins.comm import _twophase
from robust_plugins.comm.state import CompressionState
from robust_plugins.config import CompressionConfig
from robust_plugins.device import default_piece_numel
from robust_plugins.errors import ConfigError, RobustPluginsError

OPS = ("avg", "sum")

_DEFAULT_CODEC = "int8"
_DEFAULT_BLOCK_SIZE = 256


def _resolve(
    codec: str | None, block_size: int | None, state: CompressionState | None
) -> tuple[str, int]:
    if state is None:
        codec = _DEFAULT_CODEC if codec is None else codec
        block_size = _DEFAULT_BLOCK_SIZE if block_size is None else block_size
        # Validated by the one config schema; error_feedback=True only so that `sign` passes
        # (a stateless call has no residuals: that is the caller's choice, not a config).
        CompressionConfig(codec=codec, block_size=block_size, error_feedback=True)
        return codec, block_size
    for name, given, held in (("codec", codec, state.codec), ("block_size", block_size, state.block_size)):
        if given is not None and given != held:
            raise ConfigError(
                f"{name}={given!r} conflicts with the state's {name}={held!r}: with a "
                f"CompressionState the state decides; drop the {name} argument."
            )
    return state.codec, state.block_size


def _check_call(tensor: torch.Tensor, op: str) -> None:
    if op not in OPS:
        raise ConfigError(f"op = {op!r} is not supported; allowed: {', '.join(OPS)}.")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise RobustPluginsError(f"Compressed collectives need a floating-point tensor, got {what}.")
    if not tensor.is_contiguous():
        raise RobustPluginsError(
            f"Compressed collectives work in place on contiguous tensors; got shape "
            f"{tuple(tensor.shape)} with strides {tensor.stride()}. Pass tensor.contiguous() "
            f"and copy the result back."
        )


def _world(group: Any) -> tuple[int, int]:
    """(rank in group, group size); a process without torch.distributed is a world of one."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RobustPluginsError(
                f"group={group!r} was given but torch.distributed is not initialized."
            )
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _residuals(
    state: CompressionState | None, key: Hashable | None, numel: int, layout: _twophase.Layout, device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if state is None or not state.error_feedback:
        return None, None
    key = ("default", numel) if key is None else key
    return (
        state.sender_residual(key, numel, device),
        state.server_residual(key, layout.chunk, device),
    )


def compressed_all_reduce(
    tensor: torch.Tensor,
    *,
    codec: str | None = None,
    group: Any = None,
    op: str = "avg",
    state: CompressionState | None = None,
    key: Hashable | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Average (``op="avg"``) or sum (``op="sum"``) ``tensor`` over ``group``, in place, compressed.

    Args:
        tensor: contiguous float tensor (fp32, bf16 or fp16), any shape. Overwritten with the
            result, cast back to its dtype; every rank ends with the same bits.
        codec: ``none``, ``bf16``, ``int8`` (default), ``int4`` or ``sign``. ``none`` is
            ``torch.distributed.all_reduce`` (then a division by the group size for ``avg``),
            bitwise what the host would do.
        group: process group (``None``: the default group).
        op: ``avg`` or ``sum``.
        state: a :class:`CompressionState`; it then decides codec, block size and
            ``min_numel`` (buckets below it go the ``none`` way), and its error-feedback
            residuals are used under ``key``. Without a state there is no error feedback.
        key: names the gradient slice this tensor holds, for error feedback; defaults to
            ``("default", tensor.numel())``. The same key must always carry the same slice.
        block_size: elements per fp32 scale (default 256).

    A block (``block_size`` elements) holding a NaN or Inf arrives as all-NaN on every rank.
    Without an initialized process group (or with one rank) nothing is sent, but the codec and
    error feedback still apply, so one rank behaves like many.

    Returns:
        ``tensor``.
    """
    codec, block_size = _resolve(codec, block_size, state)
    _check_call(tensor, op)
    rank, world = _world(group)
    numel = tensor.numel()
    if numel == 0:
        return tensor
    if codec == "none" or (state is not None and numel < state.min_numel):
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        if op == "avg" and world > 1:
            tensor.div_(world)
        return tensor

    layout = _twophase.plan(numel, world, codec, block_size)
    flat = tensor.view(-1)
    sender_res, server_res = _residuals(state, key, numel, layout, tensor.device)
    scale = 1.0 / world if op == "avg" else 1.0
    if world == 1:
        row = _twophase.reduce_chunk(_twophase.encode(flat, layout, sender_res), layout, rank, server_res, scale)
        _twophase.decode_piece(row.view(1, -1), layout, flat, 0, layout.chunk)
        return tensor
    _pipelined(flat, layout, rank, group, sender_res, server_res, scale, piece_numel_for(flat.device.type))
    return tensor


#: Elements of each rank's chunk a compressed all-reduce encodes, sends and reduces at a time.
#: A chunk longer than this is cut into pieces (whole blocks) and piece ``p`` is on the wire while
#: ``p + 1`` is encoded, so the codec's time hides behind the link instead of adding to it. The
#: result is bitwise the same for every piece size. 2**19 keeps every chunk of up to 2 MB of fp32
#: (a 4 MB training bucket over 2 or more ranks) one piece: one all-to-all and one all-gather.
#: Piece sizes side by side: BENCHMARKS.md (``benchmarks/allreduce_pieces.py``). This is the CPU
#: size; other devices take :data:`robust_plugins.device.PIECE_NUMEL` (:func:`piece_numel_for`).
PIECE_NUMEL = default_piece_numel("cpu")


def piece_numel_for(device_type: str) -> int:
    """Piece size of a compressed all-reduce of a tensor on ``device_type``: :data:`PIECE_NUMEL`
    on CPU (read at each call, so a benchmark or test may set it), the device's default elsewhere."""
    return PIECE_NUMEL if device_type == "cpu" else default_piece_numel(device_type)


def _pipelined(flat: torch.Tensor, layout: _twophase.Layout, rank: int, group: Any,
               sender_res: torch.Tensor | None, server_res: torch.Tensor | None, scale: float,
               piece_numel: int) -> None:
    """The two collectives of the two-phase all-reduce, piece by piece, overlapped with the codec.

    Every rank issues the same collectives in the same order (all-to-all of piece ``p``, then
    all-gather of piece ``p - 1``), asynchronously; each is waited for (within the group's
    timeout) before its output is used. One piece is exactly :func:`compressed_all_reduce`'s
    unpipelined schedule.
    """
    world = layout.world_size
    to_reduce: list = []  # (work, received, sent, start, length): all-to-alls in flight
    to_decode: list = []  # (work, gathered, row, start, length): all-gathers in flight

    def wait(work) -> None:
        # A WireCounter times each async call to its work's completion (wire.timing_path), so
        # this time stays communication for the straggler detector; on a GPU work.wait() only
        # makes the current stream wait for NCCL's (no host stall here).
        work.wait()

    def reduce_next() -> None:
        work, received, _sent, start, length = to_reduce.pop(0)
        wait(work)
        row = _twophase.reduce_piece(received, layout, rank, server_res, scale, start, length)
        gathered = torch.empty(world * row.numel(), dtype=torch.uint8, device=flat.device)
        gather = dist.all_gather_into_tensor(gathered, row, group=group, async_op=True)
        to_decode.append((gather, gathered, row, start, length))

    def decode_next() -> None:
        work, gathered, _row, start, length = to_decode.pop(0)
        wait(work)
        _twophase.decode_piece(gathered.view(world, -1), layout, flat, start, length)

    for start, length in _twophase.pieces(layout, piece_numel):
        send = _twophase.encode_piece(flat, layout, sender_res, start, length)
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received, send, group=group, async_op=True)
        if to_reduce:
            reduce_next()
        if len(to_decode) > 1:
            decode_next()
        to_reduce.append((work, received, send, start, length))
    while to_reduce:
        reduce_next()
    while to_decode:
        decode_next()


def bf16_all_reduce(
    tensor: torch.Tensor,
    *,
    group: Any = None,
    op: str = "avg",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Average or sum ``tensor`` over ``group``, in place, as one bf16 ``all_reduce``.

    The scheme of DeepSpeed's ``communication_data_type: bf16``: cast to bf16, one
    ``torch.distributed.all_reduce`` of the bf16 copy (half the bytes of fp32, one collective
    instead of the two-phase codecs' two), cast back. The backend adds in bf16: gloo rounds every
    partial sum of its ring to bf16 (checked on torch 2.13: ``1 + 2**-8`` sums to ``1.0``), so the
    sum carries ``W - 1`` roundings of relative size up to ``2**-8`` besides the cast's.

    ``residual`` (fp32, ``tensor.numel()`` elements, updated in place) turns on error feedback of
    the cast: the rank sends ``bf16(g + e)`` and keeps ``e' = (g + e) - bf16(g + e)``, so what
    this rank sent over ``T`` calls differs from the sum of its gradients by the last residual
    only, instead of by ``T`` times a rounding that repeats for a gradient that repeats. The
    roundings inside the backend's sum are not fed back: no rank knows the exact sum. A NaN or
    Inf element is sent as is (the sum stays non-finite, so a host's overflow check sees it) and
    its residual restarts from zero rather than staying NaN.

    Returns:
        ``tensor``.
    """
    _check_call(tensor, op)
    _, world = _world(group)
    if tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1)
    if residual is None:
        wire = flat.to(torch.bfloat16)
    else:
        if residual.dtype != torch.float32 or residual.numel() != flat.numel():
            raise RobustPluginsError(
                f"bf16_all_reduce: the residual must be fp32 with the tensor's {flat.numel()} elements; "
                f"got {residual.dtype} with {residual.numel()}."
            )
        residual.add_(flat)  # now the value to send, g + e
        wire = residual.to(torch.bfloat16)
        residual.sub_(wire)  # e' = (g + e) - bf16(g + e), in place: no second bucket-sized buffer
        residual.nan_to_num_(0.0, 0.0, 0.0)
    if world > 1:
        dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
    flat.copy_(wire)
    if op == "avg" and world > 1:
        tensor.div_(world)
    return tensor


def compressed_reduce(
    tensor: torch.Tensor,
    dst: int,
    *,
    codec: str | None = None,
    group: Any = None,
    op: str = "sum",
    state: CompressionState | None = None,
    key: Hashable | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Sum (or average) ``tensor`` onto group-local rank ``dst``, compressed; like ``dist.reduce``.

    Every rank quantizes its tensor (with the sender residual under ``key`` when ``state`` has
    error feedback) and one ``all_to_all_single`` with uneven splits delivers all of them to
    ``dst`` only, which decodes and sums them in fp32 in rank order and writes the result into
    its ``tensor``. Other ranks' tensors are left unchanged. ``codec="none"`` (or a bucket below
    the state's ``min_numel``) is ``torch.distributed.reduce`` itself, which on gloo may overwrite
    non-destination tensors with partial sums. Arguments as for
    :func:`compressed_all_reduce`; ``op`` defaults to ``sum`` as in ``dist.reduce``.

    Returns:
        ``tensor``.
    """
    codec, block_size = _resolve(codec, block_size, state)
    _check_call(tensor, op)
    rank, world = _world(group)
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world:
        raise ConfigError(f"dst = {dst!r} must be a group-local rank in [0, {world}).")
    numel = tensor.numel()
    if numel == 0:
        return tensor
    if codec == "none" or (state is not None and numel < state.min_numel):
        if dist.is_available() and dist.is_initialized():
            global_dst = dst if group is None else dist.get_global_rank(group, dst)
            dist.reduce(tensor, dst=global_dst, op=dist.ReduceOp.SUM, group=group)
        if op == "avg" and rank == dst and world > 1:
            tensor.div_(world)
        return tensor

    # The whole vector is one "chunk": the layout of a world of one.
    layout = _twophase.plan(numel, 1, codec, block_size)
    sender_res = None
    if state is not None and state.error_feedback:
        sender_res = state.sender_residual(("default", numel) if key is None else key, numel, tensor.device)
    send = _twophase.encode(tensor.view(-1), layout, sender_res)
    if world > 1:
        row = layout.row_bytes
        in_splits = [row if r == dst else 0 for r in range(world)]
        out_splits = [row if rank == dst else 0] * world
        received = torch.empty(sum(out_splits), dtype=torch.uint8, device=tensor.device)
        dist.all_to_all_single(
            received, send.view(-1), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
        )
        received = received.view(-1, row)
    else:
        received = send
    if rank == dst:
        scale = 1.0 / world if op == "avg" else 1.0
        tensor.view(-1).copy_(_twophase.decode_sum(received, layout, scale))
    return tensor


def compressed_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    codec: str | None = None,
    group: Any = None,
    op: str = "sum",
    state: CompressionState | None = None,
    key: Hashable | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Compressed ``reduce_scatter_tensor``: ``output`` = sum over ranks of ``input``'s shard ``rank``.

    ``input`` is contiguous with ``world * output.numel()`` elements, cut into ``world`` equal
    shards exactly as ``torch.distributed.reduce_scatter_tensor`` cuts it (so a host's own shard
    boundaries, e.g. megatron-core's distributed-optimizer shards, are kept). This is phase one of
    the two-phase scheme only: each rank quantizes every shard separately (sender-side error
    feedback over the whole ``input`` under ``key``), one ``all_to_all_single`` sends shard ``r``
    to rank ``r``, and rank ``r`` decodes and sums the ``world`` copies in fp32, in rank order, into
    ``output``. There is no second quantization, so no reducing-side residual. ``output`` may be a
    view into ``input`` (megatron-core passes its local shard of the bucket). ``codec="none"`` (or
    an input below the state's ``min_numel``) is ``reduce_scatter_tensor`` itself. Arguments as for
    :func:`compressed_all_reduce`.

    Returns:
        ``output``.
    """
    codec, block_size = _resolve(codec, block_size, state)
    _check_call(input, op)
    _check_call(output, op)
    rank, world = _world(group)
    shard = output.numel()
    if input.numel() != world * shard:
        raise RobustPluginsError(
            f"compressed_reduce_scatter: input has {input.numel()} elements, expected world size "
            f"{world} x output's {shard} = {world * shard}."
        )
    if shard == 0:
        return output
    if codec == "none" or (state is not None and input.numel() < state.min_numel):
        if dist.is_available() and dist.is_initialized():
            dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=group)
        else:
            output.copy_(input.view(-1))
        if op == "avg" and world > 1:
            output.div_(world)
        return output

    layout = _twophase.plan(shard, 1, codec, block_size)
    flat = input.view(-1)
    sender_res = None
    if state is not None and state.error_feedback:
        sender_res = state.sender_residual(("default", flat.numel()) if key is None else key, flat.numel(),
                                           input.device)
    # One encode per destination shard: codes never straddle a shard boundary, and each slice of
    # the residual (a view) is updated in place.
    send = torch.cat([
        _twophase.encode(flat[r * shard:(r + 1) * shard], layout,
                         None if sender_res is None else sender_res[r * shard:(r + 1) * shard])
        for r in range(world)
    ])
    if world > 1:
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
    else:
        received = send
    scale = 1.0 / world if op == "avg" else 1.0
    output.view(-1).copy_(_twophase.decode_sum(received, layout, scale))
    return output

"""DeepSpeed ZeRO-3: the gradient reduce-scatter as a quantized reduce-scatter with error feedback.

ZeRO-3 (DeepSpeed 0.19, ``runtime/zero/stage3.py``) reduces every gradient bucket in
``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`` with ``reduce_scatter_coalesced``: each
parameter's gradient is cut into ``world`` chunks of ``ceil(numel / world)`` (the last one padded),
the chunks are interleaved so that rank ``r``'s chunks of every parameter are contiguous, the
buffer is divided by ``world`` and reduce-scattered; rank ``r`` keeps its chunk of each parameter.

:func:`attach_zero3_reduce` shadows that method on one optimizer instance. It keeps the layout and
DeepSpeed's scaling (communication dtype, ``gradient_predivide_factor`` with
``postscale_gradients``, the averaging world size) and swaps only the collective for
:func:`robust_plugins.comm.compressed_reduce_scatter`: each rank quantizes every destination's
shard (int8 / int4 blocks, sender-side error feedback over the whole bucket under a per-step
bucket key), one ``all_to_all_single`` sends shard ``r`` to rank ``r``, which sums the decoded
copies in fp32 in rank order. With ``topology.hierarchical`` the bucket goes node first (fp32
reduce-scatter inside the node, then the compressed one across nodes among the ranks of one local
index: :func:`robust_plugins.topology.hierarchical_reduce_scatter`), and with ``codec: auto``
:meth:`robust_plugins.comm.gradient_sync.GradientSync.reduce_scatter_sum` picks each bucket's route
and codec; the shard layout is DeepSpeed's either way. Padding is zeros (DeepSpeed pads with uninitialised memory, which
would enter the block scales). Buckets the compression leaves alone (codec ``none``, warm-up,
``min_numel``) go to DeepSpeed's own method unchanged, so codec ``none`` is bitwise vanilla.

Refused (:func:`unsupported_reason`), each naming the key: codecs other than ``none``, ``int8``,
``int4`` and ``auto``, ``zero_optimization.reduce_scatter: false`` (ZeRO-3 then all-reduces), ``zero_quantized_gradients`` (DeepSpeed's qgZ takes the same
call), parameter partitions of other groups than the data-parallel one (MoE, hpZ).
"""

from __future__ import annotations

import math

import torch

from robust_plugins.errors import UnsupportedError
from robust_plugins.patches import _guard, _ranges

#: The mangled name of ``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads``.
_METHOD = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
_SIGNATURE = ["self", "params_to_reduce", "communication_data_type"]


def unsupported_reason(engine, plugin) -> str | None:
    """Why the compressed reduce-scatter cannot serve this ZeRO-3 engine (key, value, allowed), or None."""
    cfg, zero = plugin.config.compression, engine._config.zero_config
    if cfg.codec not in ("none", "int8", "int4", "auto"):
        return (f"compression.codec = {cfg.codec!r} is not wired for ZeRO-3's reduce-scatter; allowed there: "
                f"none, int8, int4, auto")
    if cfg.sign_mode == "momentum":
        return "compression.sign_mode = 'momentum' (1-bit Adam) needs ZeRO stage 0; allowed with ZeRO-3: 'gradient'"
    if cfg.overlap:
        return "compression.overlap = true: ZeRO-3 reduces inside backward itself; allowed: false or unset"
    if cfg.bucket_mb is not None:
        return ("compression.bucket_mb is ZeRO stage 0's; ZeRO-3's buckets are zero_optimization."
                "reduce_bucket_size; allowed: unset")
    if not zero.reduce_scatter:
        return "zero_optimization.reduce_scatter = false (ZeRO-3 then all-reduces); allowed: true"
    if engine.zero_quantized_gradients():
        return "zero_optimization.zero_quantized_gradients = true (DeepSpeed's qgZ); allowed: false"
    if zero.zero_hpz_partition_size > 1 or engine.has_moe_layers:
        return "ZeRO++ hpZ or MoE parameter groups (partitions over other groups); allowed: neither"
    return None


def attach_zero3_reduce(engine, plugin) -> None:
    """Shadow ``__avg_scatter_grads`` on ``engine.optimizer`` (module docstring); raises
    :class:`UnsupportedError` naming what to change where it cannot."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    reason = unsupported_reason(engine, plugin)
    if reason is not None:
        raise UnsupportedError(f"robust_plugins.compression with ZeRO-3: {reason}.")
    _guard.check_signature("deepspeed", _nvtx_inner(getattr(DeepSpeedZeroOptimizer_Stage3, _METHOD)), _SIGNATURE,
                           f"deepspeed {_ranges.DEEPSPEED.spec}")
    opt = engine.optimizer
    original = getattr(opt, _METHOD)

    def avg_scatter_grads(params_to_reduce, communication_data_type):
        from deepspeed import comm as dist

        numel = sum(p.grad.numel() for p in params_to_reduce)
        key = plugin.sync.compress_key("ds.zero3", numel)
        if key is None:
            return original(params_to_reduce, communication_data_type)
        group = opt._get_param_partition_group(params_to_reduce[0])
        grads = [p.grad for p in params_to_reduce]
        if communication_data_type != opt.dtype:
            grads = [g.to(communication_data_type) for g in grads]
        if opt.postscale_gradients and opt.gradient_predivide_factor != 1.0:
            grads = [g.div(opt.gradient_predivide_factor) for g in grads]
        parts = compressed_reduce_scatter_coalesced(grads, group, plugin.sync, key)
        world = dist.get_world_size(group=group)
        if (opt.postscale_gradients and opt.gradient_predivide_factor != 1.0
                and opt.gradient_predivide_factor != world):
            parts = [g.mul(opt.gradient_predivide_factor) for g in parts]
        averaging = opt._gradient_averaging_world_size(params_to_reduce, world)
        if averaging != world:
            parts = [g.mul(world / float(averaging)) for g in parts]
        return [g.to(opt.gradient_accumulation_dtype) for g in parts]

    _guard.bind_instance(opt, _METHOD, avg_scatter_grads)


def _nvtx_inner(fn):
    # DeepSpeed decorates the method with utils.nvtx.instrument_w_nvtx, which keeps the function
    # in its closure without functools.wraps.
    for cell in getattr(fn, "__closure__", None) or ():
        if callable(cell.cell_contents) and getattr(cell.cell_contents, "__name__", "") == "__avg_scatter_grads":
            return cell.cell_contents
    return fn


def interleave(tensors: list, world: int) -> tuple[torch.Tensor, list[int]]:
    """DeepSpeed's reduce-scatter layout (pure): ``[rank 0: chunk 0 of each tensor | rank 1: ...]``,
    each chunk ``ceil(numel / world)`` long, zero-padded; in fp32. Returns it and the chunk sizes."""
    chunks = [math.ceil(t.numel() / world) for t in tensors]
    pieces = []
    for r in range(world):
        for t, c in zip(tensors, chunks):
            flat = t.reshape(-1)
            piece = flat[r * c: r * c + c]
            pieces.append(piece.float())
            if piece.numel() < c:
                pieces.append(torch.zeros(c - piece.numel(), dtype=torch.float32, device=t.device))
    return torch.cat(pieces), chunks


def compressed_reduce_scatter_coalesced(tensors: list, group, sync, key) -> list[torch.Tensor]:
    """``reduce_scatter_coalesced`` (divide by ``world``, sum, this rank's chunk of each tensor,
    unpadded) through the compressed reduce-scatter of ``sync`` (a
    :class:`~robust_plugins.comm.gradient_sync.GradientSync`: flat with a fixed codec, else its
    route); fp32 results in the tensors' dtype."""
    from deepspeed import comm as dist

    from robust_plugins.comm import compressed_reduce_scatter

    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    buffer, chunks = interleave(tensors, world)
    buffer.div_(world)
    shard = sum(chunks)
    out = buffer.narrow(0, rank * shard, shard)
    if sync.auto is None and not sync.hierarchical:
        compressed_reduce_scatter(out, buffer, group=group, state=sync.state, key=key)
    else:
        sync.reduce_scatter_sum(out, buffer, group, key)
    parts, offset = [], 0
    for t, c in zip(tensors, chunks):
        valid = max(0, min(c, t.numel() - rank * c))
        parts.append(out.narrow(0, offset, valid).to(t.dtype))
        offset += c
    return parts

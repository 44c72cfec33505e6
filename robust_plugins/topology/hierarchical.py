"""Hierarchical all-reduce and reduce-scatter: fp32 inside the node, compressed on the rail.

All-reduce: reduce-scatter in the node, compressed all-reduce on the rail, all-gather.

Only ``1 / ranks_per_node`` of the tensor crosses the slow inter-node link, and compressed: each
rank owns one shard after the intra-node reduce-scatter, all-reduces that shard with the ranks
holding the same shard on other nodes (its rail group) through
:func:`robust_plugins.comm.compressed_all_reduce`, and the intra-node all-gather hands every rank
the whole result. The intra-node steps are uncompressed fp32: the fast link does not need
compression and an fp32 sum of the node's contributions costs no accuracy.

Every rank ends with the same bits: each shard's final value comes from one rail all-reduce
(bitwise equal on its members) and is copied, not recomputed, by the all-gather.

Reduce-scatter (:func:`hierarchical_reduce_scatter`): the node's fp32 reduce-scatter leaves each
rank the node's sum of the shards its rail owns, and a compressed reduce-scatter on the rail hands
each rank its own shard; the result is laid out as the flat reduce-scatter's (rank ``r`` of the
group owns shard ``r``). Per rank, ``(nodes - 1) / world`` of the input crosses nodes instead of
``(world - ranks_per_node) / world``: ``ranks_per_node`` times fewer bytes.
"""

from __future__ import annotations

from typing import Hashable

import torch
import torch.distributed as dist

from robust_plugins._logging import get_logger, warn_once
from robust_plugins.comm.collectives import OPS, compressed_all_reduce, compressed_reduce_scatter
from robust_plugins.comm.state import CompressionState
from robust_plugins.errors import ConfigError, RobustPluginsError
from robust_plugins.topology.builder import TopologyGroups
from robust_plugins.topology.planner import reduce_scatter_order

_log = get_logger(__name__)


def hierarchical_all_reduce(
    tensor: torch.Tensor,
    groups: TopologyGroups,
    *,
    codec: str | None = None,
    op: str = "avg",
    state: CompressionState | None = None,
    key: Hashable | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Average or sum ``tensor`` over the planned ranks (all ranks, or one data-parallel group), in
    place, hierarchically; compressed across nodes.

    Args:
        tensor: contiguous float tensor, any shape; overwritten with the result in its dtype.
        groups: from :func:`robust_plugins.topology.build_groups`. If the layout was uneven
            (``groups.fallback_reason``) this warns once, naming the reason, and runs the flat
            :func:`~robust_plugins.comm.compressed_all_reduce` over ``groups.group`` (the
            data-parallel group the hierarchy was planned in; the default group for
            :func:`~robust_plugins.topology.build_groups`).
        codec, state, block_size: as for ``compressed_all_reduce``; they apply to the rail step.
        op: ``avg`` or ``sum`` (over all ranks).
        key: error-feedback key of this bucket; the rail step stores its residuals under
            ``("hierarchical", key)`` since this rank's shard, not the whole bucket, is compressed.

    A tensor whose size is not a multiple of the node size is padded with zeros for the
    reduce-scatter. With one node there is no rail step (nothing crosses a slow link).

    Returns:
        ``tensor``.
    """
    if op not in OPS:
        raise ConfigError(f"op = {op!r} is not supported; allowed: {', '.join(OPS)}.")
    if groups.plan is None:
        warn_once(
            _log, "hierarchical-fallback",
            "hierarchical all-reduce falls back to a FLAT compressed all-reduce: %s", groups.fallback_reason,
        )
        return compressed_all_reduce(tensor, codec=codec, group=groups.group, op=op, state=state, key=key,
                                     block_size=block_size)
    if not isinstance(tensor, torch.Tensor):
        raise RobustPluginsError(f"hierarchical_all_reduce needs a tensor, got {type(tensor).__name__}.")
    if not tensor.is_floating_point() or not tensor.is_contiguous():
        raise RobustPluginsError(
            f"hierarchical_all_reduce needs a contiguous float tensor; got {tensor.dtype}, "
            f"contiguous={tensor.is_contiguous()}. Pass tensor.contiguous() and copy the result back."
        )
    numel = tensor.numel()
    if numel == 0:
        return tensor
    per_node = len(groups.intra_ranks)
    shard_len = -(-numel // per_node)
    if tensor.dtype == torch.float32 and shard_len * per_node == numel:
        # Reduce-scatter from and all-gather into the tensor itself: a staging copy would cost two
        # passes over the bucket (~30 ms of 64 MB on the simulator's shared cores) for nothing.
        buf = tensor.view(-1)
    else:
        buf = torch.zeros(shard_len * per_node, dtype=torch.float32, device=tensor.device)
        buf[:numel].copy_(tensor.view(-1))
    shard = torch.empty(shard_len, dtype=torch.float32, device=tensor.device)
    if per_node > 1:
        dist.reduce_scatter_tensor(shard, buf, op=dist.ReduceOp.SUM, group=groups.intra)
    else:
        shard.copy_(buf)
    if len(groups.rail_ranks) > 1:
        rail_key = ("hierarchical", ("default", numel) if key is None else key)
        compressed_all_reduce(
            shard, codec=codec, group=groups.rail, op="sum", state=state, key=rail_key, block_size=block_size
        )
    if per_node > 1:
        dist.all_gather_into_tensor(buf, shard, group=groups.intra)
    else:
        buf.copy_(shard)
    if op == "avg":
        buf.div_(groups.plan.world_size)
    if buf.data_ptr() != tensor.data_ptr():
        tensor.view(-1).copy_(buf[:numel])
    return tensor


_ORDERS: dict = {}  # (plan, node ranks, group ranks, device) -> staging order on that device


def _staging_order(groups: TopologyGroups, world: int, device: torch.device) -> torch.Tensor:
    """:func:`~robust_plugins.topology.planner.reduce_scatter_order` as an index tensor on ``device``,
    made once per group and device: a host-to-device copy every bucket would synchronize the
    stream the reduction runs on."""
    group_ranks = tuple(dist.get_process_group_ranks(groups.group)) if groups.group is not None else tuple(range(world))
    key = (groups.plan, tuple(groups.intra_ranks), group_ranks, str(device))
    order = _ORDERS.get(key)
    if order is None:
        order = _ORDERS[key] = torch.tensor(reduce_scatter_order(groups.plan, groups.intra_ranks, group_ranks),
                                            device=device)
    return order


def hierarchical_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    groups: TopologyGroups,
    *,
    codec: str | None = None,
    op: str = "sum",
    state: CompressionState | None = None,
    key: Hashable | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """``reduce_scatter_tensor`` over the planned ranks, hierarchically: ``output`` = sum (or
    average) over the group of ``input``'s shard ``r``, ``r`` this rank's rank in the group.

    ``input`` is cut into ``world`` equal shards as by :func:`~robust_plugins.comm.compressed_reduce_scatter`
    (the flat one), ``world`` the size of the group the hierarchy was planned in (``groups.group``,
    the default group for :func:`~robust_plugins.topology.build_groups`). The shards are staged in
    the order of :func:`~robust_plugins.topology.planner.reduce_scatter_order` (a copy, so ``output``
    may be a view into ``input``), reduce-scattered in fp32 inside the node, and the node's sums
    reduce-scattered compressed on the rail (``codec``, ``state``, ``block_size`` as for the flat
    one; sender-side error feedback over the rail step's input under ``("hierarchical", key)``).

    With one node, or one rank per node, this is exactly the flat
    :func:`~robust_plugins.comm.compressed_reduce_scatter` over the group (same collective, same
    residual key ``key``). With an uneven layout (``groups.fallback_reason``) it warns once and
    runs that flat one too.

    Returns:
        ``output``.
    """
    if op not in OPS:
        raise ConfigError(f"op = {op!r} is not supported; allowed: {', '.join(OPS)}.")
    flat = groups.plan is None or len(groups.intra_ranks) == 1 or len(groups.rail_ranks) == 1
    if flat:
        if groups.plan is None:
            warn_once(_log, "hierarchical-rs-fallback",
                      "hierarchical reduce-scatter falls back to a FLAT compressed reduce-scatter: %s",
                      groups.fallback_reason)
        return compressed_reduce_scatter(output, input, codec=codec, group=groups.group, op=op, state=state,
                                         key=key, block_size=block_size)
    for name, t in (("input", input), ("output", output)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.is_contiguous():
            what = f"{t.dtype}, contiguous={t.is_contiguous()}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise RobustPluginsError(
                f"hierarchical_reduce_scatter needs a contiguous float {name}; got {what}. Pass "
                f"tensor.contiguous() and copy the result back.")
    world, shard = groups.plan.world_size, output.numel()
    if input.numel() != world * shard:
        raise RobustPluginsError(
            f"hierarchical_reduce_scatter: input has {input.numel()} elements, expected world size "
            f"{world} x output's {shard} = {world * shard}.")
    if shard == 0:
        return output
    order = _staging_order(groups, world, input.device)
    staged = input.view(world, shard).index_select(0, order).to(torch.float32).view(-1)
    nodes = len(groups.rail_ranks)
    node_sum = torch.empty(nodes * shard, dtype=torch.float32, device=input.device)
    dist.reduce_scatter_tensor(node_sum, staged, op=dist.ReduceOp.SUM, group=groups.intra)
    result = output if output.dtype == torch.float32 else torch.empty(shard, dtype=torch.float32,
                                                                        device=output.device)
    rail_key = ("hierarchical", ("default", input.numel()) if key is None else key)
    compressed_reduce_scatter(result.view(-1), node_sum, codec=codec, group=groups.rail, op="sum", state=state,
                              key=rail_key, block_size=block_size)
    if op == "avg":
        result.div_(world)
    if result is not output:
        output.view(-1).copy_(result.view(-1))
    return output

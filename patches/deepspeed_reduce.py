"""DeepSpeed: the gradient-reduction bindings (each keeps DeepSpeed's scaling and swaps only the collective).

``attach`` (``patches/deepspeed.py``) binds them on one engine instance; the table of what is
replaced at which ZeRO stage is in that module's docstring. ZeRO 0's planned, overlapped buckets
(``patches/deepspeed_overlap.py``) use the same scaling helpers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from robust_plugins.patches.deepspeed import DeepSpeedPlugin


def _scaling(average: bool, postscale: bool, predivide: float, world: float, full_world: int):
    """(pre, post) factors around the sum, exactly as DeepSpeed applies them for one bucket."""
    if not average:
        return 1.0, 1.0
    if postscale:
        return 1.0 / predivide, (predivide / world if predivide != full_world else 1.0)
    return 1.0 / world, 1.0


def _scaled(tensor, pre: float, post: float, reduce_sum):
    """DeepSpeed's pre-scale, ``reduce_sum(tensor)`` (in place) in place of its all-reduce, its post-scale."""
    if pre != 1.0:
        tensor.mul_(pre)
    reduce_sum(tensor)
    if post != 1.0:
        tensor.mul_(post)
    return tensor


def _scaled_sum(plugin: DeepSpeedPlugin, tensor, group, key: str, pre: float, post: float):
    """DeepSpeed's pre-scale, the compressed sum in place of its all-reduce, its post-scale."""
    return _scaled(tensor, pre, post, lambda t: plugin.sync.all_reduce_sum(t, group, key))


def _engine_allreduce_bucket(engine, plugin: DeepSpeedPlugin):
    original = engine.allreduce_bucket
    from deepspeed import comm as dist

    def allreduce_bucket(bucket, dp_group, dp_world_size=None):
        numel = sum(t.numel() for t in bucket)
        buckets = plugin.buckets
        if buckets is not None and buckets.host_reduces():  # codec auto handed the step back
            return buckets.host_allreduce_bucket(original, bucket, dp_group, dp_world_size)
        key = plugin.sync.compress_key("ds.engine", numel)
        if key is None:
            return original(bucket, dp_group, dp_world_size)
        tensor = engine.flatten(bucket)
        world = dp_world_size if dp_world_size is not None else dist.get_world_size(group=dp_group)
        pre, post = _scaling(engine.gradient_average, engine.postscale_gradients(),
                             engine.gradient_predivide_factor(), world, world)
        return _scaled_sum(plugin, tensor, dp_group, key, pre, post)

    return allreduce_bucket


def _zero_allreduce_bucket(opt, plugin: DeepSpeedPlugin):
    original = opt.allreduce_bucket
    from deepspeed import comm as dist

    def allreduce_bucket(bucket, communication_data_type, rank=None, log=None, divide=True, process_group=None):
        numel = sum(t.numel() for t in bucket)
        key = plugin.sync.compress_key("ds.zero" if rank is None else "ds.zero.reduce", numel)
        if key is None:
            return original(bucket, communication_data_type, rank=rank, log=log, divide=divide,
                            process_group=process_group)
        group = opt.dp_process_group if process_group is None else process_group
        tensor = opt.flatten(bucket)
        if divide and opt.gradient_average:
            tensor.div_(dist.get_world_size(group=group) / float(opt.sequence_parallel_size))
        if rank is None:
            plugin.sync.all_reduce_sum(tensor, group, key)
        else:
            plugin.sync.reduce_sum(tensor, rank, group, key)
        return tensor

    return allreduce_bucket


def _zero_predivide(opt, plugin: DeepSpeedPlugin):
    original = opt.gradient_reduction_w_predivide
    from deepspeed import comm as dist

    def gradient_reduction_w_predivide(tensor, communication_data_type):
        key = plugin.sync.compress_key("ds.zero_predivide", tensor.numel()) if tensor.numel() else None
        if key is None:
            return original(tensor, communication_data_type)
        group = opt.dp_process_group
        full_world = dist.get_world_size(group=group)
        pre, post = _scaling(opt.gradient_average, opt.postscale_gradients, opt.gradient_predivide_factor,
                             full_world / float(opt.sequence_parallel_size), full_world)
        return _scaled_sum(plugin, tensor, group, key, pre, post)

    return gradient_reduction_w_predivide

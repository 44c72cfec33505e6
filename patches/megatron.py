"""megatron-core integration: the only code that touches megatron-core's DDP internals.

megatron-core has no communication-hook API. Its ``DistributedDataParallel`` packs gradients into
contiguous buckets, grouped into ``_ParamAndGradBucketGroup`` objects
(``distributed/param_and_grad_buffer.py``), and every data-parallel gradient reduction goes
through one method of those groups:

``_ParamAndGradBucketGroup.start_grad_sync(force_all_reduce)``
    checks the local grads for NaN/Inf (``check_for_nan_in_grad``), multiplies each bucket by its
    ``gradient_scaling_factor`` (1/dp for averaging, MoE scaling), then per bucket either
    all-reduces ``bucket.grad_data`` or, with the distributed optimizer, reduce-scatters it into
    this rank's shard; with ``overlap_grad_reduce`` it stores an asynchronous handle in
    ``grad_reduce_handle`` that ``finish_grad_sync`` waits for.

:func:`enable` shadows ``start_grad_sync`` on each bucket group instance of one model
(``ddp.bucket_groups`` and ``ddp.expert_parallel_bucket_groups``); ``finish_grad_sync`` and the
backward hooks call it through the instance, so every reduction passes here. The replacement keeps
megatron's preamble (the same NaN/large-grad check, the same scaling) and its handle contract, and
swaps only the collective: an all-reduce becomes the plugin's two-phase compressed all-reduce, a
reduce-scatter becomes the one-phase compressed reduce-scatter
(:func:`robust_plugins.comm.compressed_reduce_scatter`) that writes the fp32 sum straight into the
local shard. A bucket group whose buckets all go uncompressed (codec ``none``, warm-up, below
``min_numel``) runs megatron's own method, bitwise identical to vanilla.

The compressed collectives are synchronous: with ``overlap_grad_reduce`` the sync runs when the
bucket group is dispatched (during backward, when its last gradient is ready, exactly where
megatron starts its asynchronous collective) and the stored handle's ``wait()`` returns at once.
Compute does not overlap the compressed communication; the semantics (who calls what, when the
grads are final) are megatron's.

Error-feedback residuals are keyed per bucket (``mcore.dense<g>.b<i>`` / ``mcore.expert<g>.b<i>``)
and are training state: :meth:`MegatronPlugin.state_dict` / :meth:`MegatronPlugin.load_state_dict`,
saved by :class:`robust_plugins.megatron.MegatronCheckpointer` beside the model.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from robust_plugins._logging import current_rank, get_logger
from robust_plugins.config import PluginConfig
from robust_plugins.errors import CheckpointError, ConfigError, RobustPluginsError, UnsupportedError
from robust_plugins.patches import _guard

log = get_logger(__name__)

SUPPORTED_MIN = (0, 16, 0)
SUPPORTED_BELOW = (0, 17, 0)
SUPPORTED = "megatron-core >=0.16.0,<0.17"

_GROUP_START_SIGNATURE = ["self", "force_all_reduce"]
_GROUP_FINISH_SIGNATURE = ["self", "force_all_reduce"]
_DDP_FINISH_SIGNATURE = ["self", "force_all_reduce"]

#: Format of :meth:`MegatronPlugin.state_dict`.
STATE_FORMAT = 1


def megatron_version() -> str:
    """The installed megatron-core version string."""
    from megatron.core import package_info

    return package_info.__version__


def check_megatron_version(installed: str | None = None) -> None:
    """Raise HostVersionError unless megatron-core's version and the patched signatures match."""
    _guard.check_version("megatron-core", megatron_version() if installed is None else installed,
                         SUPPORTED_MIN, SUPPORTED_BELOW)
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    _guard.check_signature("megatron-core", _ParamAndGradBucketGroup.start_grad_sync,
                           _GROUP_START_SIGNATURE, SUPPORTED)
    _guard.check_signature("megatron-core", _ParamAndGradBucketGroup.finish_grad_sync,
                           _GROUP_FINISH_SIGNATURE, SUPPORTED)
    _guard.check_signature("megatron-core", DistributedDataParallel.finish_grad_sync,
                           _DDP_FINISH_SIGNATURE, SUPPORTED)


def _as_plugin_config(config: Any) -> PluginConfig:
    if config is None:
        return PluginConfig()
    if isinstance(config, PluginConfig):
        return config
    if isinstance(config, Mapping):
        return PluginConfig.from_dict(config)
    raise ConfigError(
        f"robust_plugins.megatron.enable: config must be a PluginConfig, a dict holding the "
        f"robust_plugins block (e.g. {{'compression': {{'codec': 'int8'}}}}) or None; got "
        f"{type(config).__name__}."
    )


class _Completed:
    """The handle stored in ``grad_reduce_handle`` after a synchronous compressed sync."""

    def wait(self) -> None:
        """The sync already completed; nothing to wait for."""

    def is_completed(self) -> bool:
        """Always true."""
        return True


class MegatronPlugin:
    """Everything robust_plugins attached to one megatron-core DDP model (``ddp.robust_plugins``)."""

    def __init__(self, ddp, config: PluginConfig):
        from robust_plugins.comm.gradient_sync import GradientSync

        self.ddp = ddp
        self.config = config
        self.steps = 0
        """Completed gradient syncs (``ddp.finish_grad_sync`` calls): the step count that
        ``warmup_steps`` refers to and that keys reset on. Saved in :meth:`state_dict`."""
        self.sync = (GradientSync(config.compression, step_fn=lambda: self.steps)
                     if config.compression is not None else None)
        """Compressed gradient sync; None without the ``compression`` sub-block."""
        self.groups: list[tuple[str, Any]] = (
            [(f"dense{i}", g) for i, g in enumerate(ddp.bucket_groups)]
            + [(f"expert{i}", g) for i, g in enumerate(ddp.expert_parallel_bucket_groups)]
        )
        """(name, bucket group) pairs this plugin routes."""

    def describe(self) -> str:
        """One line: features, megatron-core version and the DDP variant."""
        c = self.ddp.ddp_config
        return (f"{self.config.describe()} | megatron-core {megatron_version()}, "
                f"use_distributed_optimizer={c.use_distributed_optimizer}, "
                f"overlap_grad_reduce={c.overlap_grad_reduce}, bucket groups "
                f"{len(self.ddp.bucket_groups)} dense + {len(self.ddp.expert_parallel_bucket_groups)} expert")

    def state_dict(self) -> dict:
        """Per-rank plugin state: step count and error-feedback residuals (plain tensors/ints)."""
        return {"format": STATE_FORMAT, "steps": self.steps,
                "sync": None if self.sync is None else self.sync.state_dict()}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; residuals must come from the same codec and block size."""
        if not isinstance(sd, Mapping) or sd.get("format") != STATE_FORMAT:
            got = sd.get("format") if isinstance(sd, Mapping) else type(sd).__name__
            raise CheckpointError(f"Unknown robust_plugins megatron state format {got!r}; expected "
                                  f"{STATE_FORMAT}.")
        if (sd["sync"] is None) != (self.sync is None):
            raise CheckpointError(
                "The checkpoint's robust_plugins state was saved "
                f"{'without' if sd['sync'] is None else 'with'} compression, but this job runs "
                f"{'with' if self.sync is not None else 'without'} it. Use the same compression "
                f"sub-block as the run that saved it."
            )
        self.steps = int(sd["steps"])
        if self.sync is not None:
            self.sync.load_state_dict(sd["sync"])


def enable(ddp, config: Any = None) -> MegatronPlugin:
    """Route ``ddp``'s gradient sync through robust_plugins (see the module docstring).

    Args:
        ddp: a ``megatron.core.distributed.DistributedDataParallel`` (one model chunk; call once
            per chunk).
        config: a :class:`~robust_plugins.config.PluginConfig`, the ``robust_plugins`` block as a
            dict (``{"compression": {"codec": "int8"}}``), or None (nothing is routed).

    Returns the :class:`MegatronPlugin` (also ``ddp.robust_plugins``). A second call on the same
    model returns the existing plugin if the config is equal, else raises ConfigError.
    ``ROBUST_DISABLE=1`` attaches nothing (the returned plugin carries an empty config).

    Raises:
        HostVersionError: megatron-core outside :data:`SUPPORTED` or changed signatures.
        UnsupportedError: a DDP variant the patch cannot serve (several distributed-optimizer
            instances, reduce-scatter with fp32 accumulation, Megatron-FSDP).
    """
    check_megatron_version()
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise ConfigError(
            f"robust_plugins.megatron.enable needs a megatron.core.distributed.DistributedDataParallel "
            f"model, got {type(ddp).__name__}. Wrap the model in megatron-core's DDP first (Megatron-"
            f"FSDP and torch DDP are not supported here; for torch DDP use robust_plugins.comm.ddp_comm_hook)."
        )
    cfg = _as_plugin_config(config)
    if os.environ.get("ROBUST_DISABLE", "0") not in ("", "0"):
        cfg = PluginConfig()
    existing = ddp.__dict__.get("robust_plugins")
    if existing is not None:
        if existing.config != cfg:
            raise ConfigError("robust_plugins.megatron.enable was already called on this model with "
                              f"another config ({existing.config.describe()}); call disable(ddp) first.")
        return existing
    if cfg.checkpoint is not None and (cfg.checkpoint.persist_every is not None):
        raise UnsupportedError(
            "robust_plugins.checkpoint.persist_every is for DeepSpeed engines; megatron-core loops "
            "save through robust_plugins.megatron.MegatronCheckpointer.save(step) (see README)."
        )
    _refuse_config(cfg)
    if cfg.compression is not None:
        _refuse(ddp)
    plugin = MegatronPlugin(ddp, cfg)
    ddp.robust_plugins = plugin
    _guard.bind_instance(ddp, "finish_grad_sync", _ddp_finish_grad_sync(ddp, plugin))
    if plugin.sync is not None:
        for name, group in plugin.groups:
            _guard.bind_instance(group, "start_grad_sync", _start_grad_sync(group, name, plugin))
    if current_rank() == 0:
        log.info("robust_plugins active: %s", plugin.describe())
    return plugin


def disable(ddp) -> None:
    """Undo :func:`enable` on ``ddp``: every method falls back to megatron-core's own."""
    plugin = ddp.__dict__.pop("robust_plugins", None)
    if plugin is None:
        return
    for _, group in plugin.groups:
        _guard.unbind_instance(group, "start_grad_sync")
    _guard.unbind_instance(ddp, "finish_grad_sync")


def _refuse_config(cfg: PluginConfig) -> None:
    """Sub-blocks (or settings) that this integration does not wire: refused, never ignored."""
    if cfg.compression is not None and cfg.compression.sign_mode == "momentum":
        raise UnsupportedError(
            "robust_plugins.megatron: compression.sign_mode = 'momentum' (1-bit Adam) is wired for DeepSpeed "
            "ZeRO 0 only; megatron-core's optimizer is not hooked. Use sign_mode 'gradient' (the default) here."
        )
    if cfg.compression is not None and cfg.compression.codec == "auto":
        raise UnsupportedError(
            "robust_plugins.megatron: compression.codec = 'auto' is not wired for megatron-core yet (it is "
            "for DeepSpeed). Use a fixed codec: none, bf16, int8, int4 or sign."
        )
    for name in ("topology", "telemetry"):
        if getattr(cfg, name, None) is not None:
            raise UnsupportedError(
                f"robust_plugins.megatron: the {name!r} sub-block is not wired for megatron-core yet (it is "
                f"for DeepSpeed). Remove it from the block passed to enable(); compression and checkpoint "
                f"(robust_plugins.megatron.MegatronCheckpointer) are supported."
            )


def _refuse(ddp) -> None:
    c = ddp.ddp_config
    if c.num_distributed_optimizer_instances != 1:
        raise UnsupportedError(
            f"robust_plugins compression: num_distributed_optimizer_instances = "
            f"{c.num_distributed_optimizer_instances} is not supported (the inter-instance all-reduce "
            f"runs on its own CUDA stream). Use 1, or remove the compression sub-block."
        )
    if c.reduce_scatter_with_fp32_accumulation:
        raise UnsupportedError(
            "robust_plugins compression: reduce_scatter_with_fp32_accumulation = True is not supported "
            "(the compressed reduce-scatter already sums in fp32). Set it to False, or remove the "
            "compression sub-block."
        )


def _ddp_finish_grad_sync(ddp, plugin: MegatronPlugin):
    original = ddp.finish_grad_sync

    def finish_grad_sync(force_all_reduce=False):
        original(force_all_reduce=force_all_reduce)
        plugin.steps += 1

    return finish_grad_sync


def _start_grad_sync(group, name: str, plugin: MegatronPlugin):
    """The replacement of one bucket group's ``start_grad_sync`` (see the module docstring)."""
    original = group.start_grad_sync
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from robust_plugins.comm import compressed_all_reduce, compressed_reduce_scatter

    cfg = group.ddp_config

    def start_grad_sync(force_all_reduce=False):
        if group.is_first_batch and group.grad_reduce_handle is not None:
            return  # megatron: already dispatched during the first batch
        keys = [plugin.sync.route(f"mcore.{name}.b{i}", b.grad_data.numel()) for i, b in enumerate(group.buckets)]
        if all(k is None for k in keys):
            return original(force_all_reduce=force_all_reduce)
        if group.grad_reduce_handle is not None:
            raise RobustPluginsError(
                f"megatron bucket group {name}: a gradient sync is already outstanding; megatron-core "
                f"allows one at a time (call finish_grad_sync before starting another)."
            )
        # megatron's preamble, unchanged: NaN/Inf/large check on the local grads, then scaling.
        if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
            group.check_grads(check_for_nan_or_inf=cfg.check_for_nan_in_grad,
                              check_for_large=cfg.check_for_large_grads)
        for bucket in group.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        op = "avg" if cfg.average_in_collective else "sum"
        reduce_op = torch.distributed.ReduceOp.AVG if cfg.average_in_collective else torch.distributed.ReduceOp.SUM
        scatter = cfg.use_distributed_optimizer and not force_all_reduce
        pg = group.intra_distributed_optimizer_instance_group if cfg.use_distributed_optimizer else group.data_parallel_group
        state = plugin.sync.state
        for idx, (bucket, key) in enumerate(zip(group.buckets, keys)):
            if scatter:
                if group.cached_grad_buffer_shard_list[idx] is None:
                    group.cached_grad_buffer_shard_list[idx] = shard_buffer(
                        bucket.grad_data, group.intra_distributed_optimizer_instance_size)
                local = group.cached_grad_buffer_shard_list[idx][group.intra_distributed_optimizer_instance_rank]
                if key is None:
                    torch.distributed.reduce_scatter_tensor(local, bucket.grad_data, op=reduce_op, group=pg)
                else:
                    compressed_reduce_scatter(local, bucket.grad_data, group=pg, op=op, state=state, key=key)
            elif key is None:
                torch.distributed.all_reduce(bucket.grad_data, op=reduce_op, group=pg)
            else:
                compressed_all_reduce(bucket.grad_data, group=pg, op=op, state=state, key=key)
        # megatron's handle contract: with overlap_grad_reduce, finish_grad_sync waits on a handle.
        group.grad_reduce_handle = _Completed() if cfg.overlap_grad_reduce else None

    return start_grad_sync

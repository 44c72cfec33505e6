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
local shard. With ``topology.hierarchical`` or ``codec: auto`` both go through
:class:`~robust_plugins.comm.gradient_sync.GradientSync`, which picks the codec and the route
(the reduce-scatter: :meth:`~robust_plugins.comm.gradient_sync.GradientSync.reduce_scatter_sum`,
node first in fp32, then compressed across nodes, in megatron's shard layout). A bucket group whose buckets all go uncompressed (codec ``none``, warm-up, below
``min_numel``) runs megatron's own method, bitwise identical to vanilla.

Mixture of experts: expert bucket groups reduce over the expert-data-parallel group (the group
megatron gives them), every route included: :meth:`GradientSync.prepare
<robust_plugins.comm.gradient_sync.GradientSync.prepare>` builds each group's own hierarchy at
:func:`enable` (dense first, then expert, on every rank), ``auto`` decides per group, and a group
of one rank runs megatron's own method (nothing sent or quantized). Layouts not served are
refused (:func:`refuse_moe`).

With ``overlap_grad_reduce`` the compressed sync overlaps backward as megatron's own does: when a
bucket group's last gradient is ready, its dispatch (on the training thread, inside backward) runs
megatron's preamble and hands the group's collectives to one background thread, and the handle
stored in ``grad_reduce_handle`` is completed by that thread; ``finish_grad_sync`` waits on it. The
thread runs the groups in dispatch order, one at a time, on its own clones of the data-parallel
process groups (made once at :func:`enable`, a collective; the thread, its handles and the clones
are :mod:`robust_plugins.comm.overlap`, shared with the DeepSpeed integration; on CUDA there is
no thread and no clone: the dispatch launches the reduction onto a side stream from the training
thread, which drives megatron's NCCL groups, so one host thread issues every collective): every rank dispatches the same groups in
the same order (megatron's backward hooks are deterministic), so every rank issues the same
sequence of collectives, and they never interleave with collectives the training thread issues on
megatron's groups. Every bucket group then goes through the thread, uncompressed ones (warm-up,
``min_numel``) as plain all-reduce / reduce-scatter, so there is one sequence. Codec ``none``
without ``topology.hierarchical`` keeps megatron's own asynchronous collectives (no thread).
Without ``overlap_grad_reduce`` the sync runs synchronously where megatron's does. Observers
(:attr:`MegatronPlugin.observers`) see ``dispatch`` / ``start`` / ``done`` / ``wait`` events.

With pipeline parallelism each model chunk is its own ``DistributedDataParallel`` (several a rank
with virtual pipeline stages): :func:`enable` is called once per chunk and routes that chunk's bucket
groups, so every data-parallel gradient reduction of every stage passes here, whether megatron
starts it in backward (``overlap_grad_reduce``) or in ``finalize_model_grads`` (each chunk's
``finish_grad_sync``). megatron keeps its other collectives: tensor-parallel reductions, pipeline
p2p, the embedding-group all-reduce of tied embeddings and the distributed optimizer's parameter
all-gather. Interleaved 1F1B with pipeline size 2 and ``batch_p2p_comm`` over gloo is refused
(:func:`_refuse_pipeline`).

Error-feedback residuals are keyed per bucket (``mcore.dense<g>.b<i>`` / ``mcore.expert<g>.b<i>``)
and are training state: :meth:`MegatronPlugin.state_dict` / :meth:`MegatronPlugin.load_state_dict`,
saved by :class:`robust_plugins.megatron.MegatronCheckpointer` beside the model.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from robust_plugins._logging import announce, get_logger
from robust_plugins.comm.overlap import Completed, SyncThread, clone_groups
from robust_plugins.config import PluginConfig
from robust_plugins.errors import CheckpointError, ConfigError, HostVersionError, RobustPluginsError, UnsupportedError
from robust_plugins.patches import _guard, _ranges, megatron_telemetry

log = get_logger(__name__)

RANGE = _ranges.MEGATRON
SUPPORTED = f"megatron-core {RANGE.spec}"

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
    RANGE.check(megatron_version() if installed is None else installed)
    try:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    except ImportError as exc:
        raise HostVersionError(f"megatron-core {megatron_version()}: {exc}; robust_plugins patches it. "
                               f"Supported: {SUPPORTED}.") from exc

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


class MegatronPlugin:
    """Everything robust_plugins attached to one megatron-core DDP model (``ddp.robust_plugins``)."""

    def __init__(self, ddp, config: PluginConfig):
        from robust_plugins.comm.gradient_sync import GradientSync

        self.ddp = ddp
        self.config = config
        self.steps = 0
        """Completed gradient syncs (``ddp.finish_grad_sync`` calls): the step count that
        ``warmup_steps`` refers to and that keys reset on. Saved in :meth:`state_dict`."""
        self.sync = (GradientSync(config.compression, step_fn=lambda: self.steps, topology=config.topology)
                     if config.compression is not None else None)
        """Compressed gradient sync; None without the ``compression`` sub-block."""
        self.groups: list[tuple[str, Any]] = (
            [(f"dense{i}", g) for i, g in enumerate(ddp.bucket_groups)]
            + [(f"expert{i}", g) for i, g in enumerate(ddp.expert_parallel_bucket_groups)]
        )
        """(name, bucket group) pairs this plugin routes."""
        self.observers: list = []
        """Callables ``fn(event, group_name)`` told of every overlapped sync: ``dispatch`` (training
        thread, inside backward), ``start`` and ``done`` (sync thread), ``wait`` (training thread,
        in ``finish_grad_sync``). For tests and tracing; they must not block for long."""
        self.thread: SyncThread | None = None
        """The sync thread (``overlap_grad_reduce`` with a compressing or hierarchical sync)."""
        self.clones: dict = {}
        """id(megatron process group) -> the sync thread's clone of it."""
        self.telemetry = None
        """The :class:`~robust_plugins.telemetry.recorder.Telemetry` recorder (``telemetry`` sub-block)."""
        self._grad_norm: float | None = None
        self._window = None

    def step_end(self, step: int, loss: Any = None, grad_norm: Any = None) -> None:
        """After optimizer step ``step`` on every rank: the ``robust run`` step signal
        (:func:`robust_plugins.watchdog.step_end`, a no-op outside it) and, with the ``telemetry``
        sub-block, the recorder's step (every ``log_every`` steps a small all-gather)."""
        from robust_plugins import watchdog

        watchdog.step_end(step, loss=loss, grad_norm=grad_norm)
        if self.telemetry is None and self.config.telemetry is not None:
            raise ConfigError("robust_plugins.megatron: the telemetry sub-block records once every model chunk of "
                              "this rank is enabled (virtual pipeline stages: call enable on each chunk, with the "
                              "same block); some chunks were not.")
        if self.telemetry is not None:
            if isinstance(loss, (int, float, torch.Tensor)):
                with self.telemetry.grad_window(torch.as_tensor(loss, dtype=torch.float32)):
                    pass  # the loss only: this window sends nothing
            self._grad_norm = None if grad_norm is None else float(grad_norm)
            self.telemetry.step_end(step)

    def _emit(self, event: str, name: str) -> None:
        for fn in list(self.observers):
            fn(event, name)

    @property
    def uses_thread(self) -> bool:
        """Whether overlapped syncs go through the sync thread (see the module docstring)."""
        return (self.sync is not None and self.ddp.ddp_config.overlap_grad_reduce
                and (self.sync.config.compresses or self.sync.hierarchical))

    def process_groups(self) -> list:
        """The distinct process groups the bucket groups reduce over, dense first (the
        data-parallel group, or the distributed optimizer's instance group) then expert (the
        expert-data-parallel group), in the same order on every rank."""
        return list({id(pg): pg for pg in (_group_pg(g) for _, g in self.groups)}.values())

    def _start_thread(self) -> None:
        """Clone the process groups the bucket groups reduce over and start the sync thread
        (collective: every rank calls it from :func:`enable`)."""
        self.clones = clone_groups(self.process_groups())
        device = self.groups[0][1].buckets[0].grad_data.device if self.groups else None
        self.thread = SyncThread("robust-mcore-grad-sync", "megatron bucket group", self._emit, device=device)

    def close(self) -> None:
        """Stop the sync thread (after the work already submitted) and close the telemetry recorder."""
        if self.thread is not None:
            self.thread.close()
            self.thread = None
        if self.telemetry is not None:
            self.telemetry.close()

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
            instances, reduce-scatter with fp32 accumulation, Megatron-FSDP), or interleaved
            pipeline size 2 with ``batch_p2p_comm`` over gloo (trains silently wrong there).
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
    _refuse_pipeline(ddp)
    refuse_moe(getattr(ddp, "config", None), "robust_plugins.megatron.enable")
    _refuse_config(cfg, ddp)
    if cfg.compression is not None:
        _refuse(ddp)
    plugin = MegatronPlugin(ddp, cfg)
    if plugin.sync is not None:
        # Build every group's node and rail groups now, on every rank (a collective, in the same
        # order everywhere: dense then expert groups), rather than at the first bucket, which may
        # run on the sync thread; each group's hierarchy is planned inside its own ranks.
        plugin.sync.prepare(plugin.process_groups())
    if plugin.uses_thread:
        plugin._start_thread()
    if cfg.telemetry is not None:
        _attach_telemetry(ddp, plugin)
    ddp.robust_plugins = plugin
    name_pipeline_stage()
    _guard.bind_instance(ddp, "finish_grad_sync", _ddp_finish_grad_sync(ddp, plugin))
    if plugin.sync is not None:
        for name, group in plugin.groups:
            _guard.bind_instance(group, "start_grad_sync", _start_grad_sync(group, name, plugin))
    announce(log, "robust_plugins active: %s", plugin.describe())  # rank 0, visible without logging set up
    return plugin


def disable(ddp) -> None:
    """Undo :func:`enable` on ``ddp``: every method falls back to megatron-core's own."""
    plugin = ddp.__dict__.pop("robust_plugins", None)
    if plugin is None:
        return
    plugin.close()
    for _, group in plugin.groups:
        _guard.unbind_instance(group, "start_grad_sync")
    _guard.unbind_instance(ddp, "finish_grad_sync")


def _refuse_pipeline(ddp) -> None:
    """Interleaved 1F1B with pipeline size 2 and ``batch_p2p_comm`` over gloo trains silently wrong
    (one ``batch_isend_irecv`` holds two sends to the same peer, which gloo matches in posting
    order, so the first chunk's gradients come out wrong): refused."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None or ps.get_pipeline_model_parallel_world_size() != 2:
        return
    config = getattr(ddp, "config", None)
    if getattr(config, "batch_p2p_comm", False) and dist.get_backend(ps.get_pipeline_model_parallel_group()) == "gloo":
        raise UnsupportedError(
            f"robust_plugins.megatron: interleaved pipeline (virtual_pipeline_model_parallel_size = {vpp}) with "
            f"pipeline_model_parallel_size = 2 and batch_p2p_comm = True trains silently wrong over gloo (two "
            f"sends to one peer in one batch are matched in posting order). Set batch_p2p_comm = False with "
            f"overlap_p2p_comm = True (Megatron-LM's default with virtual stages), or use NCCL.")


#: megatron token dispatchers served with mixture of experts (``flex`` needs DeepEP on CUDA and was never run).
MOE_DISPATCHERS = ("alltoall", "allgather")


def refuse_moe(config, where: str) -> None:
    """Mixture-of-experts layouts robust_plugins serves (``config``: the model's
    ``TransformerConfig``; nothing without ``num_moe_experts``): the alltoall or allgather token
    dispatcher, expert MLPs without grouped GEMM, no tensor or expert-tensor parallelism and no
    pipeline parallelism (the layouts the MoE tests run: EP 2 on 2 ranks, DP 2 x EP 2 on 4).
    Anything else raises UnsupportedError naming ``where``, the key, its value and what is allowed."""
    if config is None or not getattr(config, "num_moe_experts", None):
        return
    checks = (
        ("moe_token_dispatcher_type", getattr(config, "moe_token_dispatcher_type", "allgather"),
         lambda v: v in MOE_DISPATCHERS, f"one of {', '.join(MOE_DISPATCHERS)}"),
        ("moe_grouped_gemm", getattr(config, "moe_grouped_gemm", False), lambda v: not v,
         "False (the sequential expert MLPs)"),
        ("tensor_model_parallel_size", getattr(config, "tensor_model_parallel_size", 1), lambda v: v == 1,
         "1 with experts"),
        ("expert_tensor_parallel_size", getattr(config, "expert_tensor_parallel_size", 1),
         lambda v: v in (None, 1), "1"),
        ("pipeline_model_parallel_size", getattr(config, "pipeline_model_parallel_size", 1), lambda v: v == 1,
         "1 with experts"),
    )
    for key, value, ok, allowed in checks:
        if not ok(value):
            raise UnsupportedError(
                f"{where}: a mixture-of-experts model with {key} = {value!r} is not served by robust_plugins "
                f"(allowed: {allowed}; tested: expert parallelism with data parallelism, alltoall and allgather "
                f"dispatchers). Change {key}, or run without robust_plugins.")


def _refuse_config(cfg: PluginConfig, ddp) -> None:
    """Settings this integration cannot serve: refused, never ignored."""
    if cfg.compression is not None and cfg.compression.sign_mode == "momentum":
        raise UnsupportedError(
            "robust_plugins.megatron: compression.sign_mode = 'momentum' (1-bit Adam) is wired for DeepSpeed "
            "ZeRO 0 only; megatron-core's optimizer is not hooked. Use sign_mode 'gradient' (the default) here."
        )
    comp = cfg.compression
    if comp is not None and comp.overlap is not None and comp.overlap != ddp.ddp_config.overlap_grad_reduce:
        raise UnsupportedError(
            f"robust_plugins.megatron: compression.overlap = {comp.overlap} but megatron's "
            f"DistributedDataParallelConfig.overlap_grad_reduce = {ddp.ddp_config.overlap_grad_reduce}; the "
            f"compressed sync overlaps backward exactly when megatron's overlap_grad_reduce is set. Set that, and "
            f"leave compression.overlap unset (or equal to it)."
        )
    if comp is not None and comp.bucket_mb is not None:
        raise UnsupportedError(
            f"robust_plugins.megatron: compression.bucket_mb = {comp.bucket_mb:g} sizes DeepSpeed ZeRO 0's "
            f"buckets; megatron-core's buckets are DistributedDataParallelConfig.bucket_size. Remove bucket_mb."
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


def _attach_telemetry(ddp, plugin: MegatronPlugin) -> None:
    """Feed the telemetry recorder from this chunk (:mod:`robust_plugins.patches.megatron_telemetry`:
    one recorder per rank over every model chunk, virtual pipeline stages included)."""
    megatron_telemetry.attach(ddp, plugin)


def _ddp_finish_grad_sync(ddp, plugin: MegatronPlugin):
    original = ddp.finish_grad_sync

    def finish_grad_sync(force_all_reduce=False):
        original(force_all_reduce=force_all_reduce)
        plugin.steps += 1
        if plugin._window is not None:  # telemetry: the gradient window opened in backward ends here
            window, plugin._window = plugin._window, None
            window.__exit__(None, None, None)

    return finish_grad_sync


def _group_pg(group):
    """The process group a megatron bucket group reduces over (megatron's own choice in
    ``start_grad_sync``): for expert bucket groups, the expert-data-parallel group."""
    cfg = group.ddp_config
    return group.intra_distributed_optimizer_instance_group if cfg.use_distributed_optimizer else group.data_parallel_group


def _reduce_buckets(plugin: MegatronPlugin, buckets: list, keys: list, locals_: list, pg, op: str, reduce_op) -> None:
    """The collectives of one bucket group (training thread, or the sync thread with cloned ``pg``).

    ``locals_[i]`` is bucket i's local shard for the distributed optimizer's reduce-scatter, or None
    for an all-reduce. Keys are from :meth:`GradientSync.compress_key` (None: uncompressed).
    """
    import torch.distributed as dist

    from robust_plugins.comm import compressed_all_reduce, compressed_reduce_scatter

    sync = plugin.sync
    for bucket, key, local in zip(buckets, keys, locals_):
        if key is None or (sync.auto is None and not sync.hierarchical):  # else counted by GradientSync
            sync.stats.by_codec["none" if key is None else sync.config.codec] += bucket.grad_data.numel()
        if local is not None:
            if key is None:
                dist.reduce_scatter_tensor(local, bucket.grad_data, op=reduce_op, group=pg)
            elif sync.auto is None and not sync.hierarchical:
                compressed_reduce_scatter(local, bucket.grad_data, group=pg, op=op, state=sync.state, key=key)
            else:
                # codec auto / topology.hierarchical: GradientSync picks the codec and the route.
                sync.reduce_scatter_sum(local, bucket.grad_data, pg, key)
                if op == "avg":
                    local.div_(dist.get_world_size(pg))
        elif key is None:
            dist.all_reduce(bucket.grad_data, op=reduce_op, group=pg)
        elif sync.auto is None and not sync.hierarchical:
            compressed_all_reduce(bucket.grad_data, group=pg, op=op, state=sync.state, key=key)
        else:
            # codec auto / topology.hierarchical: GradientSync picks the codec and the route.
            sync.all_reduce_sum(bucket.grad_data, pg, key)
            if op == "avg":
                bucket.grad_data.div_(dist.get_world_size(pg))


def _start_grad_sync(group, name: str, plugin: MegatronPlugin):
    """The replacement of one bucket group's ``start_grad_sync`` (see the module docstring)."""
    original = group.start_grad_sync
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    cfg = group.ddp_config

    def start_grad_sync(force_all_reduce=False):
        if group.is_first_batch and group.grad_reduce_handle is not None:
            return  # megatron: already dispatched during the first batch
        pg = _group_pg(group)
        size = torch.distributed.get_world_size(pg)  # 1: megatron's own sync, which sends nothing
        keys = [plugin.sync.compress_key(f"mcore.{name}.b{i}", b.grad_data.numel(), size)
                for i, b in enumerate(group.buckets)]
        threaded = plugin.thread is not None and cfg.overlap_grad_reduce
        if not threaded and all(k is None for k in keys):
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
        locals_ = []
        for idx, bucket in enumerate(group.buckets):
            if not scatter:
                locals_.append(None)
                continue
            if group.cached_grad_buffer_shard_list[idx] is None:
                group.cached_grad_buffer_shard_list[idx] = shard_buffer(
                    bucket.grad_data, group.intra_distributed_optimizer_instance_size)
            locals_.append(group.cached_grad_buffer_shard_list[idx][group.intra_distributed_optimizer_instance_rank])
        buckets = list(group.buckets)
        if not threaded:
            _reduce_buckets(plugin, buckets, keys, locals_, pg, op, reduce_op)
            # megatron's handle contract: with overlap_grad_reduce, finish_grad_sync waits on a handle.
            group.grad_reduce_handle = Completed() if cfg.overlap_grad_reduce else None
            return
        clone = plugin.clones[id(pg)]

        def work():
            _reduce_buckets(plugin, buckets, keys, locals_, clone, op, reduce_op)

        plugin._emit("dispatch", name)
        # On a GPU the thread's stream waits for the kernels that produced these gradients (an
        # event recorded here, after megatron's scaling) and finish_grad_sync's stream for the
        # thread's: SyncThread's events, no host synchronize.
        tensors = [b.grad_data for b in buckets] + [t for t in locals_ if t is not None]
        group.grad_reduce_handle = plugin.thread.submit(name, work, tensors)

    return start_grad_sync


def name_pipeline_stage() -> None:
    """Name this rank's pipeline stage (``pp<rank>``) to ``robust run``'s straggler detector,
    which then compares the ranks of one stage only (stages do different work: the last computes
    the output layer and the loss). Nothing without pipeline parallelism, before megatron's
    groups exist, or outside ``robust run``."""
    from megatron.core import parallel_state as ps

    from robust_plugins import watchdog

    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        watchdog.straggler_group(f"pp{ps.get_pipeline_model_parallel_rank()}")


def destroy_parallel_state() -> list[str]:
    """Destroy megatron-core's model-parallel groups and drop every group its ``parallel_state``
    still holds; the names of the globals that megatron's own teardown left set.

    Why: ``torch.distributed.destroy_process_group()`` forgets the groups but not the objects,
    and a group object that outlives it is destroyed during interpreter shutdown, with its gloo
    threads still running: the rank then sometimes aborts after training finished
    (``terminate called without an active exception``, exit -6; seen in CI on a megatron recipe
    rank). megatron-core 0.16's ``destroy_model_parallel`` leaves
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its ``_GLOO`` twin set (3 gloo groups, 9
    threads alive at exit on 2 CPU ranks).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    left = sorted(name for name, value in vars(ps).items()
                  if name.isupper() and name.startswith("_") and isinstance(value, dist.ProcessGroup))
    for name in left:
        setattr(ps, name, None)
    return left

"""DeepSpeed integration: the only code that touches DeepSpeed internals.

``install()`` (run automatically by ``import robust_plugins`` once DeepSpeed is imported) wraps
``deepspeed.initialize``. The wrapper reads the ``"robust_plugins"`` block of the config; without
it (or with ``ROBUST_DISABLE=1``) it calls DeepSpeed unchanged. With it, it validates the block,
refuses engines it cannot serve, builds the engine, then shadows — on that engine instance only —
the methods that carry data-parallel gradient reductions (DeepSpeed 0.19,
``deepspeed/runtime/engine.py`` and ``runtime/zero/stage_1_and_2.py``):

==========  ============================================================================
ZeRO 0      ``DeepSpeedEngine.allreduce_bucket`` (all dense buckets, fp32 and bf16 via
            ``buffered_allreduce_fallback``); with a compressing codec or the hierarchy,
            ``buffered_allreduce_fallback`` itself: planned buckets, overlapped with
            backward (``compression.overlap``, ``patches/deepspeed_overlap.py``)
ZeRO 1, 2   ``DeepSpeedZeroOptimizer.allreduce_bucket`` (all-reduce, or reduce to one rank)
            and ``gradient_reduction_w_predivide`` (``reduce_scatter: false``)
==========  ============================================================================

Each replacement keeps DeepSpeed's scaling (``gradient_predivide_factor``,
``postscale_gradients``, ``gradient_average``, sequence-parallel world size) and swaps only the
collective. ``save_checkpoint`` / ``load_checkpoint`` are shadowed to store each rank's
error-feedback residuals beside DeepSpeed's files.

With the ``checkpoint`` sub-block, the same two methods also make every save verified and atomic
(``robust_plugins/checkpoint``): DeepSpeed is handed the tag ``.tmp-<tag>``, so its
``_save_checkpoint`` / ``_save_zero_checkpoint`` write every rank's files into that temporary
directory, with ``save_latest=False`` so it never writes ``latest`` itself. While it runs, the
engine's ``checkpoint_engine.save`` is shadowed to fsync each file and catch a failed write (so
that every rank still reaches DeepSpeed's closing barrier), and ``_copy_recovery_script`` to catch
rank 0's copy of ``zero_to_fp32.py``. Then each rank hashes its files, rank 0 writes the manifest,
renames the directory to ``<tag>`` and only then rewrites ``latest``. ``load_checkpoint`` with no
tag picks the newest checkpoint that verifies (rank 0 decides, every rank loads the same tag).

Loading runs no code from the files. DeepSpeed 0.19's ``TorchCheckpointEngine.load`` calls
``torch.load(weights_only=False)``; every file DeepSpeed reads for a ZeRO 0-2, non-MoE,
non-universal checkpoint goes through ``engine.checkpoint_engine.load`` (``SDLoaderFactory``
for model states, ``_get_all_zero_checkpoint_state_dicts`` for ZeRO shards, the optimizer file
for ZeRO 0), so during a load that method is shadowed with ``torch.load(weights_only=True)`` and an
allowlist of four inert DeepSpeed types its files hold (``SAFE_GLOBALS``). A resharded load
(another data-parallel size) converts with ``ds_to_universal`` and loads the result through
``patches/deepspeed_universal.py``, whose reads are made the same safe load. Engines whose loads
take other paths (MoE, universal checkpoints, other checkpoint engines) are refused.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import time
from typing import Any

import torch

from robust_plugins._logging import announce, current_rank, get_logger, warn_once
from robust_plugins.config import PluginConfig, load_json
from robust_plugins.checkpoint import DiskCheckpointer, rollback_bound
from robust_plugins.errors import CheckpointError, ConfigError, UnsupportedError
from robust_plugins.patches import _guard
from robust_plugins.patches import deepspeed_universal as _universal

log = get_logger(__name__)

SUPPORTED_MIN = (0, 19, 0)
SUPPORTED_BELOW = (0, 20, 0)
SUPPORTED = "deepspeed >=0.19.0,<0.20"

#: File each rank writes into ``<save_dir>/<tag>/`` next to DeepSpeed's own files.
STATE_FILE = "robust_plugins_rank{rank:05d}.pt"

_ENGINE_SIGNATURE = ["self", "bucket", "dp_group", "dp_world_size"]
_ZERO_ALLREDUCE_SIGNATURE = ["self", "bucket", "communication_data_type", "rank", "log", "divide", "process_group"]
_ZERO_PREDIVIDE_SIGNATURE = ["self", "tensor", "communication_data_type"]
_SAVE_SIGNATURE = ["self", "save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"]
_LOAD_SIGNATURE = [
    "self", "load_dir", "tag", "load_module_strict", "load_optimizer_states",
    "load_lr_scheduler_states", "load_module_only", "custom_load_fn",
]
_STEP_SIGNATURE = ["self", "lr_kwargs"]
_COPY_SCRIPT_SIGNATURE = ["self", "save_path"]
_CKPT_ENGINE_SAVE_SIGNATURE = ["self", "state_dict", "path"]
_CKPT_ENGINE_LOAD_SIGNATURE = ["self", "path", "map_location"]

#: The allowlist of every DeepSpeed checkpoint read (``patches/deepspeed_universal.py``).
SAFE_GLOBALS = _universal.SAFE_GLOBALS


# ---------------------------------------------------------------------------------------------
# install / undo
# ---------------------------------------------------------------------------------------------
def install() -> None:
    """Wrap ``deepspeed.initialize`` (idempotent). Raises HostVersionError on other versions."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if _guard.is_patched(deepspeed.initialize):
        return
    _guard.check_version("deepspeed", deepspeed.__version__, SUPPORTED_MIN, SUPPORTED_BELOW)
    _guard.check_signature("deepspeed", DeepSpeedEngine.allreduce_bucket, _ENGINE_SIGNATURE, SUPPORTED)
    _guard.check_signature("deepspeed", DeepSpeedZeroOptimizer.allreduce_bucket, _ZERO_ALLREDUCE_SIGNATURE, SUPPORTED)
    _guard.check_signature(
        "deepspeed", DeepSpeedZeroOptimizer.gradient_reduction_w_predivide, _ZERO_PREDIVIDE_SIGNATURE, SUPPORTED
    )
    _guard.check_signature("deepspeed", DeepSpeedEngine.save_checkpoint, _SAVE_SIGNATURE, SUPPORTED)
    _guard.check_signature("deepspeed", DeepSpeedEngine.load_checkpoint, _LOAD_SIGNATURE, SUPPORTED)
    _guard.check_signature("deepspeed", DeepSpeedEngine.step, _STEP_SIGNATURE, SUPPORTED)
    _guard.check_signature("deepspeed", DeepSpeedEngine._copy_recovery_script, _COPY_SCRIPT_SIGNATURE, SUPPORTED)
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    _guard.check_signature("deepspeed", TorchCheckpointEngine.save, _CKPT_ENGINE_SAVE_SIGNATURE, SUPPORTED)
    _guard.check_signature("deepspeed", TorchCheckpointEngine.load, _CKPT_ENGINE_LOAD_SIGNATURE, SUPPORTED)

    original = deepspeed.initialize
    signature = inspect.signature(original)

    def initialize(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        plugin_cfg = PluginConfig.from_ds_config(_find_ds_config(bound.arguments))
        if not plugin_cfg.active:
            return original(*args, **kwargs)
        _refuse_before_init(bound.arguments, plugin_cfg)
        result = original(*args, **kwargs)
        attach(result[0], plugin_cfg)
        return result

    deepspeed.initialize = _guard.wrap(original, initialize)
    log.debug("robust_plugins: replaced deepspeed.initialize (deepspeed %s)", deepspeed.__version__)


def undo() -> None:
    """Restore DeepSpeed's own ``initialize``. Engines already built keep their plugin."""
    import deepspeed

    if _guard.is_patched(deepspeed.initialize):
        deepspeed.initialize = deepspeed.initialize.__wrapped__


# ---------------------------------------------------------------------------------------------
# config discovery and refusals
# ---------------------------------------------------------------------------------------------
def _find_ds_config(arguments: dict[str, Any]) -> Any:
    """The config DeepSpeed will use: ``config``, ``config_params`` or ``args.deepspeed_config``."""
    for name in ("config", "config_params"):
        if arguments.get(name) is not None:
            cfg = arguments[name]
            return _read_config_file(cfg) if isinstance(cfg, (str, os.PathLike)) else cfg
    args = arguments.get("args")
    path = getattr(args, "deepspeed_config", None) if args is not None else None
    return _read_config_file(path) if path else None


def _read_config_file(path: str | os.PathLike) -> dict[str, Any] | None:
    try:
        return load_json(path)
    except ConfigError:
        # DeepSpeed also accepts HJSON; parse it the way DeepSpeed does before giving up.
        try:
            import hjson

            with open(path) as f:
                return json.loads(json.dumps(hjson.load(f)))
        except Exception:
            raise ConfigError(f"Cannot parse the DeepSpeed config {path} as JSON or HJSON.") from None


def _features(plugin_cfg: PluginConfig) -> str:
    """``compression``, ``checkpoint`` or ``compression and checkpoint``: for refusal messages."""
    names = [n for n in ("compression", "checkpoint") if getattr(plugin_cfg, n) is not None]
    return " and ".join(names)


def _refuse_before_init(arguments: dict[str, Any], plugin_cfg: PluginConfig) -> None:
    """Cheap refusals that need no engine: fail before DeepSpeed spends time building one."""
    cfg = _find_ds_config(arguments) or {}
    what = _features(plugin_cfg)
    if not what:  # telemetry alone observes the engine and changes nothing it could refuse
        return
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise UnsupportedError(
            f"robust_plugins.{what} supports ZeRO stages 0, 1 and 2; this config sets "
            f"zero_optimization.stage = {stage!r}. Use stage 0-2 or remove the "
            f"'{what}' sub-block."
        )
    model = arguments.get("model")
    if model is not None and type(model).__name__ == "PipelineModule":
        raise UnsupportedError(
            f"robust_plugins.{what} does not support DeepSpeed pipeline engines "
            f"(PipelineModule); remove the '{what}' sub-block or train without pipeline parallelism."
        )


def _refuse_engine(engine) -> None:
    """Refusals that need the built engine (the config alone does not say)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        raise UnsupportedError(
            "robust_plugins.compression does not support DeepSpeed's PipelineEngine; remove the "
            "'compression' sub-block or train without pipeline parallelism."
        )
    stage = engine.zero_optimization_stage()
    if stage not in (0, 1, 2):
        raise UnsupportedError(f"robust_plugins.compression supports ZeRO stages 0-2, not stage {stage}.")
    if not engine.enable_backward_allreduce:
        raise UnsupportedError(
            f"The optimizer {type(engine.optimizer).__name__} communicates gradients itself "
            f"(DeepSpeed turned the engine's all-reduce off, as 1-bit Adam / 0/1 Adam do), so "
            f"robust_plugins.compression would never run. Remove one of the two."
        )
    if getattr(engine, "zenflow", False) or engine.is_deepcompile_active():
        raise UnsupportedError(
            "robust_plugins.compression does not support ZenFlow or DeepCompile engines, which "
            "reduce gradients on their own paths."
        )
    if stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if not isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
            raise UnsupportedError(
                f"ZeRO stage {stage} built a {type(engine.optimizer).__name__}, not the "
                f"DeepSpeedZeroOptimizer robust_plugins hooks into; remove the 'compression' sub-block."
            )


def _refuse_checkpoint_engine(engine) -> None:
    """Engines whose checkpoint files take paths the verified save/load does not cover."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    remove = "Remove the 'checkpoint' sub-block to use DeepSpeed's own checkpoints."
    if isinstance(engine, PipelineEngine):
        raise UnsupportedError(f"robust_plugins.checkpoint does not support DeepSpeed's PipelineEngine. {remove}")
    stage = engine.zero_optimization_stage()
    if stage not in (0, 1, 2):
        raise UnsupportedError(f"robust_plugins.checkpoint supports ZeRO stages 0-2, not stage {stage}. {remove}")
    refusals = (
        (engine.has_moe_layers, "MoE engines (expert files are loaded outside the checkpoint engine)"),
        (engine.load_universal_checkpoint(), "universal checkpoints (checkpoint.load_universal)"),
        (engine.use_node_local_storage(), "node-local storage (rank 0 must see every rank's files)"),
        (engine.zero_nvme_offload_optimizer(), "NVMe optimizer offload (its files are copied with copytree)"),
        (type(engine.checkpoint_engine) is not TorchCheckpointEngine,
         f"the {type(engine.checkpoint_engine).__name__} checkpoint engine (only TorchCheckpointEngine)"),
    )
    for refused, what in refusals:
        if refused:
            raise UnsupportedError(f"robust_plugins.checkpoint does not support {what}. {remove}")


# ---------------------------------------------------------------------------------------------
# attaching to one engine
# ---------------------------------------------------------------------------------------------
class DeepSpeedPlugin:
    """Everything robust_plugins attached to one engine; reachable as ``engine.robust_plugins``."""

    def __init__(self, engine, config: PluginConfig):
        from robust_plugins.comm.gradient_sync import GradientSync

        self.engine = engine
        self.config = config
        momentum = config.compression is not None and config.compression.sign_mode == "momentum"
        self.sync = (GradientSync(config.compression, step_fn=lambda: engine.global_steps, topology=config.topology)
                     if config.compression is not None and not momentum else None)
        """Compressed gradient sync; None without the ``compression`` sub-block (or in 1-bit Adam mode)."""
        self.onebit = None
        """1-bit Adam (``sign_mode: momentum``, ``patches/deepspeed_onebit.py``); or None."""
        self.disk: DiskCheckpointer | None = None
        """Verified, atomic checkpoints; None without the ``checkpoint`` sub-block."""
        if config.checkpoint is not None:
            import deepspeed
            from deepspeed import comm as dist

            self.disk = DiskCheckpointer(
                config.checkpoint, rank=dist.get_rank(), world_size=dist.get_world_size(),
                layout={"zero_stage": engine.zero_optimization_stage(), "dp_world_size": engine.dp_world_size,
                        "train_batch_size": engine.train_batch_size(),
                        "gradient_accumulation_steps": engine.gradient_accumulation_steps()},
                versions={"deepspeed": deepspeed.__version__, "torch": torch.__version__},
                device=engine.device,
            )
            # Elastic restart: a checkpoint of another data-parallel size is selected and then
            # resharded (or refused with the reason) by _load_checkpoint, not skipped.
            self.disk.reshardable = ("world_size", "dp_world_size", "train_batch_size",
                                     "gradient_accumulation_steps")
        self.telemetry = None
        """Per-step metrics (``telemetry`` sub-block, ``patches/deepspeed_telemetry.py``); or None."""
        self.persisted_at: int | None = None
        """Step of the last automatic save (``checkpoint.persist_every``)."""
        self.memory = None
        """In-memory snapshots (``checkpoint.memory_every``, ``patches/deepspeed_memory.py``); or None."""
        self.watchdog = None
        """Step signals to ``robust run`` (``patches/deepspeed_watchdog.py``); None outside it."""
        self.buckets = None
        """ZeRO 0's planned gradient buckets, overlapped with backward (``compression.overlap``,
        ``patches/deepspeed_overlap.py``); None where DeepSpeed's own buckets stay."""
        self.resumed: tuple | None = None
        """``(load_path, client_state)`` of the load ``checkpoint.resume`` (on by default under
        ``robust run``) made in ``deepspeed.initialize`` (``patches/deepspeed_resume.py``); None
        without it."""

    @property
    def has_state(self) -> bool:
        """True when this plugin holds training state (error-feedback residuals) to checkpoint."""
        return self.sync is not None or self.onebit is not None

    def state_dict(self) -> dict:
        """Per-rank plugin state saved next to DeepSpeed's checkpoint files."""
        if self.onebit is not None:
            return {"format": 1, "onebit": self.onebit.state_dict()}
        return {"format": 1, "sync": self.sync.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        if sd.get("format") != 1:
            raise CheckpointError(f"Unknown robust_plugins checkpoint format {sd.get('format')!r}; expected 1.")
        if ("onebit" in sd) != (self.onebit is not None):
            raise CheckpointError(
                f"the checkpoint's plugin state was written {'with' if 'onebit' in sd else 'without'} "
                f"compression.sign_mode = 'momentum' and this job runs {'with' if self.onebit else 'without'} it; "
                f"resume with the checkpoint's compression settings."
            )
        if self.onebit is not None:
            self.onebit.load_state_dict(sd["onebit"])
            return
        self.sync.load_state_dict(sd["sync"])


def attach(engine, config: PluginConfig) -> DeepSpeedPlugin:
    """Attach the configured features to a built engine; logs one line on rank 0."""
    if config.compression is not None:
        _refuse_engine(engine)
    if config.checkpoint is not None:
        _refuse_checkpoint_engine(engine)
    plugin = DeepSpeedPlugin(engine, config)
    engine.robust_plugins = plugin
    if config.checkpoint is not None and config.checkpoint.memory_every is not None:
        from robust_plugins.patches.deepspeed_memory import MemorySnapshots

        plugin.memory = MemorySnapshots(engine, plugin)
    stage = engine.zero_optimization_stage()
    # With the checkpoint sub-block alone, gradient reduction stays DeepSpeed's own, untouched.
    if config.compression is not None and config.compression.sign_mode == "momentum":
        from robust_plugins.patches.deepspeed_onebit import attach_onebit

        attach_onebit(engine, plugin)  # gradients stay DeepSpeed's until the freeze, then the momentum goes 1-bit
    elif config.compression is not None and stage == 0:
        from robust_plugins.patches.deepspeed_overlap import attach_buckets

        _guard.bind_instance(engine, "allreduce_bucket", _engine_allreduce_bucket(engine, plugin))
        plugin.buckets = attach_buckets(engine, plugin)  # a collective with overlap
    elif config.compression is not None:
        if config.compression.overlap:
            from robust_plugins.patches.deepspeed_overlap import unsupported_reason

            raise UnsupportedError(f"robust_plugins.compression.overlap = true: {unsupported_reason(engine)}. "
                                   f"Set overlap to false (or leave it unset).")
        if config.compression.bucket_mb is not None:
            raise UnsupportedError(f"robust_plugins.compression.bucket_mb sizes ZeRO stage 0's buckets; at stage "
                                   f"{stage} DeepSpeed's zero_optimization.reduce_bucket_size does. Remove bucket_mb.")
        opt = engine.optimizer
        _guard.bind_instance(opt, "allreduce_bucket", _zero_allreduce_bucket(opt, plugin))
        _guard.bind_instance(opt, "gradient_reduction_w_predivide", _zero_predivide(opt, plugin))
    _guard.bind_instance(engine, "save_checkpoint", _save_checkpoint(engine, plugin))
    _guard.bind_instance(engine, "load_checkpoint", _load_checkpoint(engine, plugin))
    if config.checkpoint is not None and config.checkpoint.persist_every:
        _guard.bind_instance(engine, "step", _step_with_persist(engine, plugin))
    if plugin.memory is not None:
        add_step_observer(engine, plugin.memory.on_step)
    if config.telemetry is not None:
        from robust_plugins.patches import deepspeed_telemetry

        deepspeed_telemetry.attach_telemetry(engine, plugin)
        add_step_observer(engine, deepspeed_telemetry.on_step)
    # Under robust run, with any sub-block: the engine reports its steps (no step_end in the
    # script). Last, because it wraps engine.backward around telemetry's.
    from robust_plugins.patches import deepspeed_watchdog

    deepspeed_watchdog.attach_watchdog(engine, plugin)
    from robust_plugins.patches import deepspeed_emergency

    deepspeed_emergency.attach_emergency(engine, plugin)  # checkpoint.emergency_save, under robust run

    comm_dtype = engine.communication_data_type
    if (config.compression is not None and config.compression.compresses
            and comm_dtype not in (torch.float32, engine.get_data_types()[0])):
        warn_once(
            log, "comm_dtype",
            "robust_plugins: communication_data_type=%s is superseded by codec %s for compressed "
            "buckets (uncompressed ones still use it).", comm_dtype, config.compression.codec,
        )
    # Printed on rank 0 the way DeepSpeed prints the lines it means to be seen (its logger is at
    # WARNING, so an INFO record would not show under the HF Trainer or a plain script).
    announce(log, "robust_plugins active: %s | DeepSpeed %s, ZeRO stage %d, dp_world_size %d, grads %s",
             config.describe(), _ds_version(), stage, engine.dp_world_size, engine.get_data_types()[0])
    if "transformers.trainer" in sys.modules:
        from robust_plugins.patches import transformers_trainer

        # Before the resume: a restore hands the Trainer building this engine its loop's state.
        transformers_trainer.bind_engine(engine, plugin)
    # Last: the load goes through every wrapper bound above (memory, verified disk, watchdog).
    from robust_plugins.patches import deepspeed_resume

    deepspeed_resume.resume_at_init(engine, plugin)
    return plugin


def add_step_observer(engine, observer, first: bool = False) -> None:
    """Call ``observer(engine)`` after every ``engine.step()`` that completed an optimizer step
    (``global_steps`` moved: at a gradient-accumulation boundary), in registration order
    (``first=True``: before those already registered; the watchdog's step signal uses it so that
    the other observers can read its numbers with ``deepspeed_watchdog.latest_step``).

    The first registration shadows ``engine.step`` on this instance, around whatever is there
    (DeepSpeed's method or another robust_plugins wrapper such as ``persist_every``'s); adding the
    same observer twice is a no-op. ``detach`` removes it with the other shadows.
    """
    observers = engine.__dict__.get("_robust_step_observers")
    if observers is None:
        observers = engine._robust_step_observers = []
        inner = engine.step

        def step(lr_kwargs=None):
            before = engine.global_steps
            result = inner(lr_kwargs)
            if engine.global_steps != before:
                for fn in list(observers):
                    fn(engine)
            return result

        # Installed once per engine (the list above is the guard), around whatever is bound
        # now, persist_every's wrapper included, so observers see the step after its save.
        engine.step = _guard.wrap(inner, step)
    if observer not in observers:
        observers.insert(0, observer) if first else observers.append(observer)


def detach(engine) -> None:
    """Remove the plugin from ``engine``: its methods fall back to DeepSpeed's."""
    from robust_plugins.patches.deepspeed_onebit import detach_onebit
    from robust_plugins.patches.deepspeed_overlap import detach_buckets

    detach_onebit(engine)
    detach_buckets(engine)
    for obj, name in ((engine, "allreduce_bucket"), (engine.optimizer, "allreduce_bucket"),
                      (engine.optimizer, "gradient_reduction_w_predivide"),
                      (engine, "save_checkpoint"), (engine, "load_checkpoint"), (engine, "step"),
                      (engine, "backward")):
        if obj is not None:
            _guard.unbind_instance(obj, name)
    engine.__dict__.pop("robust_plugins", None)
    engine.__dict__.pop("_robust_step_observers", None)


def _ds_version() -> str:
    import deepspeed

    return deepspeed.__version__


# ---------------------------------------------------------------------------------------------
# the replacements (each keeps DeepSpeed's scaling and swaps only the collective)
# ---------------------------------------------------------------------------------------------
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
        key = plugin.sync.route("ds.engine", numel)
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
        key = plugin.sync.route("ds.zero" if rank is None else "ds.zero.reduce", numel)
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
        key = plugin.sync.route("ds.zero_predivide", tensor.numel()) if tensor.numel() else None
        if key is None:
            return original(tensor, communication_data_type)
        group = opt.dp_process_group
        full_world = dist.get_world_size(group=group)
        pre, post = _scaling(opt.gradient_average, opt.postscale_gradients, opt.gradient_predivide_factor,
                             full_world / float(opt.sequence_parallel_size), full_world)
        return _scaled_sum(plugin, tensor, group, key, pre, post)

    return gradient_reduction_w_predivide


# ---------------------------------------------------------------------------------------------
# checkpoints: residuals are training state
# ---------------------------------------------------------------------------------------------
#: Key added to a DeepSpeed client_state (with memory snapshots) listing the caller's own keys.
CLIENT_KEYS = "robust_plugins_client_keys"


def _state_path(ckpt_dir: str, tag: str) -> str:
    return os.path.join(ckpt_dir, str(tag), STATE_FILE.format(rank=current_rank()))


def _save_checkpoint(engine, plugin: DeepSpeedPlugin):
    original = engine.save_checkpoint

    def save_checkpoint(save_dir=None, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        if tag is None:
            tag = f"global_step{engine.global_steps}"  # DeepSpeed's own default tag
        if plugin.memory is not None:
            plugin.memory.note_client_state(client_state)
            # Which keys are the caller's: a disk load returns them mixed with DeepSpeed's own, and
            # the snapshots taken after it must carry only the caller's (as from memory).
            client_state = {**(client_state or {}), CLIENT_KEYS: sorted(client_state or {})}
        if plugin.disk is not None:
            return _verified_save(engine, plugin, original, _checkpoint_dir(plugin, save_dir, "save_checkpoint"),
                                  str(tag), client_state, save_latest, exclude_frozen_parameters)
        if plugin.has_state:
            path = _state_path(save_dir, tag)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # Written before DeepSpeed's files so that DeepSpeed's `latest` (written last) never
            # points at a checkpoint whose residuals are missing; tmp + rename keeps it atomic.
            tmp = f"{path}.tmp"
            torch.save(plugin.state_dict(), tmp)
            os.replace(tmp, path)
        return original(save_dir, tag, client_state=client_state, save_latest=save_latest,
                        exclude_frozen_parameters=exclude_frozen_parameters)

    return save_checkpoint


def _checkpoint_dir(plugin: DeepSpeedPlugin, given, method: str) -> str:
    """The directory argument, or ``checkpoint.dir`` when the caller passed none."""
    if given:
        return os.fspath(given)
    if plugin.config.checkpoint.dir is None:
        raise CheckpointError(
            f"engine.{method}() was called without a directory and robust_plugins.checkpoint.dir is "
            f"not set: pass the directory or set checkpoint.dir in the config."
        )
    return plugin.config.checkpoint.dir


def _verified_save(engine, plugin, original, save_dir, tag, client_state, save_latest, exclude_frozen):
    """One atomic, hashed save (module docstring): DeepSpeed writes into ``.tmp-<tag>``."""
    disk = plugin.disk
    staging = disk.begin(save_dir, tag)
    ckpt_engine = engine.checkpoint_engine
    write, copy_scripts = ckpt_engine.save, engine._copy_recovery_script

    def save(state_dict, path):
        if disk.failed:  # this rank's save is lost already: do not fill the disk further
            return
        try:
            write(state_dict, path)
            disk.record(path)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by disk.finish
            disk.fail(exc, path)

    def copy_recovery_script(save_path):
        try:
            copy_scripts(save_path)
        except OSError as exc:
            disk.fail(exc)

    ckpt_engine.save = save
    engine._copy_recovery_script = copy_recovery_script
    try:
        # DeepSpeed's tag-consistency check and barriers run as usual, on the temporary name.
        original(save_dir, os.path.basename(staging), client_state=client_state, save_latest=False,
                 exclude_frozen_parameters=exclude_frozen)
        if plugin.has_state:
            save(plugin.state_dict(), os.path.join(staging, STATE_FILE.format(rank=current_rank())))
    except Exception as exc:
        # Raised outside the two shadowed writes: the other ranks may be waiting in one of
        # DeepSpeed's barriers, bounded only by the process-group timeout.
        raise CheckpointError(
            f"Checkpoint save of {tag!r} into {save_dir} failed inside DeepSpeed on rank {current_rank()} "
            f"({type(exc).__name__}: {exc}); nothing was committed, {staging} is left for the next save "
            f"to remove."
        ) from exc
    finally:
        del ckpt_engine.save
        del engine._copy_recovery_script
    disk.finish(save_dir, tag, engine.global_steps, save_latest)
    return True


@contextlib.contextmanager
def _weights_only_loads(engine):
    """Route DeepSpeed's loads through ``torch.load(weights_only=True)`` for one load_checkpoint."""
    ckpt_engine = engine.checkpoint_engine
    ckpt_engine.load = _universal.safe_load
    try:
        yield
    finally:
        del ckpt_engine.load


def _load_checkpoint(engine, plugin: DeepSpeedPlugin):
    original = engine.load_checkpoint

    def load_checkpoint(load_dir=None, tag=None, *args, **kwargs):
        t0 = time.perf_counter()
        reshard = None
        # After a rollback (robust run), nothing newer than its last good step may load, from
        # memory or disk: a disk save of a later step can exist (ok_to_save timed out under load).
        bound = rollback_bound() if tag is None else None
        if plugin.memory is not None and tag is None:
            # Restore order: own memory snapshot -> a peer's copy -> newest verified disk -> older.
            if not load_dir and plugin.config.checkpoint.dir is None:
                found = plugin.memory.restore(disk_step=None)
                return ((f"memory://step{found[0]}/{found[1]}", plugin.memory.restored_client_state())
                        if found else (None, None))
            load_dir = _checkpoint_dir(plugin, load_dir, "load_checkpoint")
            found = plugin.memory.restore(disk_step=_newest_disk_step(load_dir, bound))
            if found is not None:
                # No path on disk: the string says the step and where the state came from.
                return f"memory://step{found[0]}/{found[1]}", plugin.memory.restored_client_state()
        if plugin.disk is not None:
            load_dir = _checkpoint_dir(plugin, load_dir, "load_checkpoint")
            tag = plugin.disk.select(load_dir, tag, max_step=bound)
            if tag is None:
                return None, None  # an empty directory: a fresh start, as DeepSpeed reports it
            from robust_plugins.checkpoint.persist import is_snapshot_checkpoint

            reshard = _plan_reshard(engine, load_dir, tag)
            if is_snapshot_checkpoint(load_dir, tag):
                # Written by the background saver (memory_every + persist_every): no DeepSpeed files.
                if reshard is not None:
                    raise CheckpointError(
                        f"{load_dir}/{tag} was written by robust_plugins' background saver at another "
                        f"data-parallel size ({reshard.message}); those per-rank snapshots cannot be "
                        f"resharded. Resume at the saved size, or reshard from a checkpoint written by "
                        f"engine.save_checkpoint (DeepSpeed format).")
                if plugin.memory is None:
                    raise CheckpointError(
                        f"{load_dir}/{tag} was written by robust_plugins' background saver "
                        f"(checkpoint.memory_every with persist_every); loading it needs memory_every "
                        f"in this job's checkpoint block too.")
                plugin.memory.load_from_disk(load_dir, tag)
                from robust_plugins.patches.deepspeed_memory import record_restore

                record_restore(engine.global_steps, f"disk:{tag}", time.perf_counter() - t0)
                return os.path.join(load_dir, tag), plugin.memory.restored_client_state()
            if reshard is None:
                with _weights_only_loads(engine):
                    load_path, client_state = original(load_dir, tag, *args, **kwargs)
            else:
                load_path, client_state = _load_resharded(engine, plugin, original, load_dir, tag, reshard,
                                                          args, kwargs)
            if load_path is None:
                raise CheckpointError(
                    f"DeepSpeed found no model files in the verified checkpoint {load_dir}/{tag}; "
                    f"it was saved by another kind of engine (e.g. other model parallelism)."
                )
        else:
            load_path, client_state = original(load_dir, tag, *args, **kwargs)
            if load_path is None:
                return load_path, client_state
            if tag is None:
                latest = "latest_universal" if engine.load_universal_checkpoint() else "latest"
                with open(os.path.join(load_dir, latest)) as f:
                    tag = f.read().strip()
        if isinstance(client_state, dict) and CLIENT_KEYS in client_state:
            client_state = dict(client_state)
            keys = client_state.pop(CLIENT_KEYS)
            if plugin.memory is not None:
                plugin.memory.client_state = {"step": engine.global_steps,
                                              "state": {k: client_state[k] for k in keys if k in client_state}}
        if plugin.has_state:
            if plugin.disk is not None and reshard is not None:
                # Residuals are each rank's error of its own share of the old partition: no rank of
                # the new layout owns them.
                log.warning("robust_plugins: compression residuals start from zero after resharding "
                            "(they belong to the old data-parallel layout)")
            else:
                _load_residuals(plugin, load_dir, tag)
        if plugin.memory is not None:
            from robust_plugins.patches.deepspeed_memory import record_restore

            plugin.memory.taken_at = engine.global_steps
            record_restore(engine.global_steps, f"disk:{tag}", time.perf_counter() - t0)
        return load_path, client_state

    return load_checkpoint


def _plan_reshard(engine, load_dir: str, tag: str):
    """The elastic plan for a selected checkpoint (``checkpoint/elastic.py``), or None."""
    from robust_plugins.checkpoint import manifest as mf
    from robust_plugins.checkpoint.elastic import plan_reshard
    from deepspeed import comm as dist

    m = mf.read_manifest(os.path.join(load_dir, tag))
    saved = {"where": f"checkpoint {os.path.join(load_dir, tag)}", "world_size": m.world_size, **m.layout}
    now = {"world_size": dist.get_world_size(), "dp_world_size": engine.dp_world_size,
           "zero_stage": engine.zero_optimization_stage(), "micro_batch": engine.train_micro_batch_size_per_gpu()}
    return plan_reshard(saved, now)


def _load_resharded(engine, plugin, original, load_dir: str, tag: str, reshard, args, kwargs):
    """Load a checkpoint of another data-parallel size and keep its global batch.

    ZeRO 0 (``direct``): model and optimizer state are replicated and live in the one
    ``mp_rank_00_model_states.pt``, which DeepSpeed loads at any DP size. ZeRO 1/2 (``universal``):
    rank 0 converts the verified checkpoint with DeepSpeed's ``ds_to_universal`` into
    ``<dir>/.universal/<tag>`` (every file the converter reads, and every converted file the
    load reads, goes through ``torch.load(weights_only=True)``), every rank loads it with DeepSpeed's
    ``load_universal`` path, then the converted copy is removed.
    """
    from robust_plugins.checkpoint import coord
    from robust_plugins.checkpoint.elastic import DIRECT

    if engine.global_rank == 0:
        log.warning("robust_plugins: %s", reshard.message)
    timeout_s = plugin.config.checkpoint.timeout_s
    if reshard.method == DIRECT:
        with _weights_only_loads(engine):
            load_path, client_state = original(load_dir, tag, *args, **kwargs)
    else:
        univ_root = os.path.join(load_dir, ".universal")
        result = {}
        if engine.global_rank == 0:
            try:
                _convert_to_universal(os.path.join(load_dir, tag), univ_root, tag, timeout_s)
            except CheckpointError as exc:
                result = {"error": str(exc)}
        result = coord.broadcast_json(result, timeout_s, f"resharding {load_dir}/{tag}: converting",
                                      device=engine.device)
        if result.get("error"):
            raise CheckpointError(result["error"])
        engine._config.load_universal_checkpoint = True
        try:
            with _weights_only_loads(engine), _universal.safe_universal_loads():
                load_path, client_state = original(univ_root, tag, *args, **kwargs)
        finally:
            engine._config.load_universal_checkpoint = False
            coord.broadcast_json({}, timeout_s, f"resharding {load_dir}/{tag}: loaded", device=engine.device)
            if engine.global_rank == 0:
                import shutil

                shutil.rmtree(univ_root, ignore_errors=True)
        if load_path is not None:  # name the verified checkpoint, not the removed converted copy
            load_path = os.path.join(load_dir, tag, os.path.relpath(load_path, os.path.join(univ_root, tag)))
    engine.set_train_batch_size(reshard.train_batch_size)
    return load_path, client_state


def _convert_to_universal(src: str, univ_root: str, tag: str, timeout_s: float) -> None:
    """Run DeepSpeed's converter on a verified checkpoint directory: a bounded child process in
    which every ``torch.load`` is ``weights_only=True`` with the allowlist (``deepspeed_universal``)."""
    import shutil
    import subprocess
    import sys

    out = os.path.join(univ_root, tag)
    shutil.rmtree(univ_root, ignore_errors=True)
    cmd = [sys.executable, "-m", _universal.__name__, "--input_folder", src,
           "--output_folder", out, "--num_extract_workers", "1", "--num_merge_workers", "1",
           # Plain DeepSpeed engines do not write Megatron-DeepSpeed's universal_checkpoint_info.
           "--inject_missing_state"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(univ_root, ignore_errors=True)
        raise CheckpointError(f"Converting {src} to a universal checkpoint took over {timeout_s:.0f} s "
                              f"(checkpoint.timeout_s); it was stopped and nothing was loaded.") from exc
    if proc.returncode != 0:
        shutil.rmtree(univ_root, ignore_errors=True)
        refused = [ln for ln in proc.stderr.splitlines() if ln.startswith("robust_plugins: ")]
        if refused:
            raise CheckpointError(f"{refused[-1][len('robust_plugins: '):]} Nothing was converted or loaded.")
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise CheckpointError(f"DeepSpeed's ds_to_universal failed on {src} (exit {proc.returncode}: {tail}); "
                              f"nothing was loaded. Resume at the saved data-parallel size instead.")


def _newest_disk_step(root: str, max_step: int | None = None) -> int | None:
    """Step of the newest committed checkpoint in ``root`` (manifest only, not verified), not
    after ``max_step``."""
    from robust_plugins.checkpoint import scan

    steps = [e.manifest.step for e in scan(root)
             if e.manifest is not None and (max_step is None or e.manifest.step <= max_step)]
    return max(steps, default=None)


def _load_residuals(plugin: DeepSpeedPlugin, load_dir: str, tag: str) -> None:
    path = _state_path(load_dir, tag)
    if not os.path.isfile(path):
        warn_once(
            log, f"missing:{path}",
            "robust_plugins: checkpoint %s/%s has no plugin state for rank %d (%s missing: "
            "saved without the plugin or at another world size). Error-feedback residuals "
            "start from zero; the run continues, but not bitwise as an uninterrupted one.",
            load_dir, tag, current_rank(), os.path.basename(path),
        )
        return
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"robust_plugins state {path} cannot be read ({exc}); it is corrupt or truncated. "
            f"Load an older checkpoint tag or delete the file to restart residuals from zero."
        ) from exc
    plugin.load_state_dict(sd)


def _step_with_persist(engine, plugin: DeepSpeedPlugin):
    original = engine.step
    every = plugin.config.checkpoint.persist_every

    def step(lr_kwargs=None):
        result = original(lr_kwargs)
        # global_steps moves only at gradient-accumulation boundaries; save once per such step.
        # With memory snapshots the snapshot thread writes these saves in the background.
        n = engine.global_steps
        background = plugin.memory is not None and plugin.memory.persister is not None
        if every and not background and n % every == 0 and n != plugin.persisted_at:
            plugin.persisted_at = n
            engine.save_checkpoint(plugin.config.checkpoint.dir)
        return result

    return step

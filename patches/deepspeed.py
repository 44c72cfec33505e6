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
ZeRO 3      ``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads``: the reduce-scatter
            (``patches/deepspeed_zero3_reduce.py``)
pipeline    ZeRO 0 / 1 as above, over each stage's data-parallel group
==========  ============================================================================

Each replacement keeps DeepSpeed's scaling (``gradient_predivide_factor``,
``postscale_gradients``, ``gradient_average``, sequence-parallel world size) and swaps only the
collective (``patches/deepspeed_reduce.py``). ``save_checkpoint`` / ``load_checkpoint`` are
shadowed to store each rank's error-feedback residuals beside DeepSpeed's files, and with the
``checkpoint`` sub-block to make every save verified and atomic and every load safe
(``patches/deepspeed_checkpoint.py``). Configs and engines the plugin cannot serve are refused
first (``patches/deepspeed_refuse.py``). This module is the installer: ``install`` / ``undo``,
``attach`` / ``detach`` and the per-engine :class:`DeepSpeedPlugin`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import torch

from robust_plugins._logging import announce, get_logger, warn_once
from robust_plugins.config import BLOCK_KEY, PluginConfig
from robust_plugins.checkpoint import DiskCheckpointer
from robust_plugins.errors import CheckpointError, ConfigError, HostVersionError, UnsupportedError
from robust_plugins.patches import _guard, _ranges
from robust_plugins.watchdog.client import final_refusals
from robust_plugins.patches import deepspeed_universal as _universal
from robust_plugins.patches import deepspeed_wire, torch_jit_lock
from robust_plugins.patches.deepspeed_checkpoint import (  # noqa: F401  (CLIENT_KEYS, STATE_FILE re-exported)
    CLIENT_KEYS,
    STATE_FILE,
    _load_checkpoint,
    _persist_observer,
    _save_checkpoint,
    _step_with_persist,
)
from robust_plugins.patches.deepspeed_reduce import _engine_allreduce_bucket, _zero_allreduce_bucket, _zero_predivide
from robust_plugins.patches.deepspeed_refuse import (
    _find_ds_config,
    _refuse_before_init,
    _refuse_checkpoint_engine,
    _refuse_engine,
)

log = get_logger(__name__)

RANGE = _ranges.DEEPSPEED
SUPPORTED = f"deepspeed {RANGE.spec}"

_ENGINE_SIGNATURE = ["self", "bucket", "dp_group", "dp_world_size"]
_ZERO_ALLREDUCE_SIGNATURE = ["self", "bucket", "communication_data_type", "rank", "log", "divide", "process_group"]
_ZERO_PREDIVIDE_SIGNATURE = ["self", "tensor", "communication_data_type"]
_SAVE_SIGNATURE = ["self", "save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"]
_LOAD_SIGNATURE = [
    "self", "load_dir", "tag", "load_module_strict", "load_optimizer_states",
    "load_lr_scheduler_states", "load_module_only", "custom_load_fn",
]
_STEP_SIGNATURE = ["self", "lr_kwargs"]
_TRAIN_BATCH_SIGNATURE = ["self", "data_iter"]
_COPY_SCRIPT_SIGNATURE = ["self", "save_path"]
_CKPT_ENGINE_SAVE_SIGNATURE = ["self", "state_dict", "path"]
_CKPT_ENGINE_LOAD_SIGNATURE = ["self", "path", "map_location"]

#: The allowlist of every DeepSpeed checkpoint read (``patches/deepspeed_universal.py``).
SAFE_GLOBALS = _universal.SAFE_GLOBALS


# ---------------------------------------------------------------------------------------------
# install / undo
# ---------------------------------------------------------------------------------------------
def host_problem() -> Exception | None:
    """Why the installed DeepSpeed cannot be patched (a :class:`HostVersionError` naming the
    version and the range, or a changed signature), or None."""
    import deepspeed

    try:
        RANGE.check(deepspeed.__version__)
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        for target, expected in (
                (DeepSpeedEngine.allreduce_bucket, _ENGINE_SIGNATURE),
                (DeepSpeedZeroOptimizer.allreduce_bucket, _ZERO_ALLREDUCE_SIGNATURE),
                (DeepSpeedZeroOptimizer.gradient_reduction_w_predivide, _ZERO_PREDIVIDE_SIGNATURE),
                (DeepSpeedEngine.save_checkpoint, _SAVE_SIGNATURE), (DeepSpeedEngine.load_checkpoint, _LOAD_SIGNATURE),
                (DeepSpeedEngine.step, _STEP_SIGNATURE), (DeepSpeedEngine._copy_recovery_script, _COPY_SCRIPT_SIGNATURE),
                (TorchCheckpointEngine.save, _CKPT_ENGINE_SAVE_SIGNATURE),
                (TorchCheckpointEngine.load, _CKPT_ENGINE_LOAD_SIGNATURE)):
            _guard.check_signature("deepspeed", target, expected, SUPPORTED)
    except HostVersionError as exc:
        return exc
    except (ImportError, AttributeError) as exc:  # a module or method the patch replaces moved
        return HostVersionError(f"deepspeed {deepspeed.__version__}: {exc}; robust_plugins replaces it. "
                                f"Supported: {SUPPORTED}.")
    return None


def install() -> None:
    """Wrap ``deepspeed.initialize`` (idempotent). On a DeepSpeed this patch does not support
    (:func:`host_problem`), one warning says so and the wrapper refuses only configs with the
    block (:func:`_refusing_initialize`); without the block DeepSpeed runs unchanged."""
    import deepspeed

    if _guard.is_patched(deepspeed.initialize):
        return
    problem = host_problem()
    if problem is not None:
        _guard.host_off("deepspeed", problem, "the robust_plugins block of deepspeed.initialize's config (a config "
                        "with it is refused); configs without it run on DeepSpeed unchanged.")
        deepspeed.initialize = _guard.wrap(deepspeed.initialize, _refusing_initialize(deepspeed.initialize, problem))
        return
    # DeepSpeed JIT-loads ops under torch's build lock, which a rank killed during start-up
    # would leave behind for every later job: this lock names its holder (torch_jit_lock.py).
    torch_jit_lock.install()
    deepspeed_wire.install()
    original = deepspeed.initialize
    signature = inspect.signature(original)

    def initialize(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        plugin_cfg = PluginConfig.from_ds_config(_find_ds_config(bound.arguments))
        if not plugin_cfg.active:
            return original(*args, **kwargs)
        with final_refusals():  # under robust run a refusal ends the job instead of a restart
            _refuse_before_init(bound.arguments, plugin_cfg)
            result = original(*args, **kwargs)
            attach(result[0], plugin_cfg)
        return result

    deepspeed.initialize = _guard.wrap(original, initialize)
    log.debug("robust_plugins: replaced deepspeed.initialize (deepspeed %s)", deepspeed.__version__)


def _refusing_initialize(original, problem: Exception):
    """``deepspeed.initialize`` on an unsupported DeepSpeed: a config with an active block raises
    ``problem``'s message (the block would be ignored otherwise); any other runs unchanged."""
    signature = inspect.signature(original)

    def initialize(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        if _asks_for_plugin(_find_ds_config(bound.arguments)):
            with final_refusals():
                raise HostVersionError(f"deepspeed.initialize with a robust_plugins block: {problem}")
        return original(*args, **kwargs)

    return initialize


def _asks_for_plugin(ds_config: Any) -> bool:
    """The config has a block that turns a feature on (a malformed block asks too)."""
    if not isinstance(ds_config, Mapping) or not ds_config.get(BLOCK_KEY):
        return False
    try:
        return PluginConfig.from_ds_config(ds_config).active
    except ConfigError:
        return True


def undo() -> None:
    """Restore DeepSpeed's own ``initialize``. Engines already built keep their plugin."""
    import deepspeed

    if _guard.is_patched(deepspeed.initialize):
        deepspeed.initialize = deepspeed.initialize.__wrapped__
    torch_jit_lock.undo()


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
        _refuse_engine(engine, config)
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
    elif config.compression is not None and stage == 3:
        from robust_plugins.patches.deepspeed_zero3_reduce import attach_zero3_reduce

        attach_zero3_reduce(engine, plugin)  # the reduce-scatter, compressed with error feedback
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
        if engine.pipeline_parallelism:  # its step() is never called: saved after train_batch
            add_step_observer(engine, _persist_observer(plugin))
        else:
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
    if "accelerate" in sys.modules:
        from robust_plugins.patches import accelerate as accelerate_guard

        accelerate_guard.bind_engine(engine, plugin)  # an Accelerate loop's own reason, if any
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
    (DeepSpeed's method or another robust_plugins wrapper such as ``persist_every``'s), or a
    pipeline engine's ``train_batch``; adding the same observer twice is a no-op. ``detach``
    removes it with the other shadows.
    """
    observers = engine.__dict__.get("_robust_step_observers")
    if observers is None:
        observers = engine._robust_step_observers = []
        if engine.pipeline_parallelism:
            _observe_train_batch(engine, observers)
        else:
            _observe_step(engine, observers)
    if observer not in observers:
        observers.insert(0, observer) if first else observers.append(observer)


def _observe_step(engine, observers: list) -> None:
    inner = engine.step

    def step(lr_kwargs=None):
        before = engine.global_steps
        result = inner(lr_kwargs)
        if engine.global_steps != before:
            for fn in list(observers):
                fn(engine)
        return result

    # Installed once per engine (the observer list is the guard), around whatever is bound now,
    # persist_every's wrapper included, so observers see the step after its save.
    engine.step = _guard.wrap(inner, step)


def _observe_train_batch(engine, observers: list) -> None:
    """``PipelineEngine`` steps its optimizer inside ``train_batch`` (``_exec_optimizer_step``)
    and its ``step()`` raises: its observers run after each ``train_batch`` that moved
    ``global_steps``, on every stage (the batch's loss is then known on every stage too)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    _guard.check_signature("deepspeed", PipelineEngine.train_batch, _TRAIN_BATCH_SIGNATURE, SUPPORTED)
    inner = engine.train_batch

    def train_batch(data_iter=None):
        before = engine.global_steps
        result = inner(data_iter)
        if engine.global_steps != before:
            for fn in list(observers):
                fn(engine)
        return result

    engine.train_batch = _guard.wrap(inner, train_batch)


def detach(engine) -> None:
    """Remove the plugin from ``engine``: its methods fall back to DeepSpeed's."""
    from robust_plugins.patches.deepspeed_onebit import detach_onebit
    from robust_plugins.patches.deepspeed_overlap import detach_buckets

    detach_onebit(engine)
    detach_buckets(engine)
    for obj, name in ((engine, "allreduce_bucket"), (engine.optimizer, "allreduce_bucket"),
                      (engine.optimizer, "gradient_reduction_w_predivide"),
                      (engine.optimizer, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"),
                      (engine, "save_checkpoint"), (engine, "load_checkpoint"), (engine, "step"),
                      (engine, "backward"), (engine, "forward"), (engine, "train_batch"),
                      (engine, "_take_model_step"), (engine, "allreduce_gradients"),
                      (engine, "_bf16_reduce_grads")):
        if obj is not None:
            _guard.unbind_instance(obj, name)
    engine.__dict__.pop("robust_plugins", None)
    engine.__dict__.pop("_robust_step_observers", None)


def _ds_version() -> str:
    import deepspeed

    return deepspeed.__version__

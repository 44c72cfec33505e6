"""Megatron-LM's own loop (``megatron.training.pretrain``) with the robust_plugins block, by import.

``pretrain_gpt.py`` binds ``pretrain`` by name, so the hooks rebind what ``pretrain`` calls: the
module globals of ``megatron/training/training.py`` (Megatron-LM ``core_v0.16.1``):

* ``get_model``: after Megatron-LM wraps each model chunk in megatron-core's DDP,
  :func:`robust_plugins.patches.megatron.enable` on every chunk (compression on every dense and
  expert bucket group, telemetry, the active line on rank 0).
* ``load_checkpoint`` (runs with ``--load``): with ``checkpoint.memory_every`` the in-memory
  snapshot (own, then a peer's copy; :class:`~robust_plugins.patches.megatron_memory.MegatronMemory`)
  is restored before Megatron-LM touches its disk checkpoint, when it is newer than that one;
  otherwise Megatron-LM loads from disk and the plugin's per-rank state is read back from beside it.
* ``train_step``: after each step the snapshot (``memory_every``), then the step signal with the
  loss and gradient norm (``robust run``'s NaN/spike rollback and hang detection; the SDC replica
  checks of the snapshots) and telemetry.
* ``save_checkpoint``: after Megatron-LM's own save (``--save``), this rank's plugin state
  (error-feedback residuals, sync count) as ``robust_plugins_rank<r>.pt`` in the iteration folder.
* ``megatron.core.datasets.utils.compile_helpers``: skipped when the installed megatron-core's
  prebuilt ``helpers_cpp`` imports (the wheel ships it; ``make`` would fail in its folder).

Refused, naming the flag (:func:`ft_refusal`): Megatron-LM's own fault tolerance
(``--enable-ft-package``) and local checkpoints (``--non-persistent-ckpt-type local``), which
would restart and restore the same job a second way.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from robust_plugins._logging import get_logger
from robust_plugins.config import PluginConfig
from robust_plugins.errors import ConfigError, UnsupportedError
from robust_plugins.patches import _guard

log = get_logger(__name__)

STATE_FILE = "robust_plugins_rank{rank:05d}.pt"
"""Per-rank plugin state written into Megatron-LM's iteration folder on ``--save``."""

_TRAIN_STEP = ["forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler", "config",
               "forward_backward_func", "iteration"]
_GET_MODEL = ["model_provider_func", "model_type", "wrap_with_ddp", "config", "pg_collection"]
_installed: list[tuple[object, str, object]] = []


def ft_refusal(flags: Any) -> str | None:
    """Why the hooks cannot run beside ``flags`` (a Megatron-LM args namespace or a dict with
    ``enable_ft_package`` and ``non_persistent_ckpt_type``); None when they can."""
    get = flags.get if isinstance(flags, Mapping) else (lambda k, d=None: getattr(flags, k, d))
    if get("enable_ft_package", False):
        return ("robust_plugins.megatron_lm: --enable-ft-package (Megatron-LM's fault tolerance, "
                "nvidia_resiliency_ext) is on; robust run's watchdog and restarts do that job here and the two "
                "would restart the same ranks twice. Remove --enable-ft-package, or run without robust_plugins.")
    if get("non_persistent_ckpt_type", None) == "local":
        return ("robust_plugins.megatron_lm: --non-persistent-ckpt-type local (nvidia_resiliency_ext's local "
                "checkpoints) is on; checkpoint.memory_every snapshots with peer_backup do that job here. Remove "
                "the flag (allowed: global, or none), or run without robust_plugins.")
    return None


#: ``checkpoint`` keys served under Megatron-LM (its own ``--save``/``--load`` do the disk part).
CHECKPOINT_KEYS = ("memory_every", "peer_backup", "verify_replicas", "memory_copy", "timeout_s")


def checkpoint_refusal(config: PluginConfig) -> str | None:
    """Why ``config``'s ``checkpoint`` sub-block cannot serve Megatron-LM's loop (a key set that
    only robust_plugins' own disk checkpoints read); None when it can."""
    if config.checkpoint is None:
        return None
    extra = sorted(set(config.checkpoint.model_fields_set) - set(CHECKPOINT_KEYS))
    if not extra:
        return None
    return (f"robust_plugins.megatron_lm: checkpoint.{', checkpoint.'.join(extra)} is not used under Megatron-LM, "
            f"which writes and picks its own disk checkpoints (--save, --save-interval, --load); remove "
            f"{'it' if len(extra) == 1 else 'them'}. Allowed here: {', '.join(CHECKPOINT_KEYS)}.")


def installed_megatron_core() -> str:
    """The installed megatron-core's version (imported before the checkout joins ``sys.path``)."""
    from robust_plugins.patches.megatron import megatron_version

    return megatron_version()


def cuda_available() -> bool:
    """Whether the Megatron-LM CPU redirects must stay off."""
    return torch.cuda.is_available()


class _Run:
    """The Megatron-LM run in this process: its block, plugins and snapshots."""

    def __init__(self, config: PluginConfig):
        self.config = config
        self.chunks: list = []
        self.plugins: list = []
        self.memory = None
        self.scheduler = None
        self.flops = 0.0
        self._after: dict[str, Any] = {}
        self.rng_at_restore: tuple | None = None
        """RNG states right after a restore (memory or disk), set again before the first step: Megatron-LM
        builds its data iterators after ``load_checkpoint``, and each ``DataLoader`` iterator draws
        its base seed from the global torch generator (one draw that the uninterrupted run made
        before step 1), so the dropout masks of the next step would differ."""

    # ---------------------------------------------------------------- megatron state of a step
    def _loop_state(self) -> dict:
        return dict(self._after)

    def _set_loop_state(self, value: dict) -> None:
        from megatron.core.num_microbatches_calculator import update_num_microbatches
        from megatron.training.global_vars import get_args

        args = get_args()
        args.consumed_train_samples = int(value["consumed_train_samples"])
        args.skipped_train_samples = int(value["skipped_train_samples"])
        args.consumed_valid_samples = int(value["consumed_valid_samples"])
        update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
        if self.scheduler is not None and value["scheduler"] is not None:
            self.scheduler.load_state_dict(value["scheduler"])
        self.flops = float(value["flops"])


_run: _Run | None = None


def _chunks(model) -> list:
    """Megatron-LM's model (a list of chunks, or one module) as a list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _enable_chunks(original):
    def get_model(model_provider_func, model_type=None, wrap_with_ddp=True, config=None, pg_collection=None):
        from megatron.core.distributed import DistributedDataParallel
        from megatron.training.global_vars import get_args

        from robust_plugins.patches.megatron import enable

        kwargs = {} if model_type is None else {"model_type": model_type}
        model = original(model_provider_func, wrap_with_ddp=wrap_with_ddp, config=config,
                         pg_collection=pg_collection, **kwargs)
        if not wrap_with_ddp:
            return model
        args = get_args()
        why = ft_refusal(args)
        if why is not None:
            raise ConfigError(why)
        chunks = _chunks(model)
        for chunk in chunks:
            if not isinstance(chunk, DistributedDataParallel):
                raise UnsupportedError(
                    f"robust_plugins.megatron_lm: the model chunk is {type(chunk).__name__}; the hooks serve "
                    f"megatron-core's DistributedDataParallel (Megatron-LM's default). Remove --use-megatron-fsdp "
                    f"/ --use-torch-fsdp2.")
        if _run.config.checkpoint is not None and _run.config.checkpoint.memory_every is not None and args.load is None:
            raise ConfigError("robust_plugins.megatron_lm: checkpoint.memory_every restores in Megatron-LM's "
                              "load_checkpoint, which runs only with --load; add --load <dir> (the --save folder).")
        _run.chunks = chunks
        _run.plugins = [enable(chunk, _run.config) for chunk in chunks]
        return model
    return get_model


def _restore_first(original):
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *args, **kwargs):
        from megatron.training.global_vars import get_args

        from robust_plugins.patches import megatron_memory

        mine = _chunks(ddp_model) == _run.chunks and load_arg == "load"
        if not mine:
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)
        megatron_args = get_args()
        _run.scheduler = opt_param_scheduler
        checkpoint = _run.config.checkpoint
        if checkpoint is not None and checkpoint.memory_every is not None and _run.memory is None:
            _run.memory = megatron_memory.MegatronMemory(_run.chunks, optimizer, _run.plugins, checkpoint)
            _run.memory.register("megatron_lm", _run._loop_state, _run._set_loop_state)
        root = getattr(megatron_args, load_arg)
        if _run.memory is not None:
            step = _run.memory.restore(disk_step=_disk_iteration(root))
            if step is not None:
                _run.rng_at_restore = _rng_states()
                return step, _run.flops
        iteration, flops = original(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)
        _run.flops = float(flops or 0.0)
        if iteration:
            _run.rng_at_restore = _rng_states()  # Megatron-LM's own resume: the same DataLoader draw
            _load_plugin_state(root, iteration)
            if _run.memory is not None:
                _run.memory.restored_from_disk(int(iteration), f"iter_{iteration:07d}", 0.0)
        return iteration, flops
    return load_checkpoint


def _rng_states() -> tuple:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from robust_plugins.checkpoint.binding import rng_state

    return rng_state(), get_cuda_rng_tracker().get_states()


def _disk_iteration(root: str | None) -> int | None:
    """Megatron-LM's newest saved iteration under ``root`` (its tracker file), or None."""
    if not root:
        return None
    path = os.path.join(root, "latest_checkpointed_iteration.txt")
    try:
        text = open(path, encoding="utf-8").read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _load_plugin_state(root: str, iteration: int) -> None:
    import torch.distributed as dist

    from robust_plugins.patches.megatron_memory import load_plugin_states

    path = os.path.join(root, f"iter_{iteration:07d}", STATE_FILE.format(rank=dist.get_rank()))
    if not os.path.isfile(path):
        if any(p is not None and p.sync is not None for p in _run.plugins) and dist.get_rank() == 0:
            log.warning("robust_plugins: %s has no plugin state (saved without robust_plugins?); compression "
                        "residuals start from zero", os.path.dirname(path))
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["world_size"] != dist.get_world_size():
        if dist.get_rank() == 0:
            log.warning("robust_plugins: %s was saved by %d ranks, this job has %d; compression residuals start "
                        "from zero", os.path.dirname(path), state["world_size"], dist.get_world_size())
        return
    load_plugin_states(_run.plugins, state["plugin"], f"Megatron-LM checkpoint {os.path.dirname(path)}")


def _save_plugin_state(original):
    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, *args, **kwargs):
        import torch.distributed as dist
        from megatron.training.global_vars import get_args

        from robust_plugins.patches.megatron_memory import plugin_states

        out = original(iteration, model, optimizer, opt_param_scheduler, *args, **kwargs)
        megatron_args = get_args()
        if _chunks(model) == _run.chunks and not kwargs.get("non_persistent_ckpt", False) and megatron_args.save:
            folder = os.path.join(megatron_args.save, f"iter_{int(iteration):07d}")
            os.makedirs(folder, exist_ok=True)
            torch.save({"format": 1, "world_size": dist.get_world_size(), "step": int(iteration),
                        "plugin": plugin_states(_run.plugins)},
                       os.path.join(folder, STATE_FILE.format(rank=dist.get_rank())))
        return out
    return save_checkpoint


def _signal_steps(original):
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None):
        if _run.rng_at_restore is not None:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            from robust_plugins.checkpoint.binding import set_rng_state

            rng, tracker = _run.rng_at_restore
            _run.rng_at_restore = None
            set_rng_state(rng)
            get_cuda_rng_tracker().set_states(tracker)
        out = original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                       forward_backward_func, iteration=iteration)
        if iteration is None or _chunks(model) != _run.chunks:
            return out
        step = int(iteration) + 1  # the loop counts the step after train_step returns
        loss_dict, grad_norm = out[0], out[5]
        loss = loss_dict.get("lm loss") if isinstance(loss_dict, Mapping) else None
        if _run.memory is not None:
            _run._after = _after_step_state(opt_param_scheduler)
            _run.memory.on_step(step)
        _run.plugins[0].step_end(step, loss=None if loss is None else float(loss), grad_norm=grad_norm)
        return out
    return train_step


def _after_step_state(scheduler) -> dict:
    """What Megatron-LM's loop holds once step ``iteration + 1`` is counted (its counters are
    updated after ``train_step`` returns, so they are computed here as the loop does)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training.global_vars import get_args
    from megatron.training.training import num_floating_point_operations

    args = get_args()
    batch = mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
    _run.flops += num_floating_point_operations(args, batch)
    return {"consumed_train_samples": args.consumed_train_samples + batch,
            "skipped_train_samples": args.skipped_train_samples, "flops": _run.flops,
            # before this step's evaluation (the loop runs it after train_step returns)
            "consumed_valid_samples": args.consumed_valid_samples,
            "scheduler": scheduler.state_dict() if scheduler is not None else None}


def _skip_built_helpers(original):
    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            return original()
        return None
    return compile_helpers


def install(block: Mapping[str, Any] | None, cpu: bool) -> None:
    """Install the hooks above for ``block`` (the ``robust_plugins`` block; None: the step signal
    only), and with ``cpu`` the CPU redirects (:mod:`robust_plugins.patches.megatron_lm_cpu`).

    Call before the script imports ``megatron.training`` names (``runpy`` runs it afterwards).
    """
    global _run
    import importlib

    from megatron.training import checkpointing, training

    from robust_plugins.patches.megatron import SUPPORTED, check_megatron_version

    check_megatron_version()
    if _installed:
        return
    _guard.check_signature("Megatron-LM", training.train_step, _TRAIN_STEP, SUPPORTED)
    _guard.check_signature("Megatron-LM", training.get_model, _GET_MODEL, SUPPORTED)
    config = PluginConfig.from_dict(block)
    why = checkpoint_refusal(config)
    if why is not None:
        raise ConfigError(why)
    _run = _Run(config)
    if cpu:
        from robust_plugins.patches import megatron_lm_cpu

        megatron_lm_cpu.install()
    datasets_utils = importlib.import_module("megatron.core.datasets.utils")
    targets = [(training, "get_model", _enable_chunks), (training, "load_checkpoint", _restore_first),
               (training, "save_checkpoint", _save_plugin_state), (training, "train_step", _signal_steps),
               (datasets_utils, "compile_helpers", _skip_built_helpers)]
    for owner, name, make in targets:
        original = getattr(owner, name)
        setattr(owner, name, _guard.wrap(original, make(original)))
        _installed.append((owner, name, original))
    _ = checkpointing  # imported for training's own bindings to exist before they are rebound
    log.info("robust_plugins: Megatron-LM hooks installed: training.get_model, load_checkpoint, save_checkpoint, "
             "train_step, datasets.utils.compile_helpers")


def undo() -> None:
    """Restore what :func:`install` replaced."""
    global _run
    while _installed:
        owner, name, original = _installed.pop()
        setattr(owner, name, original)
    _run = None

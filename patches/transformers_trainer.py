"""Hugging Face Trainer binding: a restarted job resumes the Trainer where the plugin's restore point left it.

The block reaches DeepSpeed on its own (the Trainer calls ``deepspeed.initialize`` through
Accelerate, inside ``train()``), so compression, telemetry and the watchdog need nothing here. What
the engine's restore cannot do alone is move the Trainer: its loop keeps its own step, epoch,
position in the epoch, loss accumulators, callbacks and RNG use, and without this binding it
starts again at step 0 on a restored engine (89 steps instead of 60, silently).

``install()`` (run when ``transformers.trainer`` is imported, ``robust_plugins/_hooks.py``) wraps
``Trainer._inner_training_loop`` (transformers 5.24) so that, while it runs, an engine built with
the block finds its Trainer (:func:`bind_engine`, called by ``patches/deepspeed.py`` before the
engine's resume). With ``checkpoint.memory_every``, the binding then

* registers the Trainer's state in the engine's snapshots (``memory.register``): ``TrainerState``
  (global step, float epoch, log history, flos, tokens seen), the ``ExportableState`` callbacks and
  ``TrainerControl``, the loss accumulators (``_tr_loss``, ``_total_loss_scalar``, the last
  logged step, the step this ``train()`` started from), the RNG states as the Trainer saves them,
  and the Trainer's own LR scheduler (without a DeepSpeed ``scheduler`` section the engine does
  not hold it: the Trainer builds and steps it);
* moves the engine's snapshot from DeepSpeed's optimizer step (inside the last micro-batch's
  backward) to the end of the Trainer's step, after ``_maybe_log_save_evaluate``: there the
  Trainer's state of the step is complete, and nothing consumes randomness before the next batch;
* on a restore, hands the Trainer its own resume path without any file: ``_run_epoch`` is called
  with the restored epoch and the number of micro-batches trained in it (its ``skip_first_batches``
  and sampler ``set_epoch`` do the data), epochs before it and their ``on_epoch_begin`` are
  skipped, and ``_load_rng_state`` (which the Trainer calls after fetching the first batches)
  sets the snapshot's RNG states.

With ``report_to=["wandb"]`` and ``telemetry.wandb``, the Trainer's W&B run and the plugin's sit
side by side in one project and group (:func:`_align_wandb`).

So the run ends with the fault-free run's steps, log history and weights (tests/integration/
test_hf_trainer.py). Limits, said in docs/hf_trainer.md: callbacks that are not ``ExportableState``
keep no state across a restart; a data collator that draws from the global RNG is exact only with
``dataloader_num_workers=0`` and a prefetch-free loader (Accelerate fetches one batch ahead).
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import numpy as np
import torch

from robust_plugins._logging import announce, current_rank, get_logger
from robust_plugins.device import device_rng_state, set_device_rng_state
from robust_plugins.errors import ConfigError, UnsupportedError
from robust_plugins.patches import _guard, _ranges

log = get_logger(__name__)

RANGE = _ranges.TRANSFORMERS
SUPPORTED = f"transformers {RANGE.spec}"

#: What is off on a transformers this binding does not support (said once, at install).
OFF = ("the Trainer binding: a checkpoint sub-block under the Trainer is refused (a restore would restart the "
       "Trainer's loop at step 0), and report_to=['wandb'] with telemetry.wandb is not aligned (the Trainer's "
       "W&B run follows WANDB_PROJECT / WANDB_MODE, default project 'huggingface', online). Compression, "
       "telemetry and the watchdog work without it.")

#: ``resume_from_checkpoint`` handed to ``_run_epoch`` on a restore: no directory, our state.
MARKER = "robust_plugins://restore-point"

#: Name of the Trainer's state in the engine's snapshots.
STATE_NAME = "hf_trainer"

_LOOP_SIGNATURE = ["self", "batch_size", "args", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"]
_RUN_EPOCH_SIGNATURE = ["self", "model", "epoch", "train_dataloader", "steps_in_epoch", "num_update_steps_per_epoch",
                        "trial", "ignore_keys_for_eval", "start_time", "resume_from_checkpoint", "epochs_trained",
                        "steps_trained_in_current_epoch"]
_LOG_SAVE_SIGNATURE = ["self", "tr_loss", "grad_norm", "model", "trial", "epoch", "ignore_keys_for_eval",
                       "start_time", "learning_rate"]
_LOAD_RNG_SIGNATURE = ["self", "checkpoint"]

#: Trainers whose ``_inner_training_loop`` is running in this process (innermost last).
_ACTIVE: list = []

_INSTALL_ERROR: Exception | None = None


def install() -> None:
    """Wrap ``Trainer._inner_training_loop`` (idempotent). On another transformers version nothing
    is patched and the reason is kept: :func:`bind_engine` raises it when a Trainer's engine has a
    ``checkpoint`` block (a silent wrong resume); other sub-blocks work without this binding."""
    global _INSTALL_ERROR
    import transformers
    from transformers.trainer import Trainer

    if _guard.is_patched(Trainer._inner_training_loop):
        return
    try:
        RANGE.check(transformers.__version__)
        for fn, sig in ((Trainer._inner_training_loop, _LOOP_SIGNATURE), (Trainer._run_epoch, _RUN_EPOCH_SIGNATURE),
                        (Trainer._maybe_log_save_evaluate, _LOG_SAVE_SIGNATURE),
                        (Trainer._load_rng_state, _LOAD_RNG_SIGNATURE)):
            _guard.check_signature("transformers", fn, sig, SUPPORTED)
    except Exception as exc:  # noqa: BLE001 - kept and raised where it matters (bind_engine)
        _INSTALL_ERROR = exc
        _guard.host_off("transformers", exc, OFF)
        return
    original = Trainer._inner_training_loop

    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None,
                             ignore_keys_for_eval=None):
        shared_wandb = _align_wandb(self)
        _ACTIVE.append(self)
        try:
            result = original(self, batch_size, args, resume_from_checkpoint, trial, ignore_keys_for_eval)
        finally:
            _ACTIVE.remove(self)
            binding = self.__dict__.pop("_robust_trainer", None)
            if binding is not None:
                binding.unbind()
        if shared_wandb:
            # Finish the plugin's W&B run now: at interpreter exit wandb's own hook stops its
            # service first (after the Trainer's run), and our run's finish then failed.
            telemetry = getattr(getattr(self.model_wrapped, "robust_plugins", None), "telemetry", None)
            if telemetry is not None:
                telemetry.close()
        _record_completion(self)
        return result

    Trainer._inner_training_loop = _guard.wrap(original, _inner_training_loop)
    log.debug("robust_plugins: replaced Trainer._inner_training_loop (transformers %s)", transformers.__version__)


def undo() -> None:
    """Restore the Trainer's own ``_inner_training_loop``."""
    from transformers.trainer import Trainer

    if _guard.is_patched(Trainer._inner_training_loop):
        Trainer._inner_training_loop = Trainer._inner_training_loop.__wrapped__


def _align_wandb(trainer) -> bool:
    """``report_to=["wandb"]`` and the block's ``telemetry.wandb``: two W&B runs side by side, the
    Trainer's (its logs) and the plugin's (telemetry, faults), in one project, mode and group: the
    block's ``project`` and ``mode``, its ``group`` or else ``WANDB_RUN_GROUP``, the Trainer's
    ``run_name`` or ``output_dir``. A different ``WANDB_PROJECT`` / ``WANDB_MODE`` / ``WANDB_RUN_GROUP``
    is an error naming both values."""
    from robust_plugins.config import PluginConfig

    if "wandb" not in (trainer.args.report_to or []):
        return False
    hf_cfg = getattr(trainer.args, "hf_deepspeed_config", None)
    ds = hf_cfg.config if hf_cfg is not None else None
    telemetry = PluginConfig.from_ds_config(ds).telemetry if isinstance(ds, dict) else None
    wb = telemetry.wandb if telemetry is not None else None
    if wb is None:
        return False
    group = wb.group or os.environ.get("WANDB_RUN_GROUP") or trainer.args.run_name or trainer.args.output_dir
    for env, ours, key in (("WANDB_PROJECT", wb.project, "project"), ("WANDB_MODE", wb.mode, "mode"),
                           ("WANDB_RUN_GROUP", group, "group")):
        theirs = os.environ.get(env)
        if theirs is not None and theirs != ours:
            raise ConfigError(
                f"report_to=['wandb'] with robust_plugins.telemetry.wandb: {env}={theirs!r} but "
                f"telemetry.wandb.{key} = {ours!r}, so the Trainer's W&B run and the plugin's would land "
                f"apart. Set telemetry.wandb.{key} to {theirs!r} (or unset {env}).")
        os.environ[env] = ours
    from transformers.integrations import WandbCallback

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, WandbCallback) and not cb._initialized:
            # Now, before the engine exists: the Trainer's run becomes wandb's global run, as in
            # on_train_begin (which then skips it). Created after the plugin's run, its
            # wandb.init() would return that run without wandb.config and fail.
            cb.setup(trainer.args, trainer.state, trainer.model)
    announce(log, "robust_plugins: W&B: the Trainer's run and the plugin's telemetry run share project %r, "
             "group %r, mode %s", wb.project, group, wb.mode)
    return True


def _trainer_class():
    from transformers.trainer import Trainer

    return Trainer


def active_trainer():
    """The Trainer whose training loop is building an engine now, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def bind_engine(engine, plugin) -> "TrainerBinding | None":
    """Called by ``patches/deepspeed.py`` for every engine with the block, before its resume:
    bind the Trainer building it (None when no Trainer is, or the block has no ``checkpoint``)."""
    cfg = plugin.config.checkpoint
    trainer = active_trainer()
    if trainer is None and _INSTALL_ERROR is not None:
        # The binding is off, so no loop registered itself: a Trainer on the call stack is
        # building this engine (an Accelerate loop or a plain script is not one).
        trainer = _guard.caller_instance(_trainer_class())
        if trainer is None:
            return None
        if cfg is not None:
            raise UnsupportedError(f"robust_plugins.checkpoint under the Hugging Face Trainer: {_INSTALL_ERROR} "
                                   f"Without the Trainer binding a restore would restart the Trainer's loop at "
                                   f"step 0 on a restored engine.")
        telemetry = plugin.config.telemetry
        if telemetry is not None and telemetry.wandb is not None and "wandb" in (trainer.args.report_to or []):
            _guard.host_off("transformers-wandb", _INSTALL_ERROR,
                            "the W&B alignment of report_to=['wandb'] with telemetry.wandb: the Trainer's W&B run "
                            f"follows WANDB_PROJECT / WANDB_MODE (now {os.environ.get('WANDB_PROJECT', 'unset')} / "
                            f"{os.environ.get('WANDB_MODE', 'unset')}), not telemetry.wandb's project "
                            f"{telemetry.wandb.project!r} and mode {telemetry.wandb.mode!r}; set them yourself.")
        return None
    if trainer is None:
        return None
    if cfg is None:
        return None
    if plugin.memory is None:
        raise UnsupportedError(
            "robust_plugins.checkpoint under the Hugging Face Trainer needs checkpoint.memory_every (e.g. 1): its "
            "snapshots (and their disk copies with persist_every) carry the Trainer's step, epoch, data position, "
            "callbacks and RNG states together with the engine's; a DeepSpeed checkpoint alone would restart the "
            "Trainer's loop at step 0. Set memory_every, or remove the checkpoint sub-block and use the Trainer's "
            "own save_strategy / resume_from_checkpoint.")
    binding = TrainerBinding(trainer, engine, plugin)
    trainer._robust_trainer = binding
    return binding


def _rng_states() -> dict:
    """The RNG states in the layout of the Trainer's ``rng_state_<i>.pth``."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's device only (a restart with fewer visible GPUs can load it): robust_plugins.device.
        state["cuda"] = device_rng_state()
    return state


def _set_rng_states(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))  # a snapshot returns the tuple's middle as a list
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state:
        set_device_rng_state(state["cuda"])  # one state, or an older snapshot's list of every device's


def _exportable(trainer) -> list:
    from transformers.trainer_callback import ExportableState

    return [cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)]


class TrainerBinding:
    """One Trainer's part in one engine's snapshots; ``trainer._robust_trainer`` while it trains."""

    def __init__(self, trainer, engine, plugin) -> None:
        self.trainer, self.engine, self.plugin = trainer, engine, plugin
        self.memory = plugin.memory
        self.restored: dict | None = None
        """The Trainer part of the snapshot a restore applied, until the loop has used it."""
        self._epoch_begins = 0
        self._last_logged_step: int | None = None
        # The snapshot moves to the end of the Trainer's step (module docstring).
        observers = engine.__dict__.get("_robust_step_observers", [])
        if self.memory.on_step in observers:
            observers.remove(self.memory.on_step)
        self.memory.register(STATE_NAME, self.capture, self.apply)
        _guard.bind_instance(trainer, "_maybe_log_save_evaluate", self._after_step(trainer._maybe_log_save_evaluate))
        _guard.bind_instance(trainer, "_run_epoch", self._resume_epoch(trainer._run_epoch))
        _guard.bind_instance(trainer, "_load_rng_state", self._load_rng(trainer._load_rng_state))
        handler = trainer.callback_handler
        _guard.bind_instance(handler, "on_epoch_begin", self._epoch_begin(handler.on_epoch_begin))

    # ------------------------------------------------------------------------------ capture
    def capture(self) -> dict:
        """The Trainer's state at the end of its step (tensors and plain data only)."""
        t = self.trainer
        callbacks: dict[str, list] = {}
        for cb in _exportable(t):
            callbacks.setdefault(type(cb).__name__, []).append(cb.state())
        state = dict(vars(t.state))
        state["stateful_callbacks"] = {}  # carried below, as lists, whatever their count
        return {"state_json": json.dumps(state), "callbacks_json": json.dumps(callbacks),
                "tr_loss": t._tr_loss.detach().clone(), "total_loss_scalar": float(t._total_loss_scalar),
                "globalstep_last_logged": int(t._globalstep_last_logged),
                "initial_global_step": int(t._initial_global_step),
                "initial_tokens_seen": int(t._initial_num_input_tokens_seen),
                "current_flos": float(t.current_flos), "rng": _rng_states(),
                "lr_scheduler": self._own_scheduler().state_dict() if self._own_scheduler() is not None else None}

    def _own_scheduler(self):
        """The Trainer's LR scheduler when the engine does not hold it: without a DeepSpeed
        "scheduler" section the Trainer builds its own and steps it itself, so the engine's snapshot
        (``engine.lr_scheduler`` is None) does not have it."""
        sched = self.trainer.lr_scheduler
        return sched if self.engine.lr_scheduler is None and sched is not None else None

    def apply(self, value: dict) -> None:
        """A restore (inside ``deepspeed.initialize``): the Trainer takes the snapshot's state now;
        the loop (``_run_epoch``) takes the rest before its first step."""
        from transformers.trainer_callback import TrainerState

        t = self.trainer
        fresh = t.state
        state = TrainerState(**json.loads(value["state_json"]))
        state.stateful_callbacks = fresh.stateful_callbacks
        state.init_training_references(t, fresh.max_steps, fresh.num_train_epochs, None)
        t.state = state
        self.restored = value

    # ------------------------------------------------------------------------------ the loop
    def _after_step(self, inner):
        def _maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                     learning_rate=None):
            result = inner(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                           learning_rate=learning_rate)
            step = self.engine.global_steps
            if step == self._last_logged_step and self.memory.taken_at == step:
                # The epoch's closing call (after on_epoch_end): the snapshot of this step is taken
                # again, so a restore here does not replay the epoch's end.
                self.memory._save(step, replace_newest=True)
            else:
                self.memory.on_step()
            self._last_logged_step = step
            return result

        return _maybe_log_save_evaluate

    def _resume_epoch(self, inner):
        def _run_epoch(model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                       ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                       steps_trained_in_current_epoch):
            args = (model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                    ignore_keys_for_eval, start_time)
            r = self.restored
            if r is None:
                return inner(*args, resume_from_checkpoint, epochs_trained, steps_trained_in_current_epoch)
            t = self.trainer
            done = t.state.global_step
            first_epoch = done // num_update_steps_per_epoch
            skip = (done % num_update_steps_per_epoch) * t.args.gradient_accumulation_steps
            if done >= t.state.max_steps:
                # The restore point is the last step (a restart after the job had finished): no step
                # more, where the Trainer's own resume would train until on_step_end stops it.
                self.restored = None
                t.control.should_training_stop = True
                return None
            if epoch < first_epoch:
                return None  # trained before the restore point (its on_epoch_begin was skipped too)
            self.restored = None
            self._take_loop_state(r)
            if current_rank() == 0:
                announce(log, "robust_plugins: Trainer resumed at global step %d (epoch %d, %d micro-batches "
                         "into it) from the plugin's restore point; it continues at step %d of %d",
                         done, first_epoch, skip, done + 1, t.state.max_steps)
            return inner(*args, MARKER, first_epoch, skip)

        return _run_epoch

    def _take_loop_state(self, r: dict) -> None:
        t = self.trainer
        t._tr_loss = r["tr_loss"].to(t.args.device).clone()
        t._total_loss_scalar = r["total_loss_scalar"]
        t._globalstep_last_logged = r["globalstep_last_logged"]
        t._initial_global_step = r["initial_global_step"]
        t._initial_num_input_tokens_seen = r["initial_tokens_seen"]
        t.current_flos = r["current_flos"]
        sched = self._own_scheduler()
        if r.get("lr_scheduler") is not None and sched is not None:
            sched.load_state_dict(r["lr_scheduler"])
            # load_state_dict sets the scheduler's counters only; the rate the next optimizer step
            # uses is in the param groups, and DeepSpeed's ZeRO state holds each group's tensors,
            # not its hyperparameters (_get_base_optimizer_state), so the rate stays the fresh
            # scheduler's first (0 with warm-up). Put back what the scheduler last set.
            for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
                group["lr"] = lr
        stored = json.loads(r["callbacks_json"])
        seen: dict[str, int] = {}
        for cb in _exportable(t):
            name = type(cb).__name__
            i = seen[name] = seen.get(name, -1) + 1
            if name in stored and i < len(stored[name]):
                # In place (same objects the handler holds), whatever restore_callback_states_from_checkpoint
                # says: this is a transparent restart, not a user's choice of checkpoint.
                for key, value in stored[name][i].get("attributes", {}).items():
                    setattr(cb, key, value)
        self._rng = r["rng"]
        self._last_logged_step = t.state.global_step

    def _epoch_begin(self, inner):
        def on_epoch_begin(args, state, control):
            k, self._epoch_begins = self._epoch_begins, self._epoch_begins + 1
            if self.restored is not None and k < self.epochs_to_skip(self._updates_per_epoch()):
                return control  # the fault-free run called it before the restore point
            return inner(args, state, control)

        return on_epoch_begin

    def _updates_per_epoch(self) -> int:
        # set_initial_training_values' formula, on the loader the Trainer handed its callbacks.
        n = len(self.trainer.callback_handler.train_dataloader)
        ga = self.trainer.args.gradient_accumulation_steps
        return max(n // ga + int(n % ga > 0), 1)

    def _load_rng(self, inner):
        def _load_rng_state(checkpoint):
            if checkpoint != MARKER:
                return inner(checkpoint)
            _set_rng_states(self._rng)
            return None

        return _load_rng_state

    def epochs_to_skip(self, num_update_steps_per_epoch: int) -> int:
        """How many ``on_epoch_begin`` calls the fault-free run made before its restore point."""
        done = self.trainer.state.global_step
        first_epoch, within = divmod(done, num_update_steps_per_epoch)
        return first_epoch + (1 if within else 0)

    # ------------------------------------------------------------------------------ the end
    def unbind(self) -> None:
        """Remove the instance wrappers (the engine keeps its snapshots)."""
        for obj, name in ((self.trainer, "_maybe_log_save_evaluate"), (self.trainer, "_run_epoch"),
                          (self.trainer, "_load_rng_state"), (self.trainer.callback_handler, "on_epoch_begin")):
            _guard.unbind_instance(obj, name)


def _record_completion(trainer) -> None:
    """``train()`` returned on this rank: say so to ``robust run`` (``$ROBUST_RUN_DIR/completed``),
    which counts a rank that aborts later, at interpreter exit, as finished (never re-trained;
    ``robust_plugins/watchdog/completion.py``). With or without the block."""
    from robust_plugins.watchdog import completion

    run_dir = os.environ.get("ROBUST_RUN_DIR")
    if not run_dir or not os.path.isdir(run_dir):
        return
    completion.record(run_dir, current_rank(), int(os.environ.get("WORLD_SIZE", "1")), host="hf_trainer",
                      step=trainer.state.global_step, max_steps=trainer.state.max_steps)

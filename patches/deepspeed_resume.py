"""DeepSpeed resume inside ``deepspeed.initialize`` (``checkpoint.resume``; on under ``robust run``).

When (:func:`robust_plugins.checkpoint.restore.resume_reason`): ``resume: true`` always;
``resume: false`` never; unset, under ``robust run`` (the rank has a watchdog client) whenever the
``checkpoint`` sub-block has a ``dir`` or ``memory_every``. Then, at the end of
``deepspeed.initialize``, the engine loads the newest restore point through every wrapper the
plugin bound (``engine.load_checkpoint(dir)``: its own memory snapshot, a peer's copy, the newest
verified disk checkpoint, older ones; after a rollback nothing newer than its last good step),
so an unchanged script reads ``engine.global_steps`` and continues at the step after it. Rank 0
prints one line saying where it resumed from (or that nothing was there), as DeepSpeed prints
its own (``_logging.announce``).

Once: a script that also calls ``engine.load_checkpoint`` itself (the resume contract of
``FORMAT.md``, which scripts written before this default follow) gets that load's result,
``(load_path, client_state)``, without a second restore, provided it asks for the same thing:
no tag, the block's ``dir`` (or none), a full load (no ``load_module_only``, optimizer and LR
scheduler states loaded, no ``custom_load_fn``), before the engine's first step. Any other call
loads as asked. The result is also ``engine.robust_plugins.resumed``.

State the script registers with ``engine.robust_plugins.memory.register`` after
``deepspeed.initialize`` is handed to it at ``register`` (``MemorySnapshots.pending_user``); a
name still unregistered at the script's load or first step is an error naming it.
"""

from __future__ import annotations

import os

from robust_plugins._logging import announce, get_logger
from robust_plugins.checkpoint.restore import resume_reason
from robust_plugins.errors import CheckpointError
from robust_plugins.patches import _guard

log = get_logger(__name__)

#: ``DeepSpeedEngine.load_checkpoint``'s parameters after ``tag``, in order (``patches/deepspeed.py``
#: checks the signature at install).
_AFTER_TAG = ("load_module_strict", "load_optimizer_states", "load_lr_scheduler_states", "load_module_only",
              "custom_load_fn")


def under_robust_run() -> bool:
    """True in a rank started by ``robust run`` (it has the node monitor's socket)."""
    from robust_plugins.watchdog import client

    return client.get_client() is not None


def resume_at_init(engine, plugin) -> None:
    """Resume now (end of ``deepspeed.initialize``) if :func:`resume_reason` says so."""
    cfg = plugin.config.checkpoint
    if cfg is None:
        return
    reason = resume_reason(cfg.resume, under_robust_run(), cfg.dir is not None, cfg.memory_every is not None)
    if reason is None:
        return
    memory = plugin.memory
    if memory is not None:
        memory.pending_user = {}  # the script registers its state after initialize returns
    try:
        path, client_state = engine.load_checkpoint(cfg.dir)
    except CheckpointError as exc:
        if cfg.resume is None:
            raise CheckpointError(f"{exc} (This load is robust run's default resume inside "
                                  f"deepspeed.initialize; set robust_plugins.checkpoint.resume to false "
                                  f"to start cold and load yourself.)") from exc
        raise
    if memory is not None and not memory.pending_user:
        memory.pending_user = None
    plugin.resumed = (path, client_state)
    _bind_once(engine, plugin, engine.global_steps)
    # The step a restarted job resumes at is what its user looks for first: printed on rank 0
    # the way DeepSpeed prints the lines it means to be seen, whatever the log levels.
    where = cfg.dir if cfg.dir is not None else "the memory snapshots"
    if path is None:
        announce(log, "robust_plugins: checkpoint.resume: nothing to resume in %s; training starts at step 1 "
                 "(engine.global_steps = 0) [%s]", where, reason)
    else:
        announce(log, "robust_plugins: checkpoint.resume: resumed from %s; engine.global_steps = %d, the script "
                 "continues at step %d [%s]", path, engine.global_steps, engine.global_steps + 1, reason)


def _full_load(args: tuple, kwargs: dict) -> bool:
    """True when the arguments after ``tag`` ask for everything (strictness aside)."""
    given = dict(zip(_AFTER_TAG, args))
    given.update(kwargs)
    return (bool(given.get("load_optimizer_states", True)) and bool(given.get("load_lr_scheduler_states", True))
            and not given.get("load_module_only", False) and given.get("custom_load_fn") is None)


def _same_dir(given, configured) -> bool:
    return configured is not None and os.path.realpath(os.fspath(given)) == os.path.realpath(os.fspath(configured))


def _bind_once(engine, plugin, at_step: int) -> None:
    # Outermost, above the watchdog's and the verified load's wrappers: the answer handed back is
    # what they already made of the resume's load (watchdog state taken out of client_state).
    inner = engine.load_checkpoint
    cfg = plugin.config.checkpoint
    pending = [True]

    def load_checkpoint(load_dir=None, tag=None, *args, **kwargs):
        if pending[0]:
            pending[0] = False
            same = (tag is None and engine.global_steps == at_step and _full_load(args, kwargs)
                    and (load_dir is None or _same_dir(load_dir, cfg.dir)))
            if same:
                if plugin.memory is not None:
                    plugin.memory.check_pending_user("engine.load_checkpoint")
                announce(log, "robust_plugins: engine.load_checkpoint(%s): the state was restored in "
                         "deepspeed.initialize (%s); not loaded again", load_dir, plugin.resumed[0])
                return plugin.resumed
        return inner(load_dir, tag, *args, **kwargs)

    engine.load_checkpoint = _guard.wrap(inner, load_checkpoint)

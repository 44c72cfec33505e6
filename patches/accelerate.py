"""Accelerate's guard: the resume contract of an Accelerate loop holds on the accelerate it was tested on.

Nothing of Accelerate is replaced: its ``prepare`` calls ``deepspeed.initialize``, which the
DeepSpeed patch serves. What depends on Accelerate is the ``checkpoint`` sub-block's resume
contract (the engine restores inside ``accelerator.prepare``; the loop then reads
``model.global_steps`` and skips batches with ``skip_first_batches``: docs/hf_trainer.md), tested
on :data:`RANGE`. ``install()`` (run when ``accelerate`` is imported, ``robust_plugins/_hooks.py``)
reads the version; outside the range one warning says what is off, and :func:`bind_engine`
refuses an engine with a ``checkpoint`` sub-block that an ``Accelerator`` is building. Compression,
telemetry and the watchdog are DeepSpeed's business and work whatever the accelerate.
"""

from __future__ import annotations

import sys

from robust_plugins.errors import HostVersionError, UnsupportedError
from robust_plugins.patches import _guard, _ranges

RANGE = _ranges.ACCELERATE

#: What is off on an accelerate outside :data:`RANGE` (said once, at install).
OFF = ("the checkpoint sub-block's resume in an Accelerate loop (an engine with it built by accelerator.prepare "
       "is refused); compression, telemetry and the watchdog work without it.")

_PROBLEM: HostVersionError | None = None


def install() -> None:
    """Check the imported accelerate's version (idempotent; replaces nothing)."""
    global _PROBLEM
    import accelerate

    _PROBLEM = RANGE.error(accelerate.__version__)
    if _PROBLEM is not None:
        _guard.host_off("accelerate", _PROBLEM, OFF)


def bind_engine(engine, plugin) -> None:
    """Called by ``patches/deepspeed.py`` for every engine with the block, before its resume:
    refuse a ``checkpoint`` sub-block on an unsupported accelerate when an ``Accelerator`` is
    building the engine (its ``prepare`` is on the call stack) for a loop of its own, not a Trainer's."""
    if _PROBLEM is None or plugin.config.checkpoint is None:
        return
    from accelerate import Accelerator

    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is not None and _guard.caller_instance(trainer_module.Trainer) is not None:
        return  # the Trainer's own binding (patches/transformers_trainer.py) decides for its loop
    if _guard.caller_instance(Accelerator) is None:
        return
    raise UnsupportedError(f"robust_plugins.checkpoint in an Accelerate loop: {_PROBLEM} Its resume contract "
                           f"(the restore inside accelerator.prepare) was tested on accelerate {RANGE.spec} only.")

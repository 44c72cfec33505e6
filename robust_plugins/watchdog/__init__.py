"""Fault watchdog, the rank side: step signals and questions a training loop sends ``robust run``.

The one call a training loop makes (a no-op outside ``robust run``)::

    from robust_plugins import watchdog

    for step in range(start, total + 1):
        loss = train_step(step)
        watchdog.step_end(step, loss=loss, grad_norm=grad_norm)
        ok = watchdog.check_params(step, model)      # silent data corruption, every N steps
        if step % save_every == 0 and ok and watchdog.ok_to_save(step):
            save_checkpoint(step)

What a rank imports. The launcher side (agent, node monitor, standbys) is
``robust_plugins.launcher``, which this package never imports; the two meet in the wire names
of :mod:`.protocol`, the step rings of :mod:`.ring` and the ``faults.jsonl`` format of
:mod:`.faults` (``FORMAT.md``).

Rank side: :mod:`.client` (step signals, questions), :mod:`.hold`, :mod:`.param_hash` and
:mod:`.snapshot_check` (SDC checks), :mod:`.emergency_rank` (emergency saves), :mod:`.inject_rank`
(injected faults), :mod:`.flight` (the flight recorder's dumps). Shared with the launcher:
:mod:`.protocol`, :mod:`.ring`, :mod:`.faults`, :mod:`.inject` (``--inject`` specs),
:mod:`.detect` (pure detection logic), :mod:`.completion` (a finished rank's mark).
"""

from __future__ import annotations

from robust_plugins.watchdog.client import (
    check_params,
    grad_accumulation,
    load_state_dict,
    ok_to_save,
    skip_batch,
    state_dict,
    step_end,
    straggler_group,
)
from robust_plugins.watchdog.emergency_rank import on_emergency
from robust_plugins.watchdog.protocol import pg_timeout

__all__ = ["check_params", "grad_accumulation", "load_state_dict", "on_emergency", "ok_to_save", "pg_timeout", "skip_batch", "state_dict", "step_end",
           "straggler_group"]

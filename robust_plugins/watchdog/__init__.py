"""Fault watchdog: step signals from ranks, the node monitor and detectors behind ``robust run``.

The one call a training loop makes (a no-op outside ``robust run``)::

    from robust_plugins import watchdog

    for step in range(start, total + 1):
        loss = train_step(step)
        watchdog.step_end(step, loss=loss, grad_norm=grad_norm)
        ok = watchdog.check_params(step, model)      # silent data corruption, every N steps
        if step % save_every == 0 and ok and watchdog.ok_to_save(step):
            save_checkpoint(step)

Layout: :mod:`.client` (rank side; emergency saves in :mod:`.emergency_rank`, injected faults in
:mod:`.inject_rank`), :mod:`.protocol` (the variables the launcher sets for the ranks),
:mod:`.inject` (``--inject`` specs), :mod:`.detect` (pure detection logic), :mod:`.stacks`
(py-spy / faulthandler), :mod:`.monitor` (node monitor), :mod:`.faults` (``faults.jsonl``),
:mod:`.agent` (the elastic agent). ``FORMAT.md`` documents ``faults.jsonl`` and the resume contract.
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
)
from robust_plugins.watchdog.emergency_rank import on_emergency

__all__ = ["check_params", "grad_accumulation", "load_state_dict", "on_emergency", "ok_to_save", "skip_batch", "state_dict", "step_end"]

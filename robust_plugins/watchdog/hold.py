"""A rank that reported a NaN/Inf or a spike waits to be stopped instead of training on.

Why: ``robust run`` rolls a NaN back to the step before it (that step's update is the bad one),
and each rank keeps its two newest in-memory snapshots. Ranks that trained on while the
agent stopped them would take the snapshot of the next step, evicting the last good one: the
rollback would then find only bad steps in memory and fall back to disk, or without a disk
checkpoint to step 0. Here the rank that saw the NaN asks its node monitor and, when the
monitor says the ranks are being stopped, takes no further step; a spike likewise, judged on the
rank by the monitor's own rule (:class:`SpikeWatch`). Its data-parallel peers cannot finish the next step
without its gradients, so no rank gets past the snapshot of the NaN step and every rank still
holds the step before it: by construction, not by winning a race against the agent's stop.

The monitor answers the ``ok_to_save`` question (``k: query``): False once its check has found
the fault (the agent then stops every rank, to restart them or to end the job), True once every
rank of the node reported the step without one (``nan_check`` off), after which training goes on.
"""

from __future__ import annotations

import json
import time
from typing import Any

from robust_plugins._logging import announce, get_logger
from robust_plugins.errors import RobustPluginsError

log = get_logger(__name__)

#: How long the rank waits for the monitor's answer: it answers at its next check (every
#: ``--monitor-interval``, 0.1 s by default), later only while it collects a hang's stacks.
ANSWER_TIMEOUT_S = 10.0

#: How long a rank told that it is being stopped waits for it. The agent stops the ranks right
#: after the check that answered (SIGTERM, then SIGKILL after its grace period); a rank still
#: alive after this stops itself with an error rather than training on a NaN.
HOLD_MAX_S = 120.0


class SpikeWatch:
    """The monitor's spike rule (:class:`~robust_plugins.watchdog.detect.RunningMedian`, same
    factor, window and warm-up) on this rank's own values, so that the rank holds at the step the
    monitor will judge a spike. The monitor's windows live across incarnations; a restarted rank
    takes them over from ``windows_path`` (``ENV_SPIKE_WINDOWS``, written by the monitor just
    before the start), so it holds at a spike in its first steps too. Without that file (unset,
    unreadable, another incarnation's) its window starts empty, said in a warning: then a spike
    in its first ``warmup`` steps is not held (the ranks may run on, or finish the job, and evict
    the step before it from memory; the rollback then falls back to disk)."""

    def __init__(self, text: str, windows_path: str = "", rank: int = 0, incarnation: int = 0) -> None:
        from robust_plugins.watchdog.detect import RunningMedian

        try:
            factor, window, warmup = text.split(",")
            self.factor, self.warmup = float(factor), int(warmup)
            self.medians = {w: RunningMedian(int(window)) for w in ("loss", "grad_norm")} if self.factor > 0 else {}
        except ValueError:  # unset (outside robust run) or spikes off
            self.factor, self.warmup, self.medians = 0.0, 0, {}
        if self.medians and windows_path:
            self._seed(windows_path, rank, incarnation)

    def _seed(self, path: str, rank: int, incarnation: int) -> None:
        try:
            with open(path) as f:
                record = json.loads(f.read())
            if record.get("incarnation") != incarnation:
                raise ValueError(f"written for incarnation {record.get('incarnation')}, this is {incarnation}")
            for what, values in record["ranks"].get(str(rank), {}).items():
                if what in self.medians:
                    self.medians[what].values.extend(float(v) for v in values)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            for m in self.medians.values():
                m.values.clear()
            log.warning("robust watchdog: rank %d cannot take over the monitor's spike windows from %s (%r); "
                        "its window starts empty, so a spike in its first %d steps does not hold it (the "
                        "rollback may then find only later snapshots in memory).", rank, path, exc, self.warmup)

    def seen(self, loss: float | None, grad_norm: float | None) -> bool:
        hits = [m.spike(v, self.factor, self.warmup) is not None
                for m, v in ((self.medians.get("loss"), loss), (self.medians.get("grad_norm"), grad_norm)) if m]
        return any(hits)  # both judged, as the monitor does: a normal value joins its window


def after_fault(client: Any, step: int, what: str) -> None:
    """Called by the client after it wrote step ``step`` with a NaN/Inf or a spike (``what``)."""
    hold_max_s = HOLD_MAX_S
    ok = client.ask(step, ANSWER_TIMEOUT_S)
    if ok is None:
        log.warning("robust watchdog: rank %d: no answer from the node monitor about the %s of step %d "
                    "within %.0f s; training on, so a rollback may find only later snapshots in memory.",
                    client.rank, what, step, ANSWER_TIMEOUT_S)
        return
    if ok:
        return  # the monitor does not act on it (nan_check off, or its window judged otherwise)
    # Printed (every rank that holds): the launcher's log should say why this rank stopped stepping.
    announce(log, "robust watchdog: rank %d: %s at step %d; waiting to be stopped for the rollback (no "
             "further step, so every rank keeps the snapshot before it in memory)", client.rank, what, step,
             all_ranks=True)
    deadline = time.monotonic() + hold_max_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise RobustPluginsError(
        f"robust watchdog: rank {client.rank}: the node monitor found the {what} of step {step} and said the "
        f"ranks are being stopped, but nothing stopped this rank within {hold_max_s:g} s; it stops here rather "
        f"than train on. Look in the launcher's log for why the agent did not stop the ranks.")

"""The node monitor's per-rank state (one :class:`_RankState` a rank of the current incarnation)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from robust_plugins.watchdog.detect import STEP_WINDOW, RankProgress


@dataclass
class _RankState:
    pid: int | None = None
    fh_path: str | None = None
    progress: RankProgress = field(default_factory=RankProgress)
    last_msg_wall: float | None = None
    injected: dict[str, Any] | None = None
    registered: bool = False
    """The rank reported through ``step_end`` at least once (only such ranks are watched for hangs)."""
    finished: bool = False
    """The rank's interpreter is exiting (it sent ``exit``): no more steps are expected."""
    sdc: tuple[int, list[int], str, float, int | None] | None = None
    """(step, minority ranks, reason, wall time, steps since the previous check that agreed, when
    the rank said: the snapshot check) of the first parameter-hash mismatch seen."""
    spike: tuple[int, str, float, float, float] | None = None
    """(step, what, value, median, wall time) of the first spike reported in this incarnation."""
    bad_number: tuple[int, str, float | None, float] | None = None
    """(step, what, value, wall time) of the first NaN/Inf reported in this incarnation."""
    compute: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    """(step, compute seconds, wall time) of the latest steps: step time minus collective time."""
    straggling: Any = None
    """Its open straggler episode (:class:`~robust_plugins.watchdog.straggler.StragglerEpisode`), None
    when it is not straggling."""
    straggler_group: str | None = None
    """The ranks its compute time is compared with: those of the same group (``watchdog.straggler_group``)."""
    device_type: str | None = None
    """What its default group's collectives move (``cpu``: gloo, ``cuda``: NCCL), said at its first step."""
    refused: str | None = None
    """Why the rank refused to run before its first step (``watchdog.client.refused``): the job
    ends with it, unrestarted."""
    emergency: dict[str, Any] | None = None
    """Its emergency saver (``watchdog.on_emergency``): ``{"phase": registered|start|done, ...}``."""

"""The ``watchdog`` sub-block: fault detection settings read by ``robust run``."""

from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator

from robust_plugins.errors import ConfigError
from robust_plugins.schema._base import Hint, Section, num
from robust_plugins.schema.common import BLOCK_KEY

#: A finite number of seconds > 0 (timeouts).
_Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: A finite number of seconds >= 0 (waits that may be zero).
_Wait = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_OFF_OR_ABOVE_ONE = "must be 0 (off) or a finite number > 1"
#: A factor that is 0 (the detector off) or > 1.
_Factor = Annotated[float, Field(ge=0, allow_inf_nan=False), Hint(rule=_OFF_OR_ABOVE_ONE)]


class WatchdogConfig(Section):
    """Fault detection under ``robust run`` (``"watchdog"`` sub-block).

    Hang timeouts are learned: before ``hang_warmup_steps`` steps every rank has
    ``hang_initial_timeout_s`` to make progress (imports, JIT builds and the first step are slow);
    after it, the timeout is ``hang_factor`` x the p99 step time seen so far (each incarnation's
    first step interval left out: it carries one-off work), clamped to
    ``[hang_min_timeout_s, hang_max_timeout_s]``.
    """

    where: ClassVar[str] = f"{BLOCK_KEY}.watchdog"

    hang_warmup_steps: Annotated[int, Field(ge=1)] = 10
    """Steps a rank completes before its step times are trusted to learn the hang timeout."""

    hang_factor: Annotated[float, Field(ge=1, allow_inf_nan=False), Hint(
        rule="must be >= 1 (and finite): a timeout shorter than the p99 step time would declare "
             "healthy steps hung")] = 10.0
    """The learned hang timeout is this many times the p99 step time (at least 1)."""

    hang_min_timeout_s: _Seconds = 30.0
    """Floor of the learned hang timeout: a job with 10 ms steps must not be declared hung after
    a 100 ms hiccup (garbage collection, a checkpoint save)."""

    hang_max_timeout_s: _Seconds = 480.0
    """Ceiling of the learned timeout, and the longest any rank may go without progress. With the
    stack dump and a 60 s margin it stays under NCCL's default 600 s process-group timeout, so
    a hang is judged before NCCL aborts the ranks; ``robust run`` exports the timeout scripts
    need for larger values (``robust_plugins.watchdog.pg_timeout``)."""

    hang_initial_timeout_s: _Seconds = 480.0
    """Timeout before warm-up, counted from the start of an incarnation (or the last step); kept
    under the process-group timeout as ``hang_max_timeout_s`` is."""

    stack_dump_timeout_s: _Seconds = 15.0
    """Bound on collecting every rank's Python stack after a hang (py-spy, then faulthandler)."""

    nan_check: bool = True
    """Treat a NaN or Inf loss or gradient norm reported by a rank as a fault (rollback by
    restart from the newest checkpoint)."""

    restart_backoff_s: _Wait = 0.0
    """Seconds to wait after stopping the ranks before the first restart; the wait doubles with
    every further restart, up to ``restart_backoff_max_s``. 0 restarts at once."""

    restart_backoff_max_s: _Wait = 60.0
    """Ceiling of the restart wait."""

    spike_factor: _Factor = 10.0
    """A loss or gradient norm above this many times its running median is a spike (rollback by
    restart from the newest checkpoint). 0 turns spike detection off."""

    spike_window: int = 50
    """Reported values per rank and metric in the running median."""

    spike_warmup_steps: int = 20
    """Values a rank must have reported before spikes are judged (at most ``spike_window``)."""

    spike_skip_batch: bool = True
    """A step that spikes again after the rollback (the same step number, in a later incarnation)
    has a bad batch: it is recorded in ``<run_dir>/skip_steps.json`` and the restarted ranks are
    told to skip it (``robust_plugins.watchdog.skip_batch(step)`` returns True there)."""

    sdc_every_steps: Annotated[int, Field(ge=0), Hint(why="(0: off)")] = 100
    """``robust_plugins.watchdog.check_params`` hashes the parameters every this many steps (64-bit
    hash, compared across the replicas on a node; a minority hash is silent data corruption).
    0 turns the check off."""

    sdc_replay: bool = True
    """After an SDC rollback, the replayed check of the same step is the verdict: the replicas
    agree now (a transient fault: recorded, the ranks stay) or the same ranks differ again (a
    persistent fault: action ``evict``; a single-node job stops, a multi-node job's node is blamed
    again). Recorded in the fault's ``detail.replay`` and an evidence file ``sdc/replay-*.json``."""

    straggler_factor: _Factor = 2.0
    """A rank whose median compute time per step (step time minus time inside torch.distributed
    collectives) over the last ``straggler_window`` steps exceeds this many times the median of
    its peers' (the node's other ranks; of its group only when ranks name one with
    ``watchdog.straggler_group``, as megatron-core's pipeline stages do) is a straggler: one
    ``faults.jsonl`` row per episode, written when it ends (its duration, slow steps and ratio;
    action ``report``: no restart). 0 turns the detector off."""

    straggler_window: Annotated[int, Field(ge=3), Hint(why="(a median of fewer steps is one slow step)")] = 20
    """Steps per rank in the straggler medians; nothing is judged before every rank has this many.
    A straggler's episode ends after this many of its steps in a row were not slow."""

    straggler_min_s: _Wait = 10.0
    """A straggler episode is warned about and reported only if the detector kept naming the rank
    while its slow run spanned this many seconds (onset to latest slow step); one it stops naming
    sooner is a blip of a shared machine (another job's burst, a page-cache flush) and is dropped
    (logged at INFO). 0 reports every episode."""

    straggler_gap_s: _Wait = 60.0
    """A straggler episode ends only after ``straggler_window`` fast steps in a row that also span
    this many seconds since its last slow step; a rank that slows again sooner stays in the same
    episode. With ``straggler_min_s`` this bounds the rows to one per rank per ``straggler_min_s +
    straggler_gap_s`` seconds, however a noisy machine hovers around the bar. 0: steps alone decide."""

    exclude_after_blames: Annotated[int, Field(ge=0), Hint(why="(0: never exclude a node)")] = 2
    """Multi-node jobs (``--nnodes MIN:MAX`` > 1, c10d rendezvous): a node blamed for this many
    faults (a crash by a signal or an injected one, an SDC minority on its ranks, or a hang whose
    flight recorder shows its rank stuck outside every collective; see
    ``launcher/nodes.py``) is excluded: written to ``excluded_nodes.json`` and refused at the next
    rendezvous (its agent exits 3); the others continue within ``MIN:MAX``. 0 turns exclusion off."""

    emergency_save_timeout_s: Annotated[_Wait, Hint(why="(0: no emergency saves)")] = 30.0
    """After a crash, how long the live ranks that registered an emergency saver
    (``robust_plugins.watchdog.on_emergency``) may take to save before the agent stops them (and
    the longest such a rank spends saving). 0: no emergency saves."""

    @field_validator("spike_factor", "straggler_factor")
    @classmethod
    def _off_or_above_one(cls, value: float) -> float:
        if 0 < value <= 1:
            raise ValueError(_OFF_OR_ABOVE_ONE)
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> "WatchdogConfig":
        where = self.where
        if self.hang_min_timeout_s > self.hang_max_timeout_s:
            raise ConfigError(
                f"{where}.hang_min_timeout_s ({num(self.hang_min_timeout_s)}) must be <= "
                f"hang_max_timeout_s ({num(self.hang_max_timeout_s)})."
            )
        if not self.hang_min_timeout_s <= self.hang_initial_timeout_s <= self.hang_max_timeout_s:
            raise ConfigError(
                f"{where}.hang_initial_timeout_s ({num(self.hang_initial_timeout_s)}) must lie between "
                f"hang_min_timeout_s ({num(self.hang_min_timeout_s)}) and hang_max_timeout_s "
                f"({num(self.hang_max_timeout_s)})."
            )
        if self.restart_backoff_s > self.restart_backoff_max_s:
            raise ConfigError(
                f"{where}.restart_backoff_s ({num(self.restart_backoff_s)}) must be <= "
                f"restart_backoff_max_s ({num(self.restart_backoff_max_s)})."
            )
        if not 1 <= self.spike_warmup_steps <= self.spike_window:
            raise ConfigError(
                f"{where}.spike_warmup_steps ({self.spike_warmup_steps}) must lie between 1 and "
                f"spike_window ({self.spike_window})."
            )
        return self

    def describe(self) -> str:
        """One-line summary for logs and ``robust check-config``."""
        return (
            f"watchdog(hang_timeout={self.hang_factor:g} x p99 step in "
            f"[{self.hang_min_timeout_s:g}, {self.hang_max_timeout_s:g}] s after "
            f"{self.hang_warmup_steps} steps, {self.hang_initial_timeout_s:g} s before; "
            f"nan_check={self.nan_check}, spike_factor={self.spike_factor:g}, "
            f"sdc_every_steps={self.sdc_every_steps}, straggler_factor={self.straggler_factor:g})"
        )

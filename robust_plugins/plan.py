"""ETTR at scale: a pure model of effective training time and the best snapshot intervals.

ETTR (effective training time ratio) = time spent in steps that survive into the final model /
wall time. For a synchronous job of ``gpus`` GPUs whose faults arrive at random (a Poisson
process of rate ``lam = gpus * failures_per_gpu_hour / 3600`` a second) the wall time of a job
of wall length ``T`` splits into

* the first start, once: ``start_s``;
* per fault ``C = detect(kind) + recovery_s + lost(kind)``: detection, the restart until the
  first step (warm or cold), and the steps trained again (half the interval between restore
  points on average, plus one step for a rollback kind, whose last update is the bad one);
* per step, what the restore points block: ``snapshot_block_s / memory_every +
  persist_block_s / persist_every`` (plus ``overhead_per_step_s``), on top of ``step_s``.

So ``ETTR = (1 - lam * E[C] - start_s / T) * step_s / (step_s + per-step overhead)``, clamped at
0 when faults come faster than the job recovers (``lam * E[C] >= 1``: it never progresses).

The best intervals are Young-Daly's (J. W. Young, CACM 1974; J. T. Daly, FGCS 2006): for a
restore point that blocks ``delta`` seconds and failures ``M`` seconds apart, checkpoint every
``sqrt(2 * delta * M)`` seconds of compute. Two levels: memory snapshots serve the faults they
can (``1 - disk_share``), disk checkpoints the rest (a lost node without a peer copy, a node and
its peer lost together, a relaunch), each with its own ``M``.

Nothing here touches a process or a file: ``robust plan`` (``robust_plugins/cli/plan.py``) is
the thin command, and ``tests/unit/test_ettr.py`` checks the model at 1k-100k GPUs and against
the measured 10-minute run of ``BENCHMARKS.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from robust_plugins.errors import ConfigError

#: Fault kinds of ``robust run`` (``watchdog/FORMAT.md``); ``ROLLBACK_KINDS`` restore a step
#: before the fault's (the update of the faulty step is the bad one).
KINDS = ("crash", "hang", "nan", "spike", "sdc")
ROLLBACK_KINDS = ("nan", "spike", "sdc")

#: Meta, "The Llama 3 Herd of Models" (2024), section 3.3.4 and Table 5: 419 unexpected
#: interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
LLAMA3_FAILURES_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)  # 1.97e-5

#: The same Table 5 by this project's kinds: "NCCL watchdog timeouts" (7) are hangs, "silent data
#: corruption" (6) is sdc, the other 406 (faulty GPU, HBM3, software bugs, network, host ...) end
#: or lose a process: crash. The table names no NaN or loss spike.
LLAMA3_MIX = {"crash": 406 / 419, "hang": 7 / 419, "sdc": 6 / 419}


@dataclass(frozen=True)
class Costs:
    """What one fault and one restore point cost, in seconds (this project's measurements by
    default: ``robust_plugins/cli/plan.py`` names each source in ``BENCHMARKS.md``)."""

    detect_s: Mapping[str, float]
    """Fault onset to detection, per kind (``KINDS``)."""
    recovery_s: float
    """Detection to the first step of the restarted job (process start, process group, engine,
    restore)."""
    start_s: float = 0.0
    """Launch to the first step, once per job."""
    snapshot_block_s: float = 0.0
    """What one memory snapshot blocks the step."""
    persist_block_s: float = 0.0
    """What one disk checkpoint blocks the step."""
    overhead_per_step_s: float = 0.0
    """Other work every step pays outside the timed step (logging, ...)."""

    def __post_init__(self) -> None:
        for kind, value in self.detect_s.items():
            if kind not in KINDS:
                raise ConfigError(f"detection time for unknown fault kind {kind!r}; kinds: {', '.join(KINDS)}.")
            _nonneg(f"detect_s[{kind}]", value)
        for name in ("recovery_s", "start_s", "snapshot_block_s", "persist_block_s", "overhead_per_step_s"):
            _nonneg(name, getattr(self, name))


@dataclass(frozen=True)
class Job:
    """The cluster and the training job."""

    gpus: int
    failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    step_s: float = 1.0
    """Wall time of one training step (what the step's work takes, before restore points)."""
    mix: Mapping[str, float] = field(default_factory=lambda: dict(LLAMA3_MIX))
    """Share of each fault kind (sums to 1)."""
    wall_s: float = LLAMA3_DAYS * 86_400.0
    """Wall length of the job, over which ``start_s`` is paid once."""

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ConfigError(f"gpus = {self.gpus!r} must be an integer >= 1.")
        _nonneg("failures_per_gpu_hour", self.failures_per_gpu_hour)
        _positive("step_s", self.step_s)
        _positive("wall_s", self.wall_s)
        if not self.mix:
            raise ConfigError("the fault mix is empty: give at least one kind's share, e.g. crash=1.")
        for kind, share in self.mix.items():
            if kind not in KINDS:
                raise ConfigError(f"fault mix: unknown kind {kind!r}; kinds: {', '.join(KINDS)}.")
            _nonneg(f"mix[{kind}]", share)
        total = sum(self.mix.values())
        if abs(total - 1.0) > 1e-6:
            raise ConfigError(f"fault mix shares sum to {total:g}, not 1: {dict(self.mix)}.")

    @property
    def faults_per_s(self) -> float:
        """The whole job's fault rate."""
        return self.gpus * self.failures_per_gpu_hour / 3600.0

    @property
    def mtbf_s(self) -> float:
        """Mean time between the job's faults (inf without faults)."""
        return math.inf if self.faults_per_s == 0 else 1.0 / self.faults_per_s


@dataclass(frozen=True)
class Projection:
    """What :func:`ettr` projects for one job, costs and pair of intervals."""

    ettr: float
    memory_every: int | None
    persist_every: int | None
    mtbf_s: float
    fault_cost_s: float
    """Expected wall seconds one fault costs (detection + recovery + steps trained again)."""
    lost_s: float
    """Of that, the steps trained again."""
    overhead: float
    """Per-step overhead of the restore points, as a fraction of ``step_s``."""
    stalled: bool
    """Faults come faster than the job recovers from them (``ettr`` is 0)."""


def ettr(job: Job, costs: Costs, memory_every: int | None, persist_every: int | None,
         disk_share: float = 0.0) -> Projection:
    """ETTR of ``job`` with memory snapshots every ``memory_every`` steps and disk checkpoints
    every ``persist_every`` steps (None: off). ``disk_share``: faults memory cannot restore
    (1 without memory snapshots)."""
    _interval("memory_every", memory_every)
    _interval("persist_every", persist_every)
    _share("disk_share", disk_share)
    if memory_every is None and persist_every is None:
        raise ConfigError("no restore point: every fault would restart from step 0. Set memory_every "
                          "(memory snapshots) or persist_every (disk checkpoints).")
    missing = [k for k, share in job.mix.items() if share > 0 and k not in costs.detect_s]
    if missing:
        raise ConfigError(f"no detection time for fault kind(s) {missing}, which the mix has; give them.")
    if memory_every is None:
        disk_share = 1.0
    if persist_every is None and disk_share > 0:
        raise ConfigError(f"disk_share = {disk_share:g} of the faults need a disk checkpoint and persist_every "
                          f"is off; set persist_every, or disk_share = 0 (every fault restores from memory).")
    per_step = costs.overhead_per_step_s
    per_step += costs.snapshot_block_s / memory_every if memory_every else 0.0
    per_step += costs.persist_block_s / persist_every if persist_every else 0.0
    step = job.step_s + per_step
    back = {"memory": memory_every or 0, "disk": persist_every or 0}
    lost_between = ((1 - disk_share) * back["memory"] + disk_share * back["disk"]) / 2.0
    rollback = sum(share for kind, share in job.mix.items() if kind in ROLLBACK_KINDS)
    lost = (lost_between + rollback) * step
    detect = sum(share * costs.detect_s.get(kind, 0.0) for kind, share in job.mix.items())
    fault_cost = detect + costs.recovery_s + lost
    busy = job.faults_per_s * fault_cost + costs.start_s / job.wall_s
    value = max(0.0, (1.0 - busy) * job.step_s / step)
    return Projection(ettr=value, memory_every=memory_every, persist_every=persist_every, mtbf_s=job.mtbf_s,
                      fault_cost_s=fault_cost, lost_s=lost, overhead=per_step / job.step_s, stalled=busy >= 1.0)


def young_daly_s(block_s: float, mtbf_s: float) -> float:
    """Young-Daly's interval of compute between restore points, ``sqrt(2 * block_s * mtbf_s)``."""
    _nonneg("block_s", block_s)
    _positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * block_s * mtbf_s)


def best_intervals(job: Job, costs: Costs, disk_share: float, memory: bool = True,
                   max_steps: int = 10**9) -> tuple[int | None, int | None]:
    """Young-Daly's ``(memory_every, persist_every)`` in steps (at least 1, at most
    ``max_steps``; None where that level serves no fault: no memory snapshots, or
    ``disk_share`` 0)."""
    _share("disk_share", disk_share)
    share = {"memory": 1.0 - disk_share if memory else 0.0, "disk": disk_share if memory else 1.0}
    block = {"memory": costs.snapshot_block_s, "disk": costs.persist_block_s}
    out: dict[str, int | None] = {}
    for level in ("memory", "disk"):
        rate = job.faults_per_s * share[level]
        if share[level] == 0:
            out[level] = None
        elif rate == 0:
            out[level] = max_steps
        else:
            steps = young_daly_s(block[level], 1.0 / rate) / job.step_s
            out[level] = int(min(max_steps, max(1, round(steps))))
    return out["memory"], out["disk"]


def plan(job: Job, costs: Costs, disk_share: float, memory: bool = True) -> Projection:
    """ETTR at Young-Daly's intervals (:func:`best_intervals`)."""
    mem, disk = best_intervals(job, costs, disk_share, memory=memory)
    return ettr(job, costs, mem, disk, disk_share=disk_share if memory else 1.0)


def _nonneg(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} = {value!r} must be a finite number >= 0.")


def _positive(name: str, value) -> None:
    _nonneg(name, value)
    if value <= 0:
        raise ConfigError(f"{name} = {value!r} must be > 0.")


def _share(name: str, value) -> None:
    _nonneg(name, value)
    if value > 1:
        raise ConfigError(f"{name} = {value!r} is a share of the faults: between 0 and 1.")


def _interval(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} = {value!r} must be an integer number of steps >= 1 (or off).")

"""The one config schema for the ``robust_plugins`` block.

The same frozen dataclasses are built from a DeepSpeed JSON config (``"robust_plugins": {...}``),
from keyword arguments (megatron-core and plain PyTorch users) and by ``robust check-config``.
Every user mistake raises :class:`~robust_plugins.errors.ConfigError` naming the key, the bad value
and what is allowed; unknown keys get a "did you mean".

Environment variables (all in one place, all with the ``ROBUST_`` prefix). Set by users:

=============================  ======================================================================
``ROBUST_CODEC``               replaces ``compression.codec`` (e.g. ``none`` to bisect a run)
``ROBUST_DISABLE=1``           ignores the whole block: the host behaves exactly as without it
``ROBUST_JOB_ID``              names a job's in-memory snapshots (same across restarts; ``robust run``
                               sets it from the run directory when unset)
``ROBUST_TOPOLOGY_SIM=NxM``    simulated topology, N nodes x M ranks (``robust_plugins.topology``)
``ROBUST_TRITON_ON_CPU=1``     with ``TRITON_INTERPRET=1``: run the Triton kernels on CPU tensors
``ROBUST_WATCHDOG_NO_PYSPY=1`` hang stacks via faulthandler instead of py-spy
=============================  ======================================================================

Set by ``robust run`` for its ranks (read by ``robust_plugins.watchdog.client``; not for users):
``ROBUST_WATCHDOG_SOCKET``, ``ROBUST_WATCHDOG_RING`` (path prefix of the ranks' shared-memory
step rings), ``ROBUST_RUN_DIR``, ``ROBUST_INJECT``, ``ROBUST_INCARNATION``,
``ROBUST_SDC_EVERY``, ``ROBUST_ROLLBACK_MAX_STEP`` (newest step a rollback's ranks may restore
from memory), ``ROBUST_STRAGGLER`` (1: time collectives for the straggler detector),
``ROBUST_SKIP_STEPS`` (steps whose batch spiked twice: ``watchdog.skip_batch``),
``ROBUST_LAUNCH_WORLD_SIZE`` (world size of the job's first incarnation: ``watchdog.grad_accumulation``
says how accumulation changed after a ``--nnodes MIN:MAX`` shrink), ``ROBUST_EMERGENCY_TIMEOUT_S``
(bound of a rank's emergency save: ``watchdog.on_emergency``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from robust_plugins.errors import ConfigError

#: The top-level key of the block in a DeepSpeed JSON config.
BLOCK_KEY = "robust_plugins"

#: Codecs, in order of increasing compression. ``none`` runs the plugin's path with the host's own
#: collective (bitwise identical to vanilla); the others use the two-phase compressed all-reduce.
CODECS = ("none", "bf16", "int8", "int4", "sign")

#: Codecs that need ``error_feedback``: 1 bit an element loses too much for SGD-style updates
#: to converge without the residual (1-bit Adam, EF-SignSGD).
CODECS_REQUIRING_EF = ("sign",)

#: ``compression.sign_mode``: 1-bit codes of the gradient (any optimizer) or of Adam's momentum
#: after a full-precision freeze phase (1-bit Adam).
SIGN_MODES = ("gradient", "momentum")

#: ``compression.codec = "auto"``: measure the link and each codec's cost, then pick per bucket
#: size among ``auto_candidates`` (``robust_plugins.comm.autocodec``).
AUTO_CODEC = "auto"
#: An ``auto`` candidate that is no codec of the two-phase collectives: the host's plain all-reduce
#: on a bf16 copy (DeepSpeed's ``communication_data_type: bf16``), with error feedback of the cast
#: (``robust_plugins.comm.collectives.bf16_all_reduce``); a flat route only.
BF16_ALLREDUCE = "bf16_allreduce"
AUTO_CANDIDATES = ("none", "bf16", BF16_ALLREDUCE, "int8", "int4")

#: ``compression.bucket_mb`` unless set (DeepSpeed ZeRO 0's planned buckets).
DEFAULT_BUCKET_MB = 4.0

BLOCK_SIZE_MIN = 32
BLOCK_SIZE_MAX = 4096

ENV_OVERRIDES = {
    "ROBUST_CODEC": "compression.codec",
    "ROBUST_DISABLE": "(whole block)",
}


def _did_you_mean(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _check_keys(where: str, raw: Mapping[str, Any], allowed: list[str]) -> None:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}: {raw!r}.")
    for key in raw:
        if key not in allowed:
            raise ConfigError(
                f"Unknown key {where}.{key}.{_did_you_mean(str(key), allowed)} "
                f"Allowed keys: {', '.join(allowed)}."
            )


def _check_optional_dir(section: Any, where: str) -> None:
    """``section.dir``: None, or a non-empty path (an ``os.PathLike`` is stored as its string)."""
    if section.dir is None:
        return
    if isinstance(section.dir, os.PathLike):
        object.__setattr__(section, "dir", os.fspath(section.dir))
    _expect_type(f"{where}.dir", section.dir, (str,), "a directory path (string)")
    if not section.dir:
        raise ConfigError(f"{where}.dir = '' is empty: give a directory path or leave it out.")


def _expect_type(where: str, value: Any, types: tuple[type, ...], what: str) -> Any:
    # bool is an int subclass: `"warmup_steps": true` is a mistake, not 1.
    if isinstance(value, bool) and bool not in types:
        raise ConfigError(f"{where} must be {what}, got a boolean: {value!r}.")
    if not isinstance(value, types):
        raise ConfigError(f"{where} must be {what}, got {type(value).__name__}: {value!r}.")
    return value


@dataclass(frozen=True)
class CompressionConfig:
    """Compressed data-parallel gradient all-reduce (``"compression"`` sub-block)."""

    codec: str = "int8"
    """Wire format: ``none`` (host collective, bitwise identical), ``bf16``, ``int8`` (blockwise
    absmax), ``int4`` (two values a byte, blockwise absmax), ``sign`` (1 bit an element plus one
    scale a block) or ``auto`` (chosen per bucket size from measured link and encode costs; see the
    ``auto_*`` keys)."""

    block_size: int = 256
    """Elements sharing one fp32 scale. A power of two in [32, 4096]; 256 costs 1.6 % extra bytes."""

    error_feedback: bool = True
    """Keep each rank's quantization residual and add it to the next gradient (both on the sending
    side and on the reducing side). Residuals are training state and go into checkpoints."""

    warmup_steps: int = 0
    """Optimizer steps sent uncompressed (through the host's own collective) before compressing."""

    min_numel: int = 0
    """Buckets with fewer elements than this go uncompressed: for tiny buckets latency, not bytes,
    dominates and the per-block scale overhead is largest."""

    sign_mode: str = "gradient"
    """``sign`` only: what travels as 1-bit codes. ``gradient`` (default): each gradient bucket, in
    place of the host's all-reduce, under any optimizer. ``momentum``: 1-bit Adam (Tang et al.
    2021): plain fp32 Adam for ``freeze_steps`` optimizer steps, then Adam's second moment is frozen
    and each rank's local momentum is averaged in 1-bit codes instead of the gradient (ZeRO 0, fp32,
    ``torch.optim.Adam``/``AdamW`` only). Costs +2 % loss where ``gradient`` costs +14 %
    (BENCHMARKS.md)."""

    freeze_steps: int = 0
    """``sign_mode: momentum`` only, and required there (>= 1): optimizer steps of uncompressed
    fp32 Adam before the second moment is frozen and the momentum goes 1-bit. These steps send full
    fp32 gradients; 1-bit Adam used 15-25 % of training."""

    auto_candidates: tuple = AUTO_CANDIDATES
    """``auto`` only: codecs it may choose among (``none`` always is one); a list of
    ``none``, ``bf16``, ``bf16_allreduce``, ``int8``, ``int4``. ``bf16`` is the two-phase codec (fp32
    sums, both roundings fed back); ``bf16_allreduce`` is one bf16 all-reduce of the whole bucket
    (bf16 sums in the backend; the cast's rounding fed back when ``error_feedback``), flat only."""

    auto_link_gbit: float | None = None
    """``auto`` only: the inter-node link rate in Gbit/s if known; ``null`` measures it with one
    4 MB fp32 all-reduce per probe (and, with ``topology.hierarchical``, times the candidate
    routes on the real bucket; a given rate leaves the choice to the cost model alone)."""

    auto_recheck_steps: int = 1000
    """``auto`` only: measure again (and re-decide) every this many optimizer steps; 0: only at
    the first step."""

    auto_min_gain: float = 0.1
    """``auto`` only: a codec replaces ``none`` only when predicted at least this fraction faster
    (hysteresis against measurement noise on fast links, where compression must stay off)."""

    auto_max_error: float = 0.1
    """``auto`` only, the quality guard: codecs whose measured relative error on the real bucket
    (one quantization round trip) exceeds this are never chosen. int8 measures about 0.01 and
    bf16 0.003 on gradients, int4 about 0.15, so the default admits bf16 and int8, not int4."""

    auto_bf16_error_feedback: bool = False
    """``auto`` only: feed back the rounding of the ``bf16_allreduce`` route's cast (a residual per
    bucket, checkpointed). Off by default: that route is then exactly DeepSpeed's
    ``communication_data_type: bf16`` (and megatron-core's bf16 gradient reduction), whose rounding
    is relative to each element (at most 2**-9), unlike int8/int4's block-shared scale that zeroes
    small elements; the feedback costs three more passes over the bucket, which on the simulator's
    10 Gbit/s link doubled the route's time and made ``auto`` keep fp32 where bf16 was 13-19 %
    faster (BENCHMARKS.md)."""

    overlap: bool | None = None
    """DeepSpeed ZeRO 0, with a compressing codec or ``topology.hierarchical``: start each gradient
    bucket's reduction during backward, as soon as backward has finished all of the bucket's
    gradients (on the gradient-accumulation boundary only), on one background thread with its own
    clones of the process groups; DeepSpeed's reduction point then waits for every bucket. The
    buckets, their order and their codes are those of the reduction after backward, so the
    result is bitwise the same. ``null`` (default): on where supported, with a log line naming
    why where not (ZeRO 1/2, MoE, sparse gradients, DeepSpeed's bf16 optimizer, unmanaged
    gradient accumulation); ``true``: such engines are refused; ``false``: reduce after backward.
    megatron-core overlaps when its own ``overlap_grad_reduce`` is set: an explicit value here
    must agree with it."""

    bucket_mb: float = DEFAULT_BUCKET_MB
    """DeepSpeed ZeRO 0, with a compressing codec or ``topology.hierarchical``: gradients are
    reduced in buckets of at least this many MB (fp32: 4 bytes an element), parameters taken in
    reverse order of registration (the order backward finishes them) and cut at parameter
    boundaries and dtype changes. Smaller buckets start earlier in backward and leave less to
    reduce after it; each costs a collective's latency (and with ``auto`` its own trial runs at
    its first step). DeepSpeed's own ZeRO 0 path reduces in 500M-element buckets; 4 MB buckets
    made the 6.6M-parameter GPT's step 1.4x faster than one bucket (BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        where = f"{BLOCK_KEY}.compression"
        _expect_type(f"{where}.codec", self.codec, (str,), "a string")
        if self.codec not in CODECS + (AUTO_CODEC,):
            hint = _did_you_mean(self.codec, list(CODECS) + [AUTO_CODEC])
            raise ConfigError(
                f"{where}.codec = {self.codec!r} is not a known codec.{hint} "
                f"Allowed: {', '.join(CODECS)}, {AUTO_CODEC}."
            )
        cands = self.auto_candidates
        if isinstance(cands, str) or not isinstance(cands, (list, tuple)) or not cands or any(
                c not in AUTO_CANDIDATES for c in cands):
            raise ConfigError(
                f"{where}.auto_candidates = {cands!r} must be a non-empty list of "
                f"{', '.join(AUTO_CANDIDATES)}."
            )
        object.__setattr__(self, "auto_candidates", tuple(cands))
        if self.auto_link_gbit is not None:
            value = _expect_type(f"{where}.auto_link_gbit", self.auto_link_gbit, (int, float), "a number or null")
            if not 0 < value < float("inf"):
                raise ConfigError(f"{where}.auto_link_gbit = {value!r} must be a finite number > 0 (or null).")
        _expect_type(f"{where}.auto_recheck_steps", self.auto_recheck_steps, (int,), "an integer")
        if self.auto_recheck_steps < 0:
            raise ConfigError(f"{where}.auto_recheck_steps = {self.auto_recheck_steps} must be >= 0 (0: never).")
        for name in ("auto_min_gain", "auto_max_error"):
            value = _expect_type(f"{where}.{name}", getattr(self, name), (int, float), "a number")
            if not 0 <= value < 1:
                raise ConfigError(f"{where}.{name} = {value!r} must lie in [0, 1).")
        _expect_type(f"{where}.auto_bf16_error_feedback", self.auto_bf16_error_feedback, (bool,), "true or false")
        _expect_type(f"{where}.block_size", self.block_size, (int,), "an integer")
        bs = self.block_size
        if not (BLOCK_SIZE_MIN <= bs <= BLOCK_SIZE_MAX) or bs & (bs - 1):
            raise ConfigError(
                f"{where}.block_size = {bs} is not allowed: it must be a power of two between "
                f"{BLOCK_SIZE_MIN} and {BLOCK_SIZE_MAX} (e.g. 256)."
            )
        _expect_type(f"{where}.error_feedback", self.error_feedback, (bool,), "true or false")
        if self.codec in CODECS_REQUIRING_EF and not self.error_feedback:
            raise ConfigError(
                f"{where}.codec = {self.codec!r} requires error_feedback = true: without the "
                f"residual, 1-bit gradients do not converge. Set error_feedback to true or pick "
                f"int8 / int4."
            )
        _expect_type(f"{where}.warmup_steps", self.warmup_steps, (int,), "an integer")
        if self.warmup_steps < 0:
            raise ConfigError(
                f"{where}.warmup_steps = {self.warmup_steps} must be >= 0 (0 compresses from the "
                f"first step)."
            )
        _expect_type(f"{where}.min_numel", self.min_numel, (int,), "an integer")
        if self.min_numel < 0:
            raise ConfigError(f"{where}.min_numel = {self.min_numel} must be >= 0.")
        self._check_sign_mode(where)
        if self.overlap is not None:
            _expect_type(f"{where}.overlap", self.overlap, (bool,), "true, false or null")
        value = _expect_type(f"{where}.bucket_mb", self.bucket_mb, (int, float), "a number (MB)")
        if not 0 < value < float("inf"):
            raise ConfigError(f"{where}.bucket_mb = {value!r} must be a finite number of MB > 0 (e.g. 4).")
        if self.overlap and self.sign_mode == "momentum":
            raise ConfigError(f"{where}.overlap = true does not apply to sign_mode = 'momentum' (1-bit Adam "
                              f"sends the momentum after the optimizer's step, not gradients during "
                              f"backward); remove overlap or use sign_mode 'gradient'.")

    def _check_sign_mode(self, where: str) -> None:
        _expect_type(f"{where}.sign_mode", self.sign_mode, (str,), "a string")
        if self.sign_mode not in SIGN_MODES:
            raise ConfigError(f"{where}.sign_mode = {self.sign_mode!r} is not known.{_did_you_mean(self.sign_mode, list(SIGN_MODES))} "
                              f"Allowed: {', '.join(SIGN_MODES)}.")
        _expect_type(f"{where}.freeze_steps", self.freeze_steps, (int,), "an integer")
        if self.sign_mode != "momentum":
            if self.freeze_steps:
                raise ConfigError(f"{where}.freeze_steps = {self.freeze_steps} applies only to sign_mode = "
                                  f"'momentum' (this block has sign_mode = {self.sign_mode!r}); remove it or set "
                                  f"codec 'sign' with sign_mode 'momentum'.")
            return
        if self.codec != "sign":
            raise ConfigError(f"{where}.sign_mode = 'momentum' needs codec = 'sign', got codec = {self.codec!r} "
                              f"(ROBUST_CODEC overrides the codec: unset it, or drop sign_mode).")
        if self.freeze_steps < 1:
            raise ConfigError(f"{where}.freeze_steps = {self.freeze_steps}: sign_mode = 'momentum' needs at least "
                              f"one full-precision Adam step to estimate the second moment it then freezes; "
                              f"set it >= 1 (e.g. 20, a fifth of a 100-step run).")
        if self.warmup_steps or self.min_numel:
            raise ConfigError(f"{where}: sign_mode = 'momentum' sends the whole momentum as one buffer after "
                              f"freeze_steps, so warmup_steps ({self.warmup_steps}) and min_numel "
                              f"({self.min_numel}) must be 0; use freeze_steps for the uncompressed start.")

    @property
    def compresses(self) -> bool:
        """True when the codec sends (or, for ``auto``, may send) other than the host's collective."""
        return self.codec != "none"

    def describe(self) -> str:
        """One-line summary for logs and ``robust check-config``."""
        auto = (f"auto_candidates={','.join(self.auto_candidates)}, auto_link_gbit={self.auto_link_gbit}, "
                f"auto_recheck_steps={self.auto_recheck_steps}, auto_min_gain={self.auto_min_gain:g}, "
                f"auto_max_error={self.auto_max_error:g}, "
                + ("auto_bf16_error_feedback=True, " if self.auto_bf16_error_feedback else "")
                if self.codec == AUTO_CODEC else "")
        return (
            f"compression(codec={self.codec}, {auto}block_size={self.block_size}, "
            f"error_feedback={self.error_feedback}, warmup_steps={self.warmup_steps}, "
            f"min_numel={self.min_numel}"
            + (f", sign_mode=momentum, freeze_steps={self.freeze_steps}" if self.sign_mode == "momentum" else "")
            + (f", overlap={self.overlap}" if self.overlap is not None else "")
            + (f", bucket_mb={self.bucket_mb:g}" if self.bucket_mb != DEFAULT_BUCKET_MB else "")
            + ")"
        )


@dataclass(frozen=True)
class WatchdogConfig:
    """Fault detection under ``robust run`` (``"watchdog"`` sub-block).

    Hang timeouts are learned: before ``hang_warmup_steps`` steps every rank has
    ``hang_initial_timeout_s`` to make progress (imports, JIT builds and the first step are slow);
    after it, the timeout is ``hang_factor`` x the p99 step time seen so far, clamped to
    ``[hang_min_timeout_s, hang_max_timeout_s]``.
    """

    hang_warmup_steps: int = 10
    """Steps a rank completes before its step times are trusted to learn the hang timeout."""

    hang_factor: float = 10.0
    """The learned hang timeout is this many times the p99 step time (at least 1)."""

    hang_min_timeout_s: float = 30.0
    """Floor of the learned hang timeout: a job with 10 ms steps must not be declared hung after
    a 100 ms hiccup (garbage collection, a checkpoint save)."""

    hang_max_timeout_s: float = 600.0
    """Ceiling of the learned timeout, and the longest any rank may go without progress."""

    hang_initial_timeout_s: float = 600.0
    """Timeout before warm-up, counted from the start of an incarnation (or the last step)."""

    stack_dump_timeout_s: float = 15.0
    """Bound on collecting every rank's Python stack after a hang (py-spy, then faulthandler)."""

    nan_check: bool = True
    """Treat a NaN or Inf loss or gradient norm reported by a rank as a fault (rollback by
    restart from the newest checkpoint)."""

    restart_backoff_s: float = 0.0
    """Seconds to wait after stopping the ranks before the first restart; the wait doubles with
    every further restart, up to ``restart_backoff_max_s``. 0 restarts at once."""

    restart_backoff_max_s: float = 60.0
    """Ceiling of the restart wait."""

    spike_factor: float = 10.0
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

    sdc_every_steps: int = 100
    """``robust_plugins.watchdog.check_params`` hashes the parameters every this many steps (64-bit
    hash, compared across the replicas on a node; a minority hash is silent data corruption).
    0 turns the check off."""

    sdc_replay: bool = True
    """After an SDC rollback, the replayed check of the same step is the verdict: the replicas
    agree now (a transient fault: recorded, the ranks stay) or the same ranks differ again (a
    persistent fault: action ``evict``; a single-node job stops, a multi-node job's node is blamed
    again). Recorded in the fault's ``detail.replay`` and an evidence file ``sdc/replay-*.json``."""

    straggler_factor: float = 2.0
    """A rank whose median compute time per step (step time minus time inside torch.distributed
    collectives) over the last ``straggler_window`` steps exceeds this many times the median of
    its peers' is reported as a straggler (``faults.jsonl``, action ``report``: no restart).
    0 turns the detector off."""

    straggler_window: int = 20
    """Steps per rank in the straggler medians; nothing is judged before every rank has this many."""

    exclude_after_blames: int = 2
    """Multi-node jobs (``--nnodes MIN:MAX`` > 1, c10d rendezvous): a node blamed for this many
    faults (a crash by a signal or an injected one, or an SDC minority on its ranks; see
    ``watchdog/nodes.py``) is excluded: written to ``excluded_nodes.json`` and refused at the next
    rendezvous (its agent exits 3); the others continue within ``MIN:MAX``. 0 turns exclusion off."""

    emergency_save_timeout_s: float = 30.0
    """After a crash, how long the live ranks that registered an emergency saver
    (``robust_plugins.watchdog.on_emergency``) may take to save before the agent stops them (and
    the longest such a rank spends saving). 0: no emergency saves."""

    def __post_init__(self) -> None:
        where = f"{BLOCK_KEY}.watchdog"
        value = _expect_type(f"{where}.emergency_save_timeout_s", self.emergency_save_timeout_s,
                             (int, float), "a number")
        if not 0 <= value < float("inf"):
            raise ConfigError(f"{where}.emergency_save_timeout_s = {value!r} must be a finite number "
                              f">= 0 (0: no emergency saves).")
        _expect_type(f"{where}.exclude_after_blames", self.exclude_after_blames, (int,), "an integer")
        if self.exclude_after_blames < 0:
            raise ConfigError(f"{where}.exclude_after_blames = {self.exclude_after_blames} must be "
                              f">= 0 (0: never exclude a node).")
        _expect_type(f"{where}.hang_warmup_steps", self.hang_warmup_steps, (int,), "an integer")
        if self.hang_warmup_steps < 1:
            raise ConfigError(f"{where}.hang_warmup_steps = {self.hang_warmup_steps} must be >= 1.")
        for name in ("hang_factor", "hang_min_timeout_s", "hang_max_timeout_s",
                     "hang_initial_timeout_s", "stack_dump_timeout_s"):
            value = _expect_type(f"{where}.{name}", getattr(self, name), (int, float), "a number")
            if not value > 0 or value != value or value == float("inf"):
                raise ConfigError(f"{where}.{name} = {value!r} must be a finite number > 0.")
        if self.hang_factor < 1:
            raise ConfigError(
                f"{where}.hang_factor = {self.hang_factor} must be >= 1: a timeout shorter than the "
                f"p99 step time would declare healthy steps hung."
            )
        if self.hang_min_timeout_s > self.hang_max_timeout_s:
            raise ConfigError(
                f"{where}.hang_min_timeout_s ({self.hang_min_timeout_s}) must be <= "
                f"hang_max_timeout_s ({self.hang_max_timeout_s})."
            )
        if not self.hang_min_timeout_s <= self.hang_initial_timeout_s <= self.hang_max_timeout_s:
            raise ConfigError(
                f"{where}.hang_initial_timeout_s ({self.hang_initial_timeout_s}) must lie between "
                f"hang_min_timeout_s ({self.hang_min_timeout_s}) and hang_max_timeout_s "
                f"({self.hang_max_timeout_s})."
            )
        _expect_type(f"{where}.nan_check", self.nan_check, (bool,), "true or false")
        for name in ("restart_backoff_s", "restart_backoff_max_s"):
            value = _expect_type(f"{where}.{name}", getattr(self, name), (int, float), "a number")
            if not 0 <= value < float("inf"):
                raise ConfigError(f"{where}.{name} = {value!r} must be a finite number >= 0.")
        if self.restart_backoff_s > self.restart_backoff_max_s:
            raise ConfigError(
                f"{where}.restart_backoff_s ({self.restart_backoff_s}) must be <= "
                f"restart_backoff_max_s ({self.restart_backoff_max_s})."
            )
        value = _expect_type(f"{where}.spike_factor", self.spike_factor, (int, float), "a number")
        if not (value == 0 or 1 < value < float("inf")):
            raise ConfigError(
                f"{where}.spike_factor = {value!r} must be 0 (off) or a finite number > 1."
            )
        for name in ("spike_window", "spike_warmup_steps"):
            _expect_type(f"{where}.{name}", getattr(self, name), (int,), "an integer")
        if not 1 <= self.spike_warmup_steps <= self.spike_window:
            raise ConfigError(
                f"{where}.spike_warmup_steps ({self.spike_warmup_steps}) must lie between 1 and "
                f"spike_window ({self.spike_window})."
            )
        _expect_type(f"{where}.spike_skip_batch", self.spike_skip_batch, (bool,), "true or false")
        _expect_type(f"{where}.sdc_replay", self.sdc_replay, (bool,), "true or false")
        _expect_type(f"{where}.sdc_every_steps", self.sdc_every_steps, (int,), "an integer")
        if self.sdc_every_steps < 0:
            raise ConfigError(f"{where}.sdc_every_steps = {self.sdc_every_steps} must be >= 0 (0: off).")
        value = _expect_type(f"{where}.straggler_factor", self.straggler_factor, (int, float), "a number")
        if not (value == 0 or 1 < value < float("inf")):
            raise ConfigError(
                f"{where}.straggler_factor = {value!r} must be 0 (off) or a finite number > 1."
            )
        _expect_type(f"{where}.straggler_window", self.straggler_window, (int,), "an integer")
        if self.straggler_window < 3:
            raise ConfigError(
                f"{where}.straggler_window = {self.straggler_window} must be >= 3 (a median of fewer "
                f"steps is one slow step)."
            )

    def describe(self) -> str:
        """One-line summary for logs and ``robust check-config``."""
        return (
            f"watchdog(hang_timeout={self.hang_factor:g} x p99 step in "
            f"[{self.hang_min_timeout_s:g}, {self.hang_max_timeout_s:g}] s after "
            f"{self.hang_warmup_steps} steps, {self.hang_initial_timeout_s:g} s before; "
            f"nan_check={self.nan_check}, spike_factor={self.spike_factor:g}, "
            f"sdc_every_steps={self.sdc_every_steps}, straggler_factor={self.straggler_factor:g})"
        )


#: ``checkpoint.verify`` values: ``sha256`` hashes every file on save and checks it on load;
#: ``none`` records and checks sizes only (atomic commit still applies).
VERIFY_MODES = ("sha256", "none")

#: ``checkpoint.memory_copy``: where an in-memory snapshot copies parameters and optimizer state:
#: on the snapshot thread, overlapped with the next forward and backward (the next optimizer step
#: waits for it), or inside the step like everything else.
MEMORY_COPY_MODES = ("background", "in_step")


@dataclass(frozen=True)
class CheckpointConfig:
    """Verified, atomic disk checkpoints (``"checkpoint"`` sub-block).

    With this sub-block, DeepSpeed's ``save_checkpoint`` writes into a temporary directory,
    records every file's size and sha256 in a manifest, and renames the directory into place;
    ``latest`` is updated only afterwards. ``load_checkpoint`` without a tag loads the newest
    checkpoint whose manifest verifies and skips (with one log line each) corrupt, truncated,
    partial or mismatched ones.
    """

    dir: str | None = None
    """Checkpoint directory used when ``save_checkpoint`` / ``load_checkpoint`` are called
    without one (``None``: the caller always passes it). Required by ``persist_every``."""

    persist_every: int | None = None
    """Save a disk checkpoint into ``dir`` automatically after every this many optimizer steps
    (``None``: only when the training script calls ``save_checkpoint``). Synchronous, unless
    ``memory_every`` is set too: then the snapshot thread writes it in the background from the
    committed in-memory snapshot (``robust_plugins.checkpoint.persist``)."""

    keep: int = 3
    """Committed checkpoints kept in a directory: after each save, older ones beyond the ``keep``
    newest intact ones are deleted (directories without a robust_plugins manifest are never
    touched)."""

    verify: str = "sha256"
    """``sha256``: hash every file on save and check every hash before loading. ``none``: check
    only that every file is present with its recorded size (cheaper for very large checkpoints,
    but a flipped bit is not caught)."""

    memory_every: int | None = None
    """Snapshot the whole training state into shared memory (``/dev/shm``, double-buffered,
    survives the death of the process) every this many optimizer steps; ``load_checkpoint``
    restores from it first. Needs a job id stable across restarts (``robust run`` or
    ``ROBUST_JOB_ID``). ``None``: off."""

    peer_backup: bool = False
    """With ``memory_every``: also copy each rank's snapshot into the shared memory of a rank on
    another node (outside its model-parallel groups when the layout allows), so a restart after
    losing a whole node restores from the peers."""

    memory_copy: str = "background"
    """With ``memory_every``: ``background`` copies parameters and optimizer state (which only the
    optimizer step changes) on the snapshot thread while the next forward and backward run; the
    next optimizer step (and any load) first waits until the snapshot is committed, and a tensor
    changed in place meanwhile fails the snapshot loudly. ``in_step`` copies everything inside
    the step (for loops that change parameters outside the optimizer step)."""

    timeout_s: float = 900.0
    """Bound on every wait for the other ranks during a save or load (gathering file hashes,
    agreeing on the tag to load). A rank that does not answer in time fails the save / load with
    CheckpointError instead of hanging."""

    resume: bool | None = None
    """Load the newest checkpoint that verifies from ``dir`` inside ``deepspeed.initialize`` (own
    memory snapshot, a peer's copy, disk, in that order, as ``engine.load_checkpoint(dir)``), so an
    unchanged script restarted by ``robust run`` continues at ``engine.global_steps + 1``. A
    fresh start (nothing in ``dir``) is logged and trains from step 1. ``true`` needs ``dir``.
    ``None`` (unset): on under ``robust run`` (from memory alone without ``dir``), off outside
    it. ``false``: never (the script loads itself, or starts cold)."""

    emergency_save: bool = True
    """Under ``robust run``: when a peer rank dies, the live ranks' failing collective writes a
    verified checkpoint of the last completed step into ``dir`` without any collective
    (``robust_plugins.watchdog.on_emergency``; one rank writes, the others see it and stop).
    Possible only where one rank holds the whole state: DeepSpeed ZeRO 0 without compression
    residuals; ZeRO 1/2 shard the optimizer state, so the dead rank's shard is gone and the save
    is skipped, with the reason in ``faults.jsonl``. No effect without ``dir``, with
    ``memory_every`` (its snapshots outlive the dead rank and restore every stage) or outside
    ``robust run``."""

    def __post_init__(self) -> None:
        where = f"{BLOCK_KEY}.checkpoint"
        _check_optional_dir(self, where)
        for name in ("persist_every", "memory_every"):
            value = getattr(self, name)
            if value is not None:
                _expect_type(f"{where}.{name}", value, (int,), "an integer number of steps or null")
                if value < 1:
                    raise ConfigError(f"{where}.{name} = {value} must be >= 1 (or null to turn it off).")
        _expect_type(f"{where}.keep", self.keep, (int,), "an integer")
        if self.keep < 1:
            raise ConfigError(
                f"{where}.keep = {self.keep} must be >= 1: the newest checkpoint is always kept."
            )
        _expect_type(f"{where}.verify", self.verify, (str,), "a string")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(
                f"{where}.verify = {self.verify!r} is not allowed.{_did_you_mean(self.verify, list(VERIFY_MODES))} "
                f"Allowed: {', '.join(VERIFY_MODES)}."
            )
        _expect_type(f"{where}.peer_backup", self.peer_backup, (bool,), "true or false")
        _expect_type(f"{where}.memory_copy", self.memory_copy, (str,), "a string")
        if self.memory_copy not in MEMORY_COPY_MODES:
            raise ConfigError(
                f"{where}.memory_copy = {self.memory_copy!r} is not allowed."
                f"{_did_you_mean(self.memory_copy, list(MEMORY_COPY_MODES))} Allowed: {', '.join(MEMORY_COPY_MODES)}."
            )
        value = _expect_type(f"{where}.timeout_s", self.timeout_s, (int, float), "a number")
        if not value > 0 or value == float("inf"):
            raise ConfigError(f"{where}.timeout_s = {value!r} must be a finite number of seconds > 0.")
        if self.persist_every is not None and self.dir is None:
            raise ConfigError(
                f"{where}.persist_every = {self.persist_every} needs {where}.dir: automatic saves "
                f"have no directory to go to. Set dir or remove persist_every."
            )
        _expect_type(f"{where}.emergency_save", self.emergency_save, (bool,), "true or false")
        if self.resume is not None:
            _expect_type(f"{where}.resume", self.resume, (bool,), "true or false (or null: on under robust run)")
        if self.resume and self.dir is None:
            raise ConfigError(
                f"{where}.resume = true needs {where}.dir: there is no directory to resume from. "
                f"Set dir or remove resume."
            )
        if self.peer_backup and self.memory_every is None:
            raise ConfigError(
                f"{where}.peer_backup = true needs {where}.memory_every: peers back up in-memory "
                f"snapshots. Set memory_every (e.g. 1) or remove peer_backup."
            )

    def describe(self) -> str:
        """One-line summary for logs and ``robust check-config``."""
        every = f"every {self.persist_every} steps" if self.persist_every else "on save_checkpoint"
        mem = (f", memory every {self.memory_every} steps{' + peer backup' if self.peer_backup else ''}"
               if self.memory_every else "")
        return (
            f"checkpoint(dir={self.dir}, persist {every}{mem}, keep={self.keep}, verify={self.verify}, "
            f"timeout_s={self.timeout_s:g}{', resume' if self.resume else ''})"
        )


#: ``telemetry.wandb.mode`` values, as ``wandb.init(mode=...)`` takes them. ``offline`` writes the
#: run under ``<telemetry dir>/wandb`` for a later ``wandb sync``; ``online`` needs a W&B account.
WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases run settings (``"telemetry": {"wandb": {...}}``)."""

    project: str = "robust_plugins"
    """W&B project: baseline and plugin runs of one comparison go into the same project."""

    group: str | None = None
    """W&B group, so that the runs of one comparison sit together in one workspace."""

    mode: str = "offline"
    """``offline`` (default: nothing leaves the machine), ``online`` or ``disabled``."""

    name: str | None = None
    """Run name (default: the telemetry directory's name, plus the incarnation under robust run)."""

    def __post_init__(self) -> None:
        where = f"{BLOCK_KEY}.telemetry.wandb"
        _expect_type(f"{where}.project", self.project, (str,), "a string")
        if not self.project:
            raise ConfigError(f"{where}.project is empty: give a W&B project name.")
        for name in ("group", "name"):
            if getattr(self, name) is not None:
                _expect_type(f"{where}.{name}", getattr(self, name), (str,), "a string or null")
        _expect_type(f"{where}.mode", self.mode, (str,), "a string")
        if self.mode not in WANDB_MODES:
            raise ConfigError(
                f"{where}.mode = {self.mode!r} is not allowed.{_did_you_mean(self.mode, list(WANDB_MODES))} "
                f"Allowed: {', '.join(WANDB_MODES)}."
            )


@dataclass(frozen=True)
class TelemetryConfig:
    """Per-step metrics, aggregated on rank 0 into a JSONL file and a W&B run (``"telemetry"``)."""

    dir: str | None = None
    """Directory of ``metrics.jsonl`` (and ``wandb/``). ``None``: ``$ROBUST_RUN_DIR/telemetry``
    under ``robust run``, else ``robust_telemetry`` in the working directory."""

    log_every: int = 10
    """Optimizer steps between aggregations on rank 0 (one small gather of ~16 numbers a rank)."""

    wandb: WandbConfig | None = None
    """W&B run settings; ``None`` (or leaving the key out) writes only the JSONL file."""

    peak_flops: float | None = None
    """Peak FLOP/s of one rank's device for MFU. ``None``: looked up by device name in
    ``robust_plugins.telemetry.metrics.PEAK_FLOPS`` (dense bf16); no entry (every CPU) leaves MFU
    empty, with one warning."""

    flops_per_token: float | None = None
    """Training FLOPs per token for MFU. ``None``: 6 x trainable parameters (forward + backward,
    the dense-transformer rule of thumb; attention is left out)."""

    heatmap_at_start: bool = False
    """Probe every rank pair's bandwidth and latency once at the first step, write
    ``heatmap.json`` / ``heatmap.png`` and log the image to W&B."""

    heatmap_bytes: int = 1 << 20
    """Message size of the bandwidth probe (the latency probe sends 4 bytes)."""

    def __post_init__(self) -> None:
        where = f"{BLOCK_KEY}.telemetry"
        _check_optional_dir(self, where)
        _expect_type(f"{where}.log_every", self.log_every, (int,), "an integer")
        if self.log_every < 1:
            raise ConfigError(f"{where}.log_every = {self.log_every} must be >= 1 (optimizer steps).")
        if isinstance(self.wandb, Mapping):
            _check_keys(f"{where}.wandb", self.wandb, [f.name for f in dataclasses.fields(WandbConfig)])
            object.__setattr__(self, "wandb", WandbConfig(**self.wandb))
        elif self.wandb is not None and not isinstance(self.wandb, WandbConfig):
            raise ConfigError(f"{where}.wandb must be a JSON object or null, got {type(self.wandb).__name__}.")
        for name in ("peak_flops", "flops_per_token"):
            value = getattr(self, name)
            if value is not None:
                _expect_type(f"{where}.{name}", value, (int, float), "a number or null")
                if not 0 < value < float("inf"):
                    raise ConfigError(f"{where}.{name} = {value!r} must be a finite number > 0 (or null).")
        _expect_type(f"{where}.heatmap_at_start", self.heatmap_at_start, (bool,), "true or false")
        _expect_type(f"{where}.heatmap_bytes", self.heatmap_bytes, (int,), "an integer")
        if not 4 <= self.heatmap_bytes <= 1 << 30:
            raise ConfigError(f"{where}.heatmap_bytes = {self.heatmap_bytes} must lie in [4, 2**30].")

    def describe(self) -> str:
        """One-line summary for logs and ``robust check-config``."""
        wb = (f"wandb {self.wandb.mode} {self.wandb.project}/{self.wandb.group or '-'}"
              if self.wandb is not None else "no wandb")
        return (f"telemetry(dir={self.dir or 'default'}, log_every={self.log_every}, {wb}, "
                f"heatmap_at_start={self.heatmap_at_start})")


@dataclass(frozen=True)
class TopologyConfig:
    """Topology-aware gradient reduction (``"topology"`` sub-block; ``robust_plugins.topology``)."""

    hierarchical: bool = False
    """Reduce data-parallel gradients hierarchically: fp32 reduce-scatter inside each node, the
    ``compression`` codec across nodes on rail groups, fp32 all-gather inside the node. Needs the
    ``compression`` sub-block (``"codec": "none"`` for an all-fp32 hierarchy). A data-parallel
    group smaller than the job (tensor/pipeline parallelism) gets a hierarchy planned on its own
    ranks. With ``"codec": "auto"`` this allows the hierarchy: ``auto`` then chooses per bucket
    size between the flat all-reduce and the hierarchy, and the codec."""

    file: str | None = None
    """Topology file (JSON, or YAML with PyYAML) keyed by host name; ``None``: discovered
    (``ROBUST_TOPOLOGY_SIM``, NVML, SLURM, Kubernetes labels, host names, in that order)."""

    k8s_node_env: str | None = None
    """Environment variable holding the Kubernetes node name (downward API ``spec.nodeName``);
    setting it turns the Kubernetes source on. Untested on a real cluster."""

    k8s_switch_envs: tuple = ()
    """Environment variables holding switch-tier node labels, lowest tier first (e.g. rack, then
    spine); each must be set on every rank when ``k8s_node_env`` is."""

    k8s_domain_env: str | None = None
    """Environment variable holding an NVLink-domain label, if the cluster labels one."""

    def __post_init__(self) -> None:
        where = f"{BLOCK_KEY}.topology"
        _expect_type(f"{where}.hierarchical", self.hierarchical, (bool,), "true or false")
        for name in ("k8s_node_env", "k8s_domain_env"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{where}.{name} = {value!r} must be an environment variable name or null.")
        envs = self.k8s_switch_envs
        if isinstance(envs, str) or not isinstance(envs, (list, tuple)) or not all(
                isinstance(v, str) and v for v in envs):
            raise ConfigError(f"{where}.k8s_switch_envs = {envs!r} must be a list of environment variable names.")
        object.__setattr__(self, "k8s_switch_envs", tuple(envs))
        if (envs or self.k8s_domain_env) and not self.k8s_node_env:
            raise ConfigError(
                f"{where}.k8s_switch_envs / k8s_domain_env need {where}.k8s_node_env (the variable holding "
                f"the node name), which turns the Kubernetes source on."
            )
        if self.file is not None:
            if isinstance(self.file, os.PathLike):
                object.__setattr__(self, "file", os.fspath(self.file))
            _expect_type(f"{where}.file", self.file, (str,), "a file path (string) or null")
            if not self.file:
                raise ConfigError(f"{where}.file = '' is empty: give a path or leave it out.")

    def describe(self) -> str:
        """One-line summary for logs and ``robust check-config``."""
        return f"topology(hierarchical={self.hierarchical}, file={self.file})"


_SECTIONS: dict[str, type] = {
    "compression": CompressionConfig, "watchdog": WatchdogConfig, "checkpoint": CheckpointConfig,
    "telemetry": TelemetryConfig, "topology": TopologyConfig,
}


@dataclass(frozen=True)
class PluginConfig:
    """The whole ``robust_plugins`` block. A missing sub-block means that feature is off."""

    compression: CompressionConfig | None = None
    """Compressed gradient communication; ``None`` leaves the host's all-reduce untouched."""

    watchdog: WatchdogConfig | None = None
    """Fault detection settings read by ``robust run``; ``None`` means the defaults there."""

    checkpoint: CheckpointConfig | None = None
    """Verified, atomic disk checkpoints; ``None`` leaves DeepSpeed's own save/load unchanged."""

    telemetry: TelemetryConfig | None = None
    """Per-step metrics to a JSONL file and W&B; ``None`` records nothing."""

    topology: TopologyConfig | None = None
    """Topology-aware (hierarchical) gradient reduction; ``None``: flat, as the host does it."""

    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The block as given (after environment overrides), for logs and W&B run configs."""

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None) -> "PluginConfig":
        """Validate a ``robust_plugins`` block (the value, not the whole DeepSpeed config)."""
        if block is None:
            return cls()
        _check_keys(BLOCK_KEY, block, list(_SECTIONS))
        block = _apply_env_overrides(dict(block))
        kwargs: dict[str, Any] = {}
        for name, section_cls in _SECTIONS.items():
            if name not in block or block[name] is None:
                continue
            sub = block[name]
            allowed = [f.name for f in dataclasses.fields(section_cls)]
            _check_keys(f"{BLOCK_KEY}.{name}", sub, allowed)
            kwargs[name] = section_cls(**sub)
        topo = kwargs.get("topology")
        comp = kwargs.get("compression")
        if topo is not None and topo.hierarchical and comp is not None and comp.sign_mode == "momentum":
            raise ConfigError(
                f"{BLOCK_KEY}.topology.hierarchical does not combine with compression.sign_mode = 'momentum' "
                f"(the momentum all-reduce is flat); remove one of the two."
            )
        if topo is not None and topo.hierarchical and "compression" not in kwargs:
            raise ConfigError(
                f"{BLOCK_KEY}.topology.hierarchical = true needs a {BLOCK_KEY}.compression sub-block "
                f"(the hierarchy replaces the compressed gradient all-reduce); add "
                f'"compression": {{"codec": "none"}} for fp32 all the way, or a codec such as "int8".'
            )
        return cls(raw=block, **kwargs)

    @classmethod
    def from_kwargs(cls, **sections: Any) -> "PluginConfig":
        """Build from Python: ``PluginConfig.from_kwargs(compression={"codec": "int4"})``."""
        return cls.from_dict(sections)

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | str | os.PathLike | None) -> "PluginConfig":
        """Extract and validate the block from a whole DeepSpeed config (dict or JSON path)."""
        if ds_config is None:
            return cls()
        if isinstance(ds_config, (str, os.PathLike)):
            ds_config = load_json(ds_config)
        if not isinstance(ds_config, Mapping):
            raise ConfigError(f"A DeepSpeed config must be a JSON object, got {type(ds_config).__name__}.")
        if os.environ.get("ROBUST_DISABLE", "0") not in ("", "0"):
            return cls()
        return cls.from_dict(ds_config.get(BLOCK_KEY))

    @property
    def active(self) -> bool:
        """True when a feature that hooks the host engine is configured (the watchdog sub-block
        alone makes the engine report its steps under ``robust run``)."""
        return (self.compression is not None or self.checkpoint is not None or self.telemetry is not None
                or self.watchdog is not None)

    def describe(self) -> str:
        """One line naming every active feature with its settings."""
        parts = [s.describe() for s in (self.compression, self.watchdog, self.checkpoint, self.telemetry,
                                        self.topology) if s is not None]
        return "; ".join(parts) if parts else "no features active"


def _apply_env_overrides(block: dict[str, Any]) -> dict[str, Any]:
    codec = os.environ.get("ROBUST_CODEC")
    if codec:
        block["compression"] = {**(block.get("compression") or {}), "codec": codec}
    return block


def load_json(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON config file with errors that name the file and the position."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"Cannot read config file {p}: {exc.strerror}.") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a JSON object at the top level, got {type(data).__name__}.")
    return data

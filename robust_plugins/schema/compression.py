"""The ``compression`` sub-block: compressed data-parallel gradient all-reduce."""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from robust_plugins.errors import ConfigError
from robust_plugins.schema._base import Hint, Section, num
from robust_plugins.schema.common import (
    AUTO_CANDIDATES,
    AUTO_CODEC,
    BLOCK_KEY,
    BLOCK_SIZE_MAX,
    BLOCK_SIZE_MIN,
    CODECS,
    CODECS_REQUIRING_EF,
    SIGN_MODES,
)

_BLOCK_RULE = (f"is not allowed: it must be a power of two between {BLOCK_SIZE_MIN} and {BLOCK_SIZE_MAX} "
               f"(e.g. 256)")
_CANDIDATES_RULE = f"must be a non-empty list of {', '.join(AUTO_CANDIDATES)}"


class CompressionConfig(Section):
    """Compressed data-parallel gradient all-reduce (``"compression"`` sub-block)."""

    where: ClassVar[str] = f"{BLOCK_KEY}.compression"

    codec: Literal[CODECS + (AUTO_CODEC,)] = "int8"
    """Wire format: ``none`` (host collective, bitwise identical), ``bf16``, ``int8`` (blockwise
    absmax), ``int4`` (two values a byte, blockwise absmax), ``sign`` (1 bit an element plus one
    scale a block) or ``auto`` (chosen per bucket size from measured link and encode costs; see the
    ``auto_*`` keys)."""

    block_size: Annotated[int, Field(ge=BLOCK_SIZE_MIN, le=BLOCK_SIZE_MAX), Hint(rule=_BLOCK_RULE)] = 256
    """Elements sharing one fp32 scale. A power of two in [32, 4096]; 256 costs 1.6 % extra bytes."""

    error_feedback: bool = True
    """Keep each rank's quantization residual and add it to the next gradient (both on the sending
    side and on the reducing side). Residuals are training state and go into checkpoints."""

    warmup_steps: Annotated[int, Field(ge=0), Hint(why="(0 compresses from the first step)")] = 0
    """Optimizer steps sent uncompressed (through the host's own collective) before compressing."""

    min_numel: Annotated[int, Field(ge=0)] = 0
    """Buckets with fewer elements than this go uncompressed: for tiny buckets latency, not bytes,
    dominates and the per-block scale overhead is largest."""

    sign_mode: Literal[SIGN_MODES] = "gradient"
    """``sign`` only: what travels as 1-bit codes. ``gradient`` (default): each gradient bucket, in
    place of the host's all-reduce, under any optimizer. ``momentum``: 1-bit Adam (Tang et al.
    2021): plain fp32 Adam for ``freeze_steps`` optimizer steps, then Adam's second moment is frozen
    and each rank's local momentum is averaged in 1-bit codes instead of the gradient (ZeRO 0, fp32,
    ``torch.optim.Adam``/``AdamW`` only). Loses less validation loss than ``gradient``
    (BENCHMARKS.md)."""

    freeze_steps: Annotated[int, Field(ge=0)] = 0
    """``sign_mode: momentum`` only, and required there (>= 1): optimizer steps of uncompressed
    fp32 Adam before the second moment is frozen and the momentum goes 1-bit. These steps send full
    fp32 gradients; the 1-bit Adam paper used 15-25 % of training."""

    auto_candidates: Annotated[tuple[Literal[AUTO_CANDIDATES], ...], Field(min_length=1),
                               Hint(expect="a list", rule=_CANDIDATES_RULE)] = AUTO_CANDIDATES
    """``auto`` only: codecs it may choose among (``none`` always is one); a list of
    ``none``, ``bf16``, ``bf16_allreduce``, ``int8``, ``int4``. ``bf16`` is the two-phase codec (fp32
    sums, both roundings fed back); ``bf16_allreduce`` is one bf16 all-reduce of the whole bucket
    (bf16 sums in the backend; the cast's rounding fed back when ``error_feedback``), flat only."""

    auto_link_gbit: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = None
    """``auto`` only: the inter-node link rate in Gbit/s if known; ``null`` measures it with one
    4 MB fp32 all-reduce per probe (and, with ``topology.hierarchical``, times the candidate
    routes on the real bucket; a given rate leaves the choice to the cost model alone)."""

    auto_recheck_steps: Annotated[int, Field(ge=0), Hint(why="(0: never)")] = 1000
    """``auto`` only: measure again (and re-decide) every this many optimizer steps; 0: only at
    the first step."""

    auto_min_gain: Annotated[float, Field(ge=0, lt=1)] = 0.1
    """``auto`` only: a codec replaces ``none`` only when predicted at least this fraction faster
    (hysteresis against measurement noise on fast links, where compression must stay off)."""

    auto_max_error: Annotated[float, Field(ge=0, lt=1)] = 0.1
    """``auto`` only, the quality guard: codecs whose measured relative error on the real bucket
    (one quantization round trip) exceeds this are never chosen. int8 measures about 0.01 and
    bf16 0.003 on gradients, int4 about 0.15, so the default admits bf16 and int8, not int4."""

    auto_bf16_error_feedback: bool = False
    """``auto`` only: feed back the rounding of the ``bf16_allreduce`` route's cast (a residual per
    bucket, checkpointed). Off by default: that route is then exactly DeepSpeed's
    ``communication_data_type: bf16`` (and megatron-core's bf16 gradient reduction), whose rounding
    is relative to each element (at most 2**-9), unlike int8/int4's block-shared scale that zeroes
    small elements. The feedback costs three more passes over the bucket, which on a fast link can
    cost more than bf16 saves (BENCHMARKS.md)."""

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

    bucket_mb: Annotated[float | None, Field(gt=0, allow_inf_nan=False),
                         Hint(expect="a number (MB)", why="(MB, e.g. 4)")] = None
    """Unset: 4 MB for CPU gradients, 25 MB for CUDA ones (``robust_plugins.device.BUCKET_MB``).
    DeepSpeed ZeRO 0, with a compressing codec or ``topology.hierarchical``: gradients are
    reduced in buckets of at least this many MB (fp32: 4 bytes an element), parameters taken in
    reverse order of registration (the order backward finishes them) and cut at parameter
    boundaries and dtype changes. Smaller buckets start earlier in backward and leave less to
    reduce after it; each costs a collective's latency (and with ``auto`` its own trial runs at
    its first step). DeepSpeed's own ZeRO 0 path reduces in 500M-element buckets (BENCHMARKS.md
    compares bucket sizes)."""

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, bs: int) -> int:
        if bs & (bs - 1):
            raise ValueError(_BLOCK_RULE)
        return bs

    @field_validator("auto_candidates", mode="before")
    @classmethod
    def _candidates(cls, cands: Any) -> tuple:
        # JSON gives a list; a string would iterate as letters.
        if isinstance(cands, str) or not isinstance(cands, (list, tuple)) or not cands or any(
                c not in AUTO_CANDIDATES for c in cands):
            raise ValueError(_CANDIDATES_RULE)
        return tuple(cands)

    @model_validator(mode="after")
    def _cross_checks(self) -> "CompressionConfig":
        where = self.where
        if self.codec in CODECS_REQUIRING_EF and not self.error_feedback:
            raise ConfigError(
                f"{where}.codec = {self.codec!r} requires error_feedback = true: without the "
                f"residual, 1-bit gradients do not converge. Set error_feedback to true or pick "
                f"int8 / int4."
            )
        self._check_sign_mode(where)
        if self.overlap and self.sign_mode == "momentum":
            raise ConfigError(f"{where}.overlap = true does not apply to sign_mode = 'momentum' (1-bit Adam "
                              f"sends the momentum after the optimizer's step, not gradients during "
                              f"backward); remove overlap or use sign_mode 'gradient'.")
        return self

    def _check_sign_mode(self, where: str) -> None:
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
        link = None if self.auto_link_gbit is None else num(self.auto_link_gbit)  # 1, not 1.0, as given
        auto = (f"auto_candidates={','.join(self.auto_candidates)}, auto_link_gbit={link}, "
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
            + (f", bucket_mb={self.bucket_mb:g}" if self.bucket_mb is not None else "")
            + ")"
        )

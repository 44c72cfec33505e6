"""The ``telemetry`` sub-block and its ``wandb`` settings."""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from robust_plugins.schema._base import Hint, Section
from robust_plugins.schema.checkpoint import path_string
from robust_plugins.schema.common import BLOCK_KEY, WANDB_MODES

#: A positive finite number, or null (looked up / estimated).
_PositiveOrNull = Annotated[float | None, Field(gt=0, allow_inf_nan=False)]


class WandbConfig(Section):
    """Weights & Biases run settings (``"telemetry": {"wandb": {...}}``)."""

    where: ClassVar[str] = f"{BLOCK_KEY}.telemetry.wandb"

    project: Annotated[str, Field(min_length=1), Hint(rule="is empty: give a W&B project name")] = "robust_plugins"
    """W&B project: baseline and plugin runs of one comparison go into the same project."""

    group: str | None = None
    """W&B group, so that the runs of one comparison sit together in one workspace."""

    mode: Literal[WANDB_MODES] = "offline"
    """``offline`` (default: nothing leaves the machine), ``online`` or ``disabled``."""

    name: str | None = None
    """Run name (default: the telemetry directory's name, plus the incarnation under robust run)."""


class TelemetryConfig(Section):
    """Per-step metrics, aggregated on rank 0 into a JSONL file and a W&B run (``"telemetry"``)."""

    where: ClassVar[str] = f"{BLOCK_KEY}.telemetry"

    dir: Annotated[str | None, Hint(expect="a directory path (string)")] = None
    """Directory of ``metrics.jsonl`` (and ``wandb/``). ``None``: ``$ROBUST_RUN_DIR/telemetry``
    under ``robust run``, else ``robust_telemetry`` in the working directory."""

    log_every: Annotated[int, Field(ge=1), Hint(why="(optimizer steps)")] = 10
    """Optimizer steps between aggregations on rank 0 (one small gather of ~16 numbers a rank)."""

    wandb: WandbConfig | None = None
    """W&B run settings; ``None`` (or leaving the key out) writes only the JSONL file."""

    peak_flops: _PositiveOrNull = None
    """Peak FLOP/s of one rank's device for MFU. ``None``: looked up by device name in
    ``robust_plugins.telemetry.metrics.PEAK_FLOPS`` (dense bf16); no entry (every CPU) leaves MFU
    empty, with one warning."""

    flops_per_token: _PositiveOrNull = None
    """Training FLOPs per token for MFU. ``None``: 6 x trainable parameters (forward + backward,
    the dense-transformer rule of thumb; attention is left out)."""

    heatmap_at_start: bool = False
    """Probe every rank pair's bandwidth and latency once a job, at its first step, write
    ``heatmap.json`` / ``heatmap.png`` and log the image to W&B. A restarted incarnation does not
    probe again when the job's records already hold a heat map (a restart is recovery time)."""

    heatmap_bytes: Annotated[int, Field(ge=4, le=1 << 30), Hint(why="(bytes)")] = 1 << 20
    """Message size of the bandwidth probe (the latency probe sends 4 bytes)."""

    @field_validator("dir", mode="before")
    @classmethod
    def _dir(cls, value: Any) -> Any:
        return path_string(value, "a directory path")

    def describe(self) -> str:
        """One-line summary for logs and ``robust check-config``."""
        wb = (f"wandb {self.wandb.mode} {self.wandb.project}/{self.wandb.group or '-'}"
              if self.wandb is not None else "no wandb")
        return (f"telemetry(dir={self.dir or 'default'}, log_every={self.log_every}, {wb}, "
                f"heatmap_at_start={self.heatmap_at_start})")

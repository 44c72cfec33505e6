"""Constants of the block schema, ``load_json`` and "did you mean": no pydantic, cheap to import."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

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

#: ``checkpoint.verify`` values: ``sha256`` hashes every file on save and checks it on load;
#: ``none`` records and checks sizes only (atomic commit still applies).
VERIFY_MODES = ("sha256", "none")

#: ``checkpoint.memory_copy``: where an in-memory snapshot copies parameters and optimizer state:
#: on the snapshot thread, overlapped with the next forward and backward (the next optimizer step
#: waits for it), or inside the step like everything else.
MEMORY_COPY_MODES = ("background", "in_step")

#: ``telemetry.wandb.mode`` values, as ``wandb.init(mode=...)`` takes them. ``offline`` writes the
#: run under ``<telemetry dir>/wandb`` for a later ``wandb sync``; ``online`` needs a W&B account.
WANDB_MODES = ("offline", "online", "disabled")

ENV_OVERRIDES = {
    "ROBUST_CODEC": "compression.codec",
    "ROBUST_DISABLE": "(whole block)",
}


def did_you_mean(key: str, allowed: list[str] | tuple[str, ...]) -> str:
    """`` Did you mean 'x'?`` for the closest allowed name, or ``""``."""
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def load_json(path: str | Any) -> dict[str, Any]:
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

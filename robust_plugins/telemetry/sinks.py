"""Where rank 0's telemetry records go: a JSONL file (always) and a W&B run (optional).

``metrics.jsonl`` holds one JSON object a line, each with a ``kind``:

==========  ===================================================================================
``start``   an incarnation's first engine: ``time``, ``incarnation``, ``world_size``, ``config``
``step``    one aggregation window (``robust_plugins.telemetry.metrics.aggregate`` fields, plus
            ``step``, ``time``, ``incarnation``, ``ettr``, ``faults_total``; with compression
            also ``codec_share`` and ``auto_decisions``)
``fault``   a watchdog event copied from ``faults.jsonl`` (its fields, ``fault_index``); in a
            multi-node job from the job-wide ``job_faults.jsonl`` (plus ``node``, ``source``...)
``heatmap`` a rank-to-rank probe: ``file`` (JSON with the matrices), ``png``, ``outliers``
``end``     the engine's telemetry was closed cleanly
==========  ===================================================================================

The file is appended to, so the records of every incarnation of a restarted job follow each
other; ``robust report`` reads it.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any, Mapping

from robust_plugins._logging import get_logger
from robust_plugins.errors import RobustPluginsError

log = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"


def _clean(obj: Any) -> Any:
    # JSON has no NaN/Inf; a NaN loss is exactly what a reader must see, so it becomes null and
    # the watchdog's fault record says what happened.
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


class JsonlSink:
    """Append-only ``metrics.jsonl``; each record is flushed as written (a crash loses none)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record."""
        self._f.write(json.dumps(_clean(record)) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._f.closed:
            self._f.close()


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` (a directory holding one is accepted too).

    A torn last line (the process died while writing it) is skipped; any other bad line is an
    error naming the file and the line.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        raise RobustPluginsError(f"No telemetry file at {p}: run with a 'telemetry' block (or give its directory).")
    lines = p.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines):
                break
            raise RobustPluginsError(f"{p}, line {i}, is not JSON ({exc.msg}); the file is corrupt.") from exc
    return out


#: Record fields that go to W&B as scalars (the rest stay in the JSONL file).
WANDB_SCALARS = (
    "loss", "grad_norm", "step_time_s", "step_time_max_s", "tokens_per_s", "mfu", "mem_bytes_max",
    "grad_bytes_per_step", "grad_bytes_per_step_rank0", "grad_comm_s_per_step", "grad_bandwidth_Bps",
    "compression_ratio", "residual_norm", "ettr", "faults_total",
)

#: Seconds between wandb-core's writes of the run file (its default is 15): what a SIGKILL loses.
WANDB_FLUSH_S = 1.0
#: Longest wait for ``wandb.init`` (run on a thread) before a call that needs the run fails.
WANDB_OPEN_S = 120.0

FAULT_COLUMNS = ("kind", "step", "suspect_ranks", "suspect_hosts", "detected_after_s", "action",
                 "resumed_at_step", "lost_steps", "incarnation", "time", "node")


class WandbSink:
    """One W&B run (offline by default) carrying the run config, scalars, the fault table and
    the heat map image.

    The run opens on a thread (``wandb.init`` starts wandb-core, about a second) so that a
    restarted rank restores and trains meanwhile; every other method waits for it, at most
    :data:`WANDB_OPEN_S`, and raises what ``wandb.init`` raised. Nothing is dropped: a run that
    cannot open fails the first call that needs it."""

    def __init__(self, directory: str | os.PathLike, *, project: str, group: str | None, mode: str,
                 name: str, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RobustPluginsError(
                "robust_plugins.telemetry.wandb is set but wandb is not installed "
                f"({exc}). pip install 'robust_plugins[wandb]', or remove the 'wandb' key."
            ) from exc
        self._wandb = wandb
        Path(directory).mkdir(parents=True, exist_ok=True)
        # reinit="create_new": a launch may train several engines one after another (the demo's
        # baseline and plugin runs), each with its own W&B run.
        # wandb-core writes the run's .wandb file every 15 s by default, and neither it nor the
        # rank flushes when a restart SIGKILLs the rank's process group: an incarnation stopped
        # within 15 s of its last flush lost those steps (we saw header-only files). Every
        # WANDB_FLUSH_S bounds the loss; the field exists from wandb 0.2x (checked, not assumed).
        settings = {}
        if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):
            settings["settings"] = wandb.Settings(x_transaction_log_flush_interval=WANDB_FLUSH_S)
        else:
            log.info("robust_plugins telemetry: this wandb has no x_transaction_log_flush_interval; "
                     "a rank killed by a restart may lose up to its last 15 s of W&B data "
                     "(the JSONL file has every step)")
        kwargs = dict(project=project, group=group, mode=mode, name=name, dir=str(directory),
                      config=dict(config), reinit="create_new", **settings)
        self.run: Any = None
        self._error: BaseException | None = None
        self._opener = threading.Thread(target=self._open, args=(kwargs,), name="robust-wandb-init",
                                        daemon=True)
        self._opener.start()
        self._faults: list[list[Any]] = []
        self._decisions: Any = None

    def _open(self, kwargs: dict[str, Any]) -> None:
        try:
            self.run = self._wandb.init(**kwargs)
        except BaseException as exc:  # re-raised by _ready() in the caller's thread
            self._error = exc

    def _ready(self) -> Any:
        """The open run; raises when ``wandb.init`` failed or did not return in time."""
        if self._opener is not None:
            self._opener.join(WANDB_OPEN_S)
            if self._opener.is_alive():
                raise RobustPluginsError(
                    f"robust_plugins telemetry: wandb.init did not return in {WANDB_OPEN_S:.0f} s; "
                    "check the W&B service (or set telemetry.wandb.mode to 'offline' or 'disabled').")
            self._opener = None
            if self._error is not None:
                raise RobustPluginsError(f"robust_plugins telemetry: wandb.init failed: {self._error!r}. "
                                         "Fix the telemetry.wandb settings or remove the 'wandb' key."
                                         ) from self._error
        return self.run

    def log(self, record: Mapping[str, Any]) -> None:
        """Scalars of one ``step`` record, at its step."""
        data = {k: record[k] for k in WANDB_SCALARS
                if isinstance(record.get(k), (int, float)) and math.isfinite(record[k])}
        data.update({f"codec/{k}": v for k, v in (record.get("codec_share") or {}).items()})
        decisions = record.get("auto_decisions")
        if decisions and decisions != self._decisions:
            # The auto codec's choice per (group, bucket size), logged again when it changes.
            self._decisions = decisions
            data["compression/auto_decisions"] = self._wandb.Table(
                columns=["numel", "codec", "reason", "predicted_s"],
                data=[[d.get("numel"), d.get("codec"), d.get("reason"), json.dumps(d.get("predicted_s"))]
                      for d in decisions])
        self._ready().log(data, step=int(record["step"]))

    def faults(self, records: list[Mapping[str, Any]], step: int) -> None:
        """Append fault events; the whole table is logged again (W&B tables are immutable)."""
        for rec in records:
            self._faults.append([json.dumps(rec.get(c)) if isinstance(rec.get(c), list) else rec.get(c)
                                 for c in FAULT_COLUMNS])
        table = self._wandb.Table(columns=list(FAULT_COLUMNS), data=self._faults)
        self._ready().log({"watchdog/faults": table}, step=step)

    def image(self, key: str, png: str | os.PathLike, step: int, caption: str) -> None:
        """Log a PNG file as an image."""
        self._ready().log({key: self._wandb.Image(str(png), caption=caption)}, step=step)

    def close(self) -> None:
        """Finish the run (writes everything to disk in offline mode). Called at shutdown, from
        a SIGTERM handler too: a run that never opened is logged as an error, not raised."""
        try:
            self._ready()
        except RobustPluginsError as exc:
            log.error("%s", exc)
        if self.run is not None:
            self.run.finish()
            self.run = None
            # finish() returns before wandb-core has written the run's file (we saw header-only
            # .wandb files right after it, filled ~1 s later); teardown() waits for the service.
            # It is global, so only when no other run (the user's own) is still active.
            if self._wandb.run is None:
                self._wandb.teardown()

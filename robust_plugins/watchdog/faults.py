"""``faults.jsonl``: one JSON object a line per detected fault (format in ``FORMAT.md``)."""

from __future__ import annotations

import datetime
import json
import math
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("crash", "hang", "nan", "spike", "straggler", "sdc")
ACTIONS = ("restart", "rollback", "evict", "report")

#: The job-wide view, written into every node's run directory of a multi-node job by the agents
#: (``robust_plugins.launcher.jobfaults``); ranks and the CLI read it through :func:`fault_view_path`.
JOB_FAULTS = "job_faults.jsonl"


def fault_view_path(run_dir: str | os.PathLike) -> Path:
    """Where a reader of a run directory finds the job's faults: ``job_faults.jsonl`` when the
    agent keeps a job-wide view (a multi-node job with the c10d rendezvous; the agent creates the
    file at launch), else the node's ``faults.jsonl`` (a single-node job: the node is the job)."""
    job = Path(run_dir) / JOB_FAULTS
    return job if job.exists() else Path(run_dir) / "faults.jsonl"


@dataclass
class Fault:
    """One line of ``faults.jsonl``."""

    kind: str
    step: int | None
    suspect_ranks: list[int]
    suspect_hosts: list[str]
    detected_after_s: float | None
    action: str
    time: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
                      .isoformat(timespec="milliseconds"))
    resumed_at_step: int | None = None
    lost_steps: int | None = None
    evidence: list[str] = field(default_factory=list)
    incarnation: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {KINDS}")
        if self.action not in ACTIONS:
            raise ValueError(f"fault action {self.action!r} is not one of {ACTIONS}")

    def to_json(self) -> str:
        """The record as one line of JSON (NaN values become null)."""
        return json.dumps(_finite(asdict(self)), sort_keys=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


class FaultLog:
    """Appends faults to ``faults.jsonl``; each line is written and flushed whole."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, fault: Fault) -> None:
        """Append one fault (a single ``write`` of the whole line, then fsync)."""
        line = fault.to_json() + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def read_faults(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The faults in a ``faults.jsonl`` (an empty list when the file does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

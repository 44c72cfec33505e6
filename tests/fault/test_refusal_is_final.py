"""A refusal before the first step ends a ``robust run`` job at once: no restart, the message in
``faults.jsonl``, the monitor's log and the launcher's last words. The rank is the unsupported-DeepSpeed
worker of tests/integration (its version faked below the range) building an engine with a block; one rank,
one job (~15 s, mostly imports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from robust_plugins.patches import _ranges
from conftest import robust_run

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.fault, pytest.mark.timeout(150)]

#: A DeepSpeed version just below the supported range (0.16.0 -> 0.15.9).
OLD = f"{_ranges.DEEPSPEED.minimum[0]}.{_ranges.DEEPSPEED.minimum[1] - 1}.9"
WORKER = Path(__file__).parent.parent / "integration" / "ds_unsupported_worker.py"


def test_a_refusal_before_the_first_step_ends_the_job_without_restarts(tmp_path):
    job = robust_run(tmp_path, 1, "--max-restarts", "3", script=[str(WORKER), "--version", OLD, "--refuse-only"],
                     timeout_s=140)
    assert job.returncode == 1, job.output[-3000:]
    (fault,) = job.faults
    assert fault["action"] == "report" and fault["suspect_ranks"] == [0]
    assert f"found deepspeed {OLD}" in fault["detail"]["refused"]
    assert "refused to run before its first step" in fault["detail"]["reason"]
    incarnations = [json.loads(x)["incarnation"] for x in (tmp_path / "workers.jsonl").read_text().splitlines()]
    assert incarnations == [0]  # never restarted although 3 restarts were allowed
    assert f"found deepspeed {OLD}" in (tmp_path / "monitor.log").read_text()
    last = [x for x in job.output.splitlines() if x.startswith("robust run: job FAILED")]
    assert last and f"found deepspeed {OLD}" in last[-1] and "Not restarted" in last[-1]

"""``robust run`` and a rank that aborts at interpreter exit after training returned (exit -6).

Seen with the HF Trainer + DeepSpeed, with or without the plugin. When every rank reported its
training complete (``robust_plugins/watchdog/completion.py``; the Trainer binding writes the
record when ``train()`` returns), the job is complete: it is not restarted and the log says why.
(Without the records the same abort is a crash and is restarted: tests/fault covers restarts.)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from robust_plugins.watchdog import completion

pytestmark = [pytest.mark.integration]

HERE = Path(__file__).parent
WORKER = str(HERE / "hf_abort_worker.py")
_spec = importlib.util.spec_from_file_location("_fault_conftest", HERE.parent / "fault" / "conftest.py")
_fault = sys.modules.setdefault("_fault_conftest", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_fault)


def _trained(run_dir: Path, rank: int) -> list[str]:
    return (run_dir / f"trained.rank{rank}").read_text().split()


def test_abort_after_reported_completion_is_not_restarted(tmp_path):
    job = _fault.robust_run(tmp_path / "done", 2, script=[WORKER, "--complete"], timeout_s=120)  # restarts on
    assert job.returncode == 0, job.output[-3000:]
    assert _trained(job.run_dir, 0) == ["0"] and _trained(job.run_dir, 1) == ["0"]  # trained once
    assert "rank 1 exited with -6 after its training had returned; all 2 ranks reported completion" in job.output
    assert "so the job is complete and is not restarted" in job.output
    assert job.faults == []


def test_job_completed_needs_every_rank_of_this_launch(tmp_path):
    run = str(tmp_path)
    completion.record(run, 0, 2, step=60, max_steps=60)
    assert completion.job_completed(run, [0, 1], 2, since=0) is None  # rank 1 missing
    completion.record(run, 1, 2, step=60, max_steps=60)
    done = completion.job_completed(run, [0, 1], 2, since=0)
    assert [r["rank"] for r in done] == [0, 1]
    assert completion.job_completed(run, [0, 1], 4, since=0) is None  # another world size
    assert completion.job_completed(run, [0, 1], 2, since=done[1]["time"] + 1) is None  # an earlier launch's
    assert "step 60 of 60" in completion.verdict(done, {1: -6})

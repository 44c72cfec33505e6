"""The HF Trainer on DeepSpeed ZeRO-3 under ``robust run``: a kill and a NaN, then the exact run.

Two ``robust run`` jobs of ``recipes/hf_trainer`` with its ``zero3.json`` (HF's ``"auto"`` values;
the model is built by HF's DeepSpeed integration under ``zero.Init``), 2 CPU ranks, 30 steps of 2
micro-batches (12 steps an epoch, dropout on): a fault-free one without the block, and one with
``checkpoint.memory_every: 1`` and robust run's defaults where rank 1 is SIGKILLed at step 10 and
rank 0 reports a NaN loss at step 20. The second must end with the first one's steps, log history
and (gathered) weights.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

HERE = Path(__file__).parent
RECIPE = HERE.parent.parent / "recipes" / "hf_trainer"
STEPS = 30
_spec = importlib.util.spec_from_file_location("_fault_conftest", HERE.parent / "fault" / "conftest.py")
_fault = sys.modules.setdefault("_fault_conftest", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_fault)  # its job helpers: process-session clean-up after robust run


def _robust_run(run_dir: Path, config: Path, *args: str, timeout_s: float = 200.0) -> "_fault.Job":
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(run_dir), "--standalone",
           "--nproc-per-node", "2", "--monitor-interval", "0.1", "--watchdog", "straggler_factor=0", *args,
           "-m", "robust_plugins.recipes.hf_trainer.train", "--ds-config", str(config), "--steps", str(STEPS),
           "--windows", "192", "--grad-accum", "2", "--out", str(run_dir / "out")]
    return _fault.run_job(cmd, run_dir, timeout_s)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_zero3")
    cfg = json.loads((RECIPE / "zero3.json").read_text())
    plain = root / "zero3.json"
    plain.write_text(json.dumps(cfg))
    cfg["robust_plugins"] = {"checkpoint": {"memory_every": 1}}
    block = root / "zero3_block.json"
    block.write_text(json.dumps(cfg))
    clean = _robust_run(root / "clean", plain, "--max-restarts", "0")
    job = _robust_run(root / "faults", block, "--inject", "kill:rank=1,step=10", "--inject", "nan:rank=0,step=20")
    return clean, job


def _result(job) -> dict:
    return json.loads((job.run_dir / "out" / "result.json").read_text())


def _steps(log_history: list[dict]) -> list[dict]:
    return [h for h in log_history if "loss" in h]


def test_fault_free_zero3_trainer_run_learns_from_hf_initialised_weights(jobs):
    clean, _ = jobs
    assert clean.returncode == 0, clean.output[-4000:]
    res = _result(clean)
    assert res["zero_stage"] == 3 and not res["plugin"] and res["global_step"] == STEPS
    losses = [h["loss"] for h in _steps(res["log_history"])]
    # HF's init under zero.Init: the first loss is near ln(256) = 5.5 (44 when the init is skipped)
    assert 5.0 < losses[0] < 6.5, losses[:3]
    assert losses[-1] < losses[0], losses


def test_kill_and_nan_resume_the_zero3_trainer_exactly(jobs):
    clean, job = jobs
    assert job.returncode == 0, job.output[-4000:]
    kinds = [(f["kind"], f["step"], f["suspect_ranks"]) for f in job.faults]
    assert kinds == [("crash", 10, [1]), ("nan", 20, [0])], kinds
    resumed = [ln for ln in job.output.splitlines() if "Trainer resumed at global step" in ln]
    assert len(resumed) == 2 and all(ln.startswith("[Rank 0] ") for ln in resumed), resumed
    assert "resumed at global step 19 " in resumed[1], resumed  # the step before the NaN
    ref, res = _result(clean), _result(job)
    assert res["zero_stage"] == 3 and res["plugin"]
    assert res["global_step"] == STEPS and res["epoch"] == ref["epoch"]
    assert _steps(res["log_history"]) == _steps(ref["log_history"])
    assert res["log_history"][-1]["train_loss"] == ref["log_history"][-1]["train_loss"]
    digests = sorted(p.read_text().strip() for p in (job.run_dir / "out").glob("digest.rank*"))
    ref_digests = sorted(p.read_text().strip() for p in (clean.run_dir / "out").glob("digest.rank*"))
    assert len(set(ref_digests)) == 1 and digests == ref_digests, "final weights differ from the fault-free run's"

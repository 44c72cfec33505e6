"""Resume by default: under ``robust run`` a DeepSpeed engine with a ``checkpoint`` sub-block
resumes inside ``deepspeed.initialize`` (issue 15). A SIGKILLed rank's job, with no ``resume``
key and no load call in the script, loses at most one step and ends bitwise equal to the
reference; ``resume: false`` restarts cold from step 1 (and, retraining every step with the same
batches, is that reference); a script that also calls ``engine.load_checkpoint`` gets the same
state, restored once."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]

SCRIPT = str(Path(__file__).with_name("ds_memory_train.py"))
STEPS = 12
NPROC = 2


def _restores(job) -> list[dict]:
    path = job.run_dir / "restores.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _args(*extra: str) -> list[str]:
    # persist_every beyond the run: the restore can only come from memory.
    return [SCRIPT, "--steps", str(STEPS), "--persist-every", "100", *extra]


def _kill(tmp_path: Path, *extra: str):
    rank, step = random.randrange(NPROC), random.randrange(3, STEPS)
    # No --max-restarts: restarts are on by default too (3).
    # A job takes 60-220 s on the 2 shared cores at load 15-30 (its agent alone 217 s once).
    job = robust_run(tmp_path, NPROC, "--inject", f"kill:rank={rank},step={step}", timeout_s=480,
                     script=_args(*extra))
    where = f"(kill:rank={rank},step={step} {' '.join(extra)})"
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["step"]) == ("crash", [rank], step), where
    return job, fault, step, where


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> dict:
    """``resume: false``: today's cold restart, which retrains from step 1 with the same batches
    and nothing restored, so its end state is the uninterrupted run's: the reference below."""
    pytest.importorskip("deepspeed")
    job, fault, step, where = _kill(tmp_path_factory.mktemp("cold"), "--load", "never", "--resume", "false")
    assert [r for r in _restores(job) if r["incarnation"] > 0] == [], where
    assert job.result["started_at"] == 1 and fault["resumed_at_step"] == 1, (where, fault)
    assert "checkpoint.resume:" not in job.output, where
    return job.result


def test_resume_false_keeps_the_cold_restart(cold):
    assert cold["started_at"] == 1  # the fixture's assertions are the test


@pytest.mark.parametrize("load", ["never", "always"])
def test_the_defaults_resume_a_sigkill_from_memory_bitwise(tmp_path, cold, load):
    """No ``resume`` key; ``load``: the script calls ``engine.load_checkpoint`` itself or not."""
    job, fault, step, where = _kill(tmp_path, "--load", load)
    restores = [r for r in _restores(job) if r["incarnation"] > 0]
    # Once: one restore a rank, even where the script loaded too (it got the resume's answer).
    assert sorted(r["rank"] for r in restores) == list(range(NPROC)), (where, restores)
    (resumed,) = {r["step"] for r in restores}
    assert resumed in (step - 1, step), (where, restores)  # at most one step lost
    assert {r["source"].split(":")[0] for r in restores} <= {"memory", "peer"}, (where, restores)
    assert job.result["started_at"] == resumed + 1 and fault["resumed_at_step"] == resumed + 1, where
    if load == "always":
        assert job.result["loaded"].startswith(f"memory://step{resumed}/"), (where, job.result)
        assert "the state was restored in deepspeed.initialize" in job.output, where
    # The first incarnation found nothing, the second resumed; rank 0 said so both times.
    assert "checkpoint.resume: nothing to resume" in job.output, where
    assert "checkpoint.resume: resumed from memory://" in job.output, where
    assert "[on by default under robust run]" in job.output, where
    for key in ("final_loss", "params_hash", "fp32_hashes"):
        assert job.result[key] == cold[key], (where, key)


def test_when_the_resume_runs():
    from robust_plugins.checkpoint.restore import resume_reason

    assert resume_reason(None, True, True, False) == "on by default under robust run"
    assert resume_reason(None, True, False, True) == "on by default under robust run"  # memory alone
    assert resume_reason(None, True, False, False) is None  # nothing to resume from
    assert resume_reason(None, False, True, True) is None  # outside robust run: asked only
    assert resume_reason(True, False, True, False) == "checkpoint.resume = true"
    assert resume_reason(False, True, True, True) is None


def test_which_script_loads_get_the_resumes_answer():
    pytest.importorskip("deepspeed")
    from robust_plugins.patches.deepspeed_resume import _full_load

    assert _full_load((), {}) and _full_load((True, True, True), {"load_module_only": False})
    assert not _full_load((), {"load_module_only": True})
    assert not _full_load((True, False), {})  # no optimizer states: loads as asked
    assert not _full_load((), {"custom_load_fn": print})

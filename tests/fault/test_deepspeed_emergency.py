"""DeepSpeed emergency saves and resume inside ``deepspeed.initialize``, through ``robust run``.

The script (``ds_emergency_train.py``) has no checkpoint code: its block asks for
``"checkpoint": {"resume": true, "persist_every": N}``. One rank is SIGKILLed at step 6:

* ZeRO 0 (3 ranks): the two live ranks' failing collective triggers the emergency save; one of
  them writes step 6 (no collective), the restarted job resumes at step 7 by itself and ends with
  bitwise the loss and parameters of a fault-free run;
* ZeRO 1 (2 ranks): the optimizer state is sharded, so the live rank skips the save and says why
  in ``faults.jsonl``; the job resumes from the last periodic checkpoint (step 4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import robust_run

pytestmark = [pytest.mark.fault, pytest.mark.distributed, pytest.mark.integration]

SCRIPT = str(Path(__file__).with_name("ds_emergency_train.py"))
STEPS = 10


def _job(run_dir: Path, nproc: int, *args: str, zero: int = 0, persist_every: int = 100):
    return robust_run(run_dir, nproc, *args, timeout_s=150,
                      script=[SCRIPT, "--steps", str(STEPS), "--zero", str(zero),
                              "--persist-every", str(persist_every)])


@pytest.mark.timeout(300)
def test_zero0_live_rank_saves_and_the_unchanged_script_resumes_there(tmp_path):
    job = _job(tmp_path / "fault", 3, "--max-restarts", "1", "--inject", "kill:rank=1,step=6")
    assert job.returncode == 0, job.output[-4000:]
    (crash,) = [f for f in job.faults if f["kind"] == "crash"]
    assert crash["suspect_ranks"] == [1]
    saves = crash["detail"]["emergency_save"]
    assert saves["0"]["ok"] is True and saves["2"]["ok"] is True and saves["0"]["step"] == 6, saves
    assert saves["1"]["ok"] is False  # the dead rank saved nothing
    # Exactly one live rank wrote it; the other saw it being written (or already committed).
    assert job.output.count("emergency checkpoint: committed") == 1, job.output[-4000:]
    assert crash["resumed_at_step"] == 7 and crash["lost_steps"] == 0, crash
    assert "checkpoint.resume: resumed from" in job.output
    ckpts = sorted(p.name for p in (tmp_path / "fault" / "ckpt").iterdir() if not p.name.startswith("."))
    assert ckpts == ["global_step6", "latest"], ckpts  # persist_every 100: the emergency save only
    assert job.result["started_at"] == 7
    clean = _job(tmp_path / "clean", 3, "--max-restarts", "0")
    assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
    assert clean.result["started_at"] == 1
    assert job.result["final_loss"] == clean.result["final_loss"]
    assert job.result["params_hash"] == clean.result["params_hash"]


@pytest.mark.timeout(200)
def test_zero1_skips_the_emergency_save_with_the_reason_and_resumes_from_disk(tmp_path):
    job = _job(tmp_path / "z1", 2, "--max-restarts", "1", "--inject", "kill:rank=1,step=6",
               zero=1, persist_every=4)
    assert job.returncode == 0, job.output[-4000:]
    (crash,) = [f for f in job.faults if f["kind"] == "crash"]
    live = crash["detail"]["emergency_save"]["0"]
    assert live["ok"] is False and "ZeRO stage 1 shards the optimizer state" in live["error"], live
    assert "rank 0 emergency save of step 6 skipped (EmergencySkip(" in job.output
    assert crash["resumed_at_step"] == 5 and crash["lost_steps"] == 2, crash  # steps 5, 6 again
    assert job.result["started_at"] == 5

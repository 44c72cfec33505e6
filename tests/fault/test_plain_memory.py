"""``robust run`` + a plain PyTorch loop (DDP, FSDP2) with :class:`robust_plugins.Snapshotter`: a
rank SIGKILLed at a random step resumes from shared memory, loses at most one step, and ends
bitwise equal to a run that never failed (parameters and optimizer state of every rank, every
loss; the loss depends on torch, numpy and Python RNG and a registered data position). The random
rank and step come from the printed ``ROBUST_TEST_SEED`` (set it to replay one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import robust_run

from robust_plugins.checkpoint import memory

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

SCRIPT = str(Path(__file__).with_name("plain_memory_train.py"))
STEPS = 12


def _restores(job) -> list[dict]:
    path = job.run_dir / "restores.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _script(mode: str, nproc: int, steps: int = STEPS) -> list[str]:
    # Over more than 2 ranks DDP must keep its bucket order for a bitwise resume (the script's
    # --static-buckets says why); over 2 the sum a + b does not depend on it. DDP runs also keep
    # peer copies and write background disk saves every 4 steps (the relaunch test reads them).
    return [SCRIPT, "--mode", mode, "--steps", str(steps), *(["--static-buckets"] if nproc > 2 else []),
            *(["--persist-every", "4", "--peer-backup"] if mode == "ddp" else [])]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """``clean_run(mode, nproc)``: the fault-free run the kill tests compare with, once a module."""
    runs = {}

    def get(mode: str, nproc: int):
        if (mode, nproc) not in runs:
            job = robust_run(tmp_path_factory.mktemp(f"clean-{mode}{nproc}"), nproc, "--max-restarts", "0",
                             timeout_s=150, script=_script(mode, nproc))
            assert job.returncode == 0 and job.faults == [], job.output[-3000:]
            assert job.result["started_at"] == 1 and job.result["restored"] is None
            runs[mode, nproc] = job
        return runs[mode, nproc]
    return get


# ("ddp", 4) passes too (two more 4-rank jobs, ~25 s): left out of the suite's time budget.
@pytest.mark.parametrize("mode,nproc", [("ddp", 2), ("fsdp", 2)])
def test_a_killed_rank_resumes_the_plain_loop_from_memory_bitwise(tmp_path, mode, nproc, draw, clean_run):
    rank, step = draw.randrange(nproc), draw.randrange(2, STEPS)
    where = f"(kill:rank={rank},step={step}, {mode} on {nproc} ranks, ROBUST_TEST_SEED={draw.seed_value})"
    clean = clean_run(mode, nproc)
    job = robust_run(tmp_path / "kill", nproc, "--max-restarts", "1", "--inject", f"kill:rank={rank},step={step}",
                     timeout_s=150, script=_script(mode, nproc))
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["step"]) == ("crash", [rank], step), where
    # Every rank of the second incarnation restored the same step from its own memory snapshot.
    restores = [r for r in _restores(job) if r["incarnation"] > 0]
    assert sorted(r["rank"] for r in restores) == list(range(nproc)), (where, restores)
    assert {r["source"] for r in restores} == {"memory"}, (where, restores)
    (resumed,) = {r["step"] for r in restores}
    assert resumed in (step - 1, step), (where, restores)  # at most one step lost
    assert job.result["started_at"] == resumed + 1 and fault["resumed_at_step"] == resumed + 1, where
    # Bitwise: every loss after the restore, every rank's parameters and optimizer state, and the
    # registered data position.
    for s, loss in job.result["losses"].items():
        assert loss == clean.result["losses"][s], (where, s)
    assert job.result["hashes"] == clean.result["hashes"], where
    assert job.result["pos"] == clean.result["pos"] == STEPS
    assert memory.job_files(memory.job_key(str(job.run_dir.resolve()))) == []


def test_a_relaunch_restores_the_background_disk_save_bitwise(tmp_path, clean_run):
    """A new ``robust run`` (another job id: nothing in memory) resumes from the newest disk
    checkpoint the snapshot thread wrote (``persist_every``; the fault-free run's, without its last
    one) and ends bitwise equal to the fault-free run."""
    clean = clean_run("ddp", 2)
    saved = sorted(p.name for p in (clean.run_dir / "ckpt").iterdir() if p.name.startswith("global_step"))
    assert saved == ["global_step12", "global_step4", "global_step8"], saved
    shutil.copytree(clean.run_dir / "ckpt", tmp_path / "job" / "ckpt",
                    ignore=lambda _d, names: [n for n in names if n == "global_step12"])
    job = robust_run(tmp_path / "job", 2, "--max-restarts", "0", timeout_s=150, script=_script("ddp", 2))
    assert job.returncode == 0, job.output[-3000:]
    assert job.result["restored"]["source"] == "disk:global_step8" and job.result["started_at"] == 9
    for s, loss in job.result["losses"].items():
        assert loss == clean.result["losses"][s], s
    assert job.result["hashes"] == clean.result["hashes"]

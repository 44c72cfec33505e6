"""``robust run`` + DeepSpeed with ``memory_every: 1`` and ``peer_backup``: a rank SIGKILLed at a
random step resumes from shared memory, loses at most one step, and ends bitwise equal to a
run that never failed (the script's loss depends on torch, numpy and Python RNG, so the restore
must bring back every rank's states); the job's shared-memory files are gone when it completes.
The random rank and step come from the printed ``ROBUST_TEST_SEED`` (set it to replay one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import robust_run

from robust_plugins.checkpoint import memory

pytestmark = [pytest.mark.fault, pytest.mark.timeout(270)]

SCRIPT = str(Path(__file__).with_name("ds_memory_train.py"))
STEPS = 16


def _restores(job) -> list[dict]:
    path = job.run_dir / "restores.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _shm_files(job) -> list[str]:
    return memory.job_files(memory.job_key(str(job.run_dir.resolve())))


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """``clean_run(nproc)``: the fault-free run of ``nproc`` ranks that the kill and the bit-flip
    tests compare with, run once a module (defaults only; disk saves every 8 steps, which do not
    change what is trained)."""
    runs = {}

    def get(nproc: int):
        if nproc not in runs:
            args = [SCRIPT, "--steps", str(STEPS), "--persist-every", "8"]
            clean = robust_run(tmp_path_factory.mktemp(f"clean{nproc}"), nproc, timeout_s=150, script=args)
            assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
            runs[nproc] = clean
        return runs[nproc]
    return get


@pytest.mark.parametrize("nproc", [2, 4])
def test_random_sigkill_resumes_from_memory_bitwise(tmp_path, nproc, draw, clean_run):
    pytest.importorskip("deepspeed")
    rank, step = draw.randrange(nproc), draw.randrange(3, STEPS)
    where = f"(kill:rank={rank},step={step}, {nproc} ranks, ROBUST_TEST_SEED={draw.seed_value})"
    args = [SCRIPT, "--steps", str(STEPS), "--persist-every", "8"]
    clean = clean_run(nproc)
    job = robust_run(tmp_path / "kill", nproc, "--max-restarts", "1", "--inject", f"kill:rank={rank},step={step}",
                     timeout_s=150, script=args)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["step"]) == ("crash", [rank], step), where
    # Every rank of the second incarnation restored one step from memory (its own slot, or a
    # peer's copy if its own newest was not committed when the kill came).
    restores = [r for r in _restores(job) if r["incarnation"] > 0]
    assert sorted(r["rank"] for r in restores) == list(range(nproc)), (where, restores)
    assert {r["source"].split(":")[0] for r in restores} <= {"memory", "peer"}, (where, restores)
    (resumed,) = {r["step"] for r in restores}
    assert resumed in (step - 1, step), (where, restores)  # at most one step lost
    assert job.result["started_at"] == resumed + 1 and fault["resumed_at_step"] == resumed + 1
    # Bitwise: loss, parameters and every rank's fp32 optimizer partition.
    assert job.result["final_loss"] == clean.result["final_loss"], where
    assert job.result["params_hash"] == clean.result["params_hash"], where
    assert job.result["fp32_hashes"] == clean.result["fp32_hashes"], where
    # The first incarnation found nothing and said so; both jobs cleaned /dev/shm at the end.
    assert "in-memory snapshots skipped" in clean.output
    assert _shm_files(clean) == [] and _shm_files(job) == []
    assert "removed" in job.output and "in-memory snapshot file(s)" in job.output


def test_a_lost_node_restores_from_the_peers_on_the_other_node(tmp_path, draw):
    """4 ranks on 2 simulated nodes (2x2): a rank of node 0 is SIGKILLed and, on restart, both
    node-0 ranks find their shared memory empty; their state comes from node 1's copies.
    ``ROBUST_TEST_SEED=520057743`` (step 14) once resumed at step 1: node 1 had overwritten the
    step whose copies it held (tests/distributed/test_peer_backup_lag.py)."""
    pytest.importorskip("deepspeed")
    rank, step = draw.randrange(2), draw.randrange(3, STEPS)
    where = f"(kill:rank={rank},step={step}, ROBUST_TEST_SEED={draw.seed_value})"
    env = {"ROBUST_TOPOLOGY_SIM": "2x2"}
    args = [SCRIPT, "--steps", str(STEPS), "--persist-every", "100", "--lose-node", "0,1"]
    clean = robust_run(tmp_path / "clean", 4, "--max-restarts", "0", timeout_s=150, script=args, env=env)
    assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
    job = robust_run(tmp_path / "kill", 4, "--max-restarts", "1", "--inject", f"kill:rank={rank},step={step}",
                     timeout_s=150, script=args, env=env)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    restores = {r["rank"]: r for r in _restores(job) if r["incarnation"] > 0}
    # plan_peers on 2x2: node 0's ranks 0, 1 are kept by node 1's ranks 2, 3 and vice versa
    assert {r: restores[r]["source"] for r in range(4)} == {0: "peer:2", 1: "peer:3", 2: "memory", 3: "memory"}, where
    (resumed,) = {r["step"] for r in restores.values()}
    # At most two steps: the peer copy of the step before the kill may still have been in flight
    # (the send never delays training); the agreed one before it is kept (checkpoint/peer.py).
    assert step - 2 <= resumed <= step, where
    assert job.result["params_hash"] == clean.result["params_hash"], where
    assert job.result["fp32_hashes"] == clean.result["fp32_hashes"], where
    assert _shm_files(job) == []


@pytest.mark.parametrize("fixed_step", [STEPS - 1, STEPS, None], ids=["second_to_last", "last", "random"])
def test_a_rollback_never_restores_a_snapshot_taken_after_the_bad_step(tmp_path, fixed_step, draw):
    """A NaN reported at step S makes robust run roll back; memory holds S (and maybe S+1), taken
    after the bad update: the restart must restore S-1 or older (from memory, else disk). The
    last two steps always: their ranks may finish and exit 0 before the NaN is seen."""
    pytest.importorskip("deepspeed")
    step = fixed_step if fixed_step is not None else draw.randrange(4, STEPS)
    where = f"(nan:rank=1,step={step}, ROBUST_TEST_SEED={draw.seed_value})"
    args = [SCRIPT, "--steps", str(STEPS), "--persist-every", "2"]
    job = robust_run(tmp_path / "nan", 2, "--max-restarts", "1", "--inject", f"nan:rank=1,step={step}",
                     timeout_s=150, script=args)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    assert (fault["kind"], fault["action"], fault["step"]) == ("nan", "rollback", step), where
    restores = [r for r in _restores(job) if r["incarnation"] > 0]
    assert len(restores) == 2 and len({r["step"] for r in restores}) == 1, (where, restores)
    assert restores[0]["step"] <= step - 1, (where, restores)
    assert job.result["started_at"] == restores[0]["step"] + 1, where


def test_the_last_steps_background_save_lands_before_the_group_is_destroyed(tmp_path):
    # The script's last step (8) is a persist step, and right after it the script destroys its
    # process group, over which that background save agrees. Before the plugin finished its
    # background work in destroy_process_group, the save failed on every rank
    # ("KeyError: 'manifest'", "Connection closed by peer") and step 4 stayed the newest on disk.
    pytest.importorskip("deepspeed")
    from robust_plugins.checkpoint.manifest import read_manifest, verify_files

    job = robust_run(tmp_path / "job", 2, "--max-restarts", "0", timeout_s=150,
                     script=[SCRIPT, "--steps", "8", "--persist-every", "4"])
    assert job.returncode == 0 and job.faults == [], job.output[-3000:]
    ckpt = tmp_path / "job" / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "global_step8", sorted(p.name for p in ckpt.iterdir())
    assert verify_files(ckpt / "global_step8", read_manifest(ckpt / "global_step8")) is None
    assert "snapshot failed" not in job.output and "hand-off failed" not in job.output, job.output[-3000:]


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_bit_flip_is_found_at_its_snapshot_and_rolled_back_one_step_from_memory(tmp_path, nproc, draw, clean_run):
    """Defaults only (no --max-restarts, no watchdog option): every snapshot's parameters are
    checked against the replicas on the snapshot thread, so a bit flipped on one rank at step S
    is found at the snapshot of S; the job rolls back to S-1 from memory (one step lost) and ends
    bitwise equal to a run without the flip. The replayed step agrees: a transient fault."""
    pytest.importorskip("deepspeed")
    rank, step = draw.randrange(nproc), draw.randrange(3, STEPS - 2)
    where = f"(bitflip:rank={rank},step={step}, {nproc} ranks, ROBUST_TEST_SEED={draw.seed_value})"
    args = [SCRIPT, "--steps", str(STEPS), "--persist-every", "100"]
    clean = clean_run(nproc)
    assert "checked against its" in clean.output, clean.output[-3000:]
    job = robust_run(tmp_path / "flip", nproc, "--inject", f"bitflip:rank={rank},step={step}",
                     timeout_s=150, script=args)
    assert job.returncode == 0, f"{where}\n{job.output[-3000:]}"
    (fault,) = job.faults
    # Two replicas that differ have no majority: both are named (param_hash.minority_ranks).
    suspects = [rank] if nproc > 2 else list(range(nproc))
    assert (fault["kind"], fault["action"], fault["step"], fault["suspect_ranks"]) == \
        ("sdc", "rollback", step, suspects), (where, fault)
    assert fault["detail"]["check_every"] == 1 and fault["detail"]["checked_by"] == "snapshot", (where, fault)
    assert fault["detail"]["replay"]["verdict"] == "transient", (where, fault)
    restores = [r for r in _restores(job) if r["incarnation"] > 0]
    assert sorted(r["rank"] for r in restores) == list(range(nproc)), (where, restores)
    assert {(r["step"], r["source"]) for r in restores} == {(step - 1, "memory")}, (where, restores)
    assert fault["lost_steps"] <= 1, (where, fault)
    assert job.result["final_loss"] == clean.result["final_loss"], where
    assert job.result["params_hash"] == clean.result["params_hash"], where
    assert job.result["fp32_hashes"] == clean.result["fp32_hashes"], where

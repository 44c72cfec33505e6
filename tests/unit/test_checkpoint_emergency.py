"""Emergency checkpoints written by one rank alone (``robust_plugins.checkpoint.emergency``)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from robust_plugins.checkpoint import emergency, store
from robust_plugins.errors import CheckpointError

LAYOUT = {"zero_stage": 0, "dp_world_size": 3, "train_batch_size": 12, "gradient_accumulation_steps": 1}


def _commit(root, rank, write, tag="global_step6", step=6):
    return emergency.commit_alone(str(root), tag, step, world_size=3, layout=LAYOUT,
                                  versions={"deepspeed": "x"}, rank=rank, write=write)


def _writer(payload: bytes, delay: float = 0.0):
    def write(staging):
        time.sleep(delay)
        with open(os.path.join(staging, "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(payload)
    return write


def test_plan_allows_only_a_state_one_rank_holds_in_full():
    assert emergency.plan(zero_stage=0) is None
    for stage in (1, 2):
        why = emergency.plan(zero_stage=stage)
        assert f"ZeRO stage {stage} shards the optimizer state" in why and "memory_every" in why
    assert "model-parallel" in emergency.plan(zero_stage=0, model_parallel=2)
    assert "residuals" in emergency.plan(zero_stage=0, has_residuals=True)


def test_one_rank_commits_a_checkpoint_the_job_loads_like_any_other(tmp_path):
    msg = _commit(tmp_path, 2, _writer(b"state" * 100))
    assert msg.startswith(f"committed {tmp_path}/global_step6 (step 6, 1 files")
    assert store.read_latest(str(tmp_path)) == "global_step6"
    choice = store.choose(str(tmp_path), {"world_size": 3, **LAYOUT})
    assert choice.tag == "global_step6" and choice.skipped == []
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")] == []
    # A later call (another live rank, late) finds it committed and writes nothing.
    assert "committed already" in _commit(tmp_path, 0, _writer(b"other"))
    assert (tmp_path / "global_step6" / "mp_rank_00_model_states.pt").read_bytes() == b"state" * 100


def test_of_racing_ranks_exactly_one_writes(tmp_path):
    results, wrote = {}, []

    def rank_main(rank):
        def write(staging):
            wrote.append(rank)
            _writer(bytes([rank]) * 1000, delay=0.2)(staging)
        results[rank] = _commit(tmp_path, rank, write)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(wrote) == 1, (wrote, results)
    winner = wrote[0]
    assert results[winner].startswith("committed ")
    for rank, msg in results.items():
        if rank != winner:
            assert msg == f"rank {winner} writes {tmp_path}/global_step6 (step 6)" or "committed" in msg, msg
    data = (tmp_path / "global_step6" / "mp_rank_00_model_states.pt").read_bytes()
    assert data == bytes([winner]) * 1000
    assert store.choose(str(tmp_path), {"world_size": 3, **LAYOUT}).tag == "global_step6"


def test_a_failed_write_commits_nothing_and_keeps_latest(tmp_path):
    assert _commit(tmp_path, 0, _writer(b"good"), tag="global_step3", step=3).startswith("committed")

    def broken(staging):
        with open(os.path.join(staging, "part.pt"), "wb") as f:
            f.write(b"half")
        raise OSError("No space left on device")

    with pytest.raises(CheckpointError, match="emergency checkpoint .*global_step6 .* failed on rank 1: "
                                              "OSError: No space left on device; nothing was committed"):
        _commit(tmp_path, 1, broken)
    assert store.read_latest(str(tmp_path)) == "global_step3"
    assert sorted(os.listdir(tmp_path)) == ["global_step3", "latest"]


def test_a_directory_without_manifest_is_not_overwritten(tmp_path):
    (tmp_path / "global_step6").mkdir()
    (tmp_path / "global_step6" / "mine.txt").write_text("user data")
    with pytest.raises(CheckpointError, match="exists without a robust_manifest.json; not overwritten"):
        _commit(tmp_path, 0, _writer(b"x"))
    assert (tmp_path / "global_step6" / "mine.txt").read_text() == "user data"


def test_config_resume_needs_a_directory_and_both_keys_are_booleans():
    from robust_plugins.config import CheckpointConfig
    from robust_plugins.errors import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint.resume = true needs robust_plugins.checkpoint.dir"):
        CheckpointConfig(resume=True)
    with pytest.raises(ConfigError, match=r"checkpoint.emergency_save must be true or false, got str"):
        CheckpointConfig(dir="c", emergency_save="yes")
    cfg = CheckpointConfig(dir="c", resume=True)
    assert cfg.emergency_save is True and "resume" in cfg.describe()


def test_plan_names_megatrons_distributed_optimizer():
    why = emergency.plan(zero_stage=1, host="megatron-core")
    assert why.startswith("megatron-core's distributed optimizer shards the optimizer state")

"""In-memory snapshots (``checkpoint.memory_every`` + ``peer_backup``), ZeRO 0/1/2 on 2 CPU ranks.

Per stage, one launch of ``ds_memory_worker.py`` (about 25 s) runs every scenario; a "restart" is a
fresh engine from a differently seeded model and RNG, so only restored state can make it right:

* snapshots every step leave training bitwise unchanged (vs the same job without them);
* restart -> own memory snapshot (step 5) -> continues bitwise as the reference;
* rank 1's shared memory wiped -> rank 1 restores from the copy its peer (rank 0) keeps;
* rank 0's newest slot corrupted -> skipped with a log line naming the crc mismatch, rank 0
  restores the same step from its peer's copy;
* rank 0's newest slot and rank 1's copy of it corrupted -> both ranks go back one step (the
  newest step every rank has), rank 0 from its other slot (the double buffer);
* ``persist_every: 3`` saves from the snapshot thread (background): a save that hits ENOSPC on
  one rank is logged as an error on every rank, commits nothing, and training goes on;
* every snapshot gone -> newest verified disk checkpoint (step 6, written in the background),
  with a log line saying why; that one corrupted too -> skipped, DeepSpeed's own step 4 is used;
  every path ends bitwise equal (weights and optimizer state on every rank) to the reference.
"""

import json
from pathlib import Path

import pytest

from _dist import run_script

pytestmark = [pytest.mark.integration]

WORKER = str(Path(__file__).with_name("ds_memory_worker.py"))


@pytest.fixture(scope="module", params=[0, 1, 2], ids=lambda s: f"zero{s}")
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"mem_zero{request.param}")
    run_script(WORKER, ["--stage", str(request.param), "--out", str(out)], nproc=2, timeout_s=240,
                 log_path=out / "launch.log")
    return request.param, out, json.loads((out / "results.json").read_text())


def _sources(x):
    return [(r or {}).get("source") for r in x["restored"]]


def test_every_restore_hands_back_each_ranks_rng_states(run):
    """The worker's loss is scaled by draws from torch, numpy and Python's RNG (seeded per rank),
    and each restart reseeds all three: right after load_checkpoint every rank's states must be
    the reference's at the resumed step (memory, peer copy, background disk save)."""
    _, _, r = run
    for case in ("own", "peer", "corrupt", "common", "disk"):
        assert r[case]["rng_restored"] == [True, True], case
    # DeepSpeed's own checkpoint holds no RNG state (the worker sets it back itself after it)
    assert r["older_disk"]["rng_restored"] == [False, False]


def test_snapshots_leave_training_unchanged_and_live_in_shared_memory(run):
    _, _, r = run
    ref = r["reference"]["losses"]
    assert r["main"]["losses"] == ref[:5]
    key = r["job_key"]
    # with the peer backup three own slots and three held slots per rank (the agreed step stays
    # while newer copies are in flight), named per job, rank and slot
    assert r["main"]["files"] == sorted(
        [f"robust_plugins.{key}.r0000{i}.s{s}" for i in (0, 1) for s in (0, 1, 2)]
        + [f"robust_plugins.{key}.r0000{i}.at0000{1 - i}.s{s}" for i in (0, 1) for s in (0, 1, 2)])
    assert r["main"]["holders"] == [1, 0]
    # one a step, plus step 4's again with save_checkpoint's client_state
    assert len(r["main"]["blocking_s"]) == 6 and all(b > 0 for b in r["main"]["blocking_s"])


def test_restart_restores_own_memory_snapshot_and_continues_exactly(run):
    _, _, r = run
    own = r["own"]
    assert own["resumed_at"] == 5 and own["load_path"] == "memory://step5/memory"
    assert _sources(own) == ["memory", "memory"]
    assert own["data_seen"] == 5 and own["data_order"] == [5] * 4  # registered data position
    assert own["losses"] == r["reference"]["losses"][5:6]


def test_wiped_rank_restores_from_its_peer(run):
    _, _, r = run
    peer = r["peer"]
    assert peer["resumed_at"] == 6 and _sources(peer) == ["memory", "peer:0"]
    assert "1 from a peer's copy" in " ".join(peer["log"])
    assert peer["losses"] == r["reference"]["losses"][6:7]


def test_corrupt_snapshot_is_skipped_with_a_reason_and_replaced_by_the_peer_copy(run):
    _, _, r = run
    c = r["corrupt"]
    assert c["resumed_at"] == 7 and _sources(c) == ["peer:1", "memory"]
    (skip,) = [ln for ln in c["log"] if "skipped" in ln]
    assert r["corrupted_file"] in skip and "step 7" in skip and "corrupted" in skip
    assert c["losses"] == r["reference"]["losses"][7:8]
    assert c["digests"] == r["reference"]["digests"]


def test_without_a_usable_newest_copy_every_rank_goes_back_to_the_common_step(run):
    _, _, r = run
    c = r["common"]
    assert c["resumed_at"] == 7 and _sources(c) == ["memory", "memory"]
    assert any("step 8" in ln and "corrupted" in ln for ln in c["log"])
    assert c["losses"] == r["reference"]["losses"][7:8]
    assert c["digests"] == r["reference"]["digests"]


def test_failed_background_save_is_reported_and_training_goes_on(run):
    _, _, r = run
    f = r["failed_persist"]
    assert f["failures"] == [1, 1]  # every rank counts it
    (err,) = [ln for ln in f["log"] if ln.startswith("ERROR") and "background save of step 3" in ln]
    assert "rank 1" in err and "No space left on device" in err and "was not committed" in err
    assert "global_step3" not in f["dirs"] and ".tmp-global_step3" not in f["dirs"]
    assert r["main"]["losses"] == r["reference"]["losses"][:5]  # training went on, unchanged


def test_background_saves_are_verified_checkpoints(run):
    _, _, r = run
    assert [d for d in r["dirs_after_runs"] if d.startswith("global_step")] == ["global_step4", "global_step6"]
    assert [p["step"] for p in r["persisted"]] == [6]


def test_no_snapshot_falls_back_to_the_newest_verified_disk_checkpoint_then_older(run):
    _, _, r = run
    d = r["disk"]
    assert d["resumed_at"] == 6 and d["load_path"].endswith("global_step6")
    assert any("in-memory snapshots skipped" in ln and "no snapshot in memory" in ln for ln in d["log"])
    assert d["losses"] == r["reference"]["losses"][6:8]
    assert d["digests"] == r["reference"]["digests"]
    o = r["older_disk"]
    assert o["resumed_at"] == 4 and o["load_path"].endswith("global_step4/mp_rank_00_model_states.pt")
    (skip,) = [ln for ln in o["log"] if "skipped checkpoint" in ln]
    assert "global_step6" in skip and "robust_snapshot_rank00001.bin" in skip and "corrupted" in skip
    assert o["losses"] == r["reference"]["losses"][4:8]
    assert o["digests"] == r["reference"]["digests"]


def test_zero0_bf16_wrapper_restores_from_memory_bitwise(run):
    stage, _, r = run
    if stage != 0:
        pytest.skip("ZeRO 0 only: its bf16/fp16 optimizer wrappers")
    b = r["bf16_zero0"]
    assert b["optimizer"] == "FP16_UnfusedOptimizer"
    assert b["load_path"] == "memory://step4/memory" and b["resumed_at"] == 4
    assert b["losses"] == b["ref_losses"]  # 4 before the restart, 2 after, as the uninterrupted run
    assert b["digests"] == b["ref_digests"]  # weights and Adam state on every rank


def test_unverified_optimizer_wrappers_are_refused():
    """A wrapper whose capture was not verified (anything but torch optimizers, ZeRO 1/2 and
    FP16_UnfusedOptimizer) is refused with the class name and what to do."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from robust_plugins.errors import UnsupportedError
    from robust_plugins.patches.deepspeed_memory import check_engine

    class BF16_Optimizer:  # noqa: N801 - DeepSpeed's GPU-only wrapper, by name
        pass

    with pytest.raises(UnsupportedError, match="has BF16_Optimizer, whose exact capture was not verified"):
        check_engine(SimpleNamespace(optimizer=BF16_Optimizer()))


CLIENT_STATE = {"epoch": 3, "sampler": {"position": ["torch.int64", [0, 7, 14, 21]], "name": "text"},
                "history": [1.5, 2]}


def test_client_state_survives_a_restore_from_memory_as_from_disk(run):
    _, _, r = run
    snap = r["client_state_snapshot"]
    # save_checkpoint at step 4 re-took step 4's snapshot (into another slot, retiring the
    # first): step 3 is still beside it, in each rank's own slots and in the peer's copies
    assert snap["own_steps"] == [[3, 4], [3, 4]] and snap["held_steps"] == [[3, 4], [3, 4]]
    assert snap["in_newest"] == {"step": 4, "state": CLIENT_STATE}
    # memory (own, peer), the background saver's disk checkpoint and DeepSpeed's own disk
    # checkpoint all hand back the same client_state, on every rank, without our bookkeeping key
    for case in ("own", "peer", "corrupt", "disk", "older_disk"):
        assert r[case]["client_state"] == [CLIENT_STATE, CLIENT_STATE], case
    assert r["older_disk"]["resumed_at"] == 4 and r["own"]["resumed_at"] == 5
    # restored step 5, client_state was given at step 4: said once
    (line,) = [ln for ln in r["own"]["log"] if "client_state returned" in ln]
    assert "given to save_checkpoint at step 4; the state restored is step 5" in line

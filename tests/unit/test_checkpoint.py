"""Verified checkpoints without processes: config, manifest, verification, choice, pruning, commit.

Directories are made up on the spot (a few small files per "checkpoint"); the save protocol is
driven in one process (torch.distributed not initialized), writing real files.
"""

import errno
import hashlib
import json
import os

import pytest

from robust_plugins.checkpoint import coord, store
from robust_plugins.checkpoint.disk import DiskCheckpointer
from robust_plugins.checkpoint.manifest import (
    MANIFEST_NAME, FileEntry, Manifest, ManifestError, describe_files, hash_file, list_files, read_manifest,
    verify_files, write_manifest,
)
from robust_plugins.config import CheckpointConfig, PluginConfig
from robust_plugins.errors import CheckpointError, ConfigError


# ------------------------------------------------------------------------------------ config
def test_checkpoint_block_parses_and_activates_the_plugin():
    cfg = PluginConfig.from_dict({"checkpoint": {"dir": "/ckpt", "persist_every": 200, "keep": 3,
                                                 "verify": "sha256"}})
    assert cfg.active and cfg.compression is None
    assert cfg.checkpoint == CheckpointConfig(dir="/ckpt", persist_every=200, keep=3)
    assert "checkpoint(dir=/ckpt, persist every 200 steps, keep=3, verify=sha256" in cfg.describe()


@pytest.mark.parametrize("sub, match", [
    ({"keep": 0}, r"checkpoint.keep = 0 must be >= 1"),
    ({"keep": True}, r"checkpoint.keep must be an integer, got a boolean"),
    ({"verify": "sha265"}, r"checkpoint.verify = 'sha265'.*Did you mean 'sha256'.*Allowed: sha256, none"),
    ({"persist_every": 0, "dir": "d"}, r"persist_every = 0 must be >= 1"),
    ({"persist_every": 10}, r"persist_every = 10 needs robust_plugins.checkpoint.dir"),
    ({"dir": ""}, r"checkpoint.dir = '' is empty"),
    ({"dir": 3}, r"checkpoint.dir must be a directory path"),
    ({"timeout_s": 0}, r"timeout_s = 0 must be a finite number"),
    ({"peer_backup": "yes"}, r"peer_backup must be true or false"),
    ({"memory_every": 0}, r"memory_every = 0 must be >= 1"),
    ({"keeep": 3}, r"Unknown key robust_plugins.checkpoint.keeep. Did you mean 'keep'"),
])
def test_checkpoint_block_errors_name_key_value_and_allowed(sub, match):
    with pytest.raises(ConfigError, match=match):
        PluginConfig.from_dict({"checkpoint": sub})


def test_peer_backup_needs_memory_snapshots_and_memory_every_is_accepted():
    with pytest.raises(ConfigError, match=r"peer_backup = true needs robust_plugins.checkpoint.memory_every"):
        PluginConfig.from_dict({"checkpoint": {"peer_backup": True}})
    cfg = PluginConfig.from_dict({"checkpoint": {"memory_every": 1, "peer_backup": True}}).checkpoint
    assert (cfg.memory_every, cfg.peer_backup) == (1, True)
    assert "memory every 1 steps + peer backup" in cfg.describe()


def test_dir_accepts_a_path_object(tmp_path):
    assert CheckpointConfig(dir=tmp_path).dir == str(tmp_path)


# ---------------------------------------------------------------------------------- helpers
def make_ckpt(root, tag, step, sequence, world_size=2, files=None, layout=None, with_sha=True):
    """A committed checkpoint directory with a correct manifest."""
    d = root / tag
    d.mkdir(parents=True)
    files = files or {"model.pt": b"m" * 100 + tag.encode(), "shard/rank1.pt": b"s" * 50}
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    m = Manifest(tag=tag, step=step, sequence=sequence, world_size=world_size,
                 files=tuple(describe_files(d, sorted(files), with_sha)), layout=layout or {"zero_stage": 1})
    write_manifest(d, m)
    return d


def flip(path):
    data = bytearray(path.read_bytes())
    data[3] ^= 0x40
    path.write_bytes(bytes(data))


# -------------------------------------------------------------------------------- manifest
def test_manifest_round_trip_and_hash(tmp_path):
    d = make_ckpt(tmp_path, "global_step10", 10, 1)
    m = read_manifest(d)
    assert m.tag == "global_step10" and m.step == 10 and m.world_size == 2
    assert [f.path for f in m.files] == ["model.pt", "shard/rank1.pt"]
    assert list_files(d) == ["model.pt", "shard/rank1.pt"]  # the manifest itself is not listed
    size, sha = hash_file(d / "shard/rank1.pt")
    assert (size, sha) == (50, hashlib.sha256(b"s" * 50).hexdigest())
    assert m.files[1] == FileEntry("shard/rank1.pt", 50, sha)
    assert verify_files(d, m) is None


@pytest.mark.parametrize("text, match", [
    ("{", "not valid JSON"),
    ("[]", "top level is list"),
    ('{"format": 99}', "format 99"),
    ('{"format": 1, "files": [], "tag": "t", "step": "10"}', "field 'step' is '10', expected int"),
    ('{"format": 1, "tag": "t", "step": 1, "sequence": 1, "world_size": 2, "files": [{"path": "a"}],'
     ' "layout": {}, "versions": {}, "saved_at": 0}', r"files\[0\]"),
])
def test_malformed_manifest_is_a_manifest_error(text, match):
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(text)


def test_verify_names_the_file_and_the_problem(tmp_path):
    d = make_ckpt(tmp_path, "t", 1, 1)
    m = read_manifest(d)
    flip(d / "model.pt")
    assert verify_files(d, m, check_hash=False) is None  # same size: only the hash sees it
    problem = verify_files(d, m)
    assert problem.startswith("file model.pt has sha256") and "(corrupted)" in problem

    d2 = make_ckpt(tmp_path, "t2", 1, 1)
    (d2 / "shard/rank1.pt").write_bytes(b"s" * 20)
    assert verify_files(d2, read_manifest(d2), check_hash=False) == \
        "file shard/rank1.pt is 20 bytes, the manifest says 50 (truncated)"

    d3 = make_ckpt(tmp_path, "t3", 1, 1)
    (d3 / "model.pt").unlink()
    assert verify_files(d3, read_manifest(d3)) == "file model.pt listed in the manifest is missing"

    d4 = make_ckpt(tmp_path, "t4", 1, 1)
    (d4 / "mp_rank_01_model_states.pt").write_bytes(b"x")  # a host globbing shards would read it
    assert verify_files(d4, read_manifest(d4)) == "file mp_rank_01_model_states.pt is not listed in the manifest"


def test_verify_none_manifest_checks_sizes_only(tmp_path):
    d = make_ckpt(tmp_path, "t", 1, 1, with_sha=False)
    m = read_manifest(d)
    assert all(f.sha256 is None for f in m.files)
    flip(d / "model.pt")
    assert verify_files(d, m) is None


# ----------------------------------------------------------------------- scan / choose
EXPECT = {"world_size": 2, "zero_stage": 1}


def test_choose_newest_intact_and_reports_every_skip(tmp_path):
    make_ckpt(tmp_path, "global_step10", 10, 1)
    make_ckpt(tmp_path, "global_step20", 20, 2)
    make_ckpt(tmp_path, "global_step30", 30, 3)
    make_ckpt(tmp_path, "global_step40", 40, 4)
    make_ckpt(tmp_path, "global_step50", 50, 5, world_size=4)
    flip(tmp_path / "global_step40" / "model.pt")
    (tmp_path / "global_step30" / "shard/rank1.pt").write_bytes(b"")
    (tmp_path / "global_step20" / MANIFEST_NAME).unlink()
    (tmp_path / ".tmp-global_step60").mkdir()
    (tmp_path / ".tmp-global_step60" / "model.pt").write_bytes(b"partial")
    (tmp_path / "tensorboard").mkdir()  # empty, unrelated: ignored
    (tmp_path / "latest").write_text("global_step40")

    choice = store.choose(str(tmp_path), EXPECT)
    assert choice.tag == "global_step10" and choice.found_any
    reasons = dict(choice.skipped)
    assert list(reasons) == [".tmp-global_step60", "global_step20", "global_step50", "global_step40",
                             "global_step30"]
    assert reasons[".tmp-global_step60"] == store.LEFTOVER
    assert reasons["global_step20"] == store.NO_MANIFEST
    assert reasons["global_step50"].startswith("saved with world_size=4, this job has world_size=2")
    assert "(corrupted)" in reasons["global_step40"]
    assert "(truncated)" in reasons["global_step30"]


def test_choose_orders_by_commit_sequence_not_step(tmp_path):
    # A run rolled back to step 10 and saved step 15 after an older step-20 checkpoint existed.
    make_ckpt(tmp_path, "global_step20", 20, 2)
    make_ckpt(tmp_path, "global_step15", 15, 3)
    assert store.choose(str(tmp_path), EXPECT).tag == "global_step15"


def test_choose_layout_mismatch_and_empty(tmp_path):
    make_ckpt(tmp_path, "a", 1, 1, layout={"zero_stage": 2})
    choice = store.choose(str(tmp_path), EXPECT)
    assert choice.tag is None and choice.found_any
    assert choice.skipped == [("a", "saved with zero_stage=2, this job has zero_stage=1 "
                                    "(loading into another layout is not supported yet)")]
    empty = store.choose(str(tmp_path / "nothing"), EXPECT)
    assert empty.tag is None and not empty.found_any and empty.skipped == []


def test_unreadable_manifest_is_skipped(tmp_path):
    d = make_ckpt(tmp_path, "a", 1, 1)
    (d / MANIFEST_NAME).write_text('{"format": 1, "tag"')
    (entry,) = store.scan(str(tmp_path))
    assert entry.problem.startswith(f"{MANIFEST_NAME} is unreadable: not valid JSON")


# ---------------------------------------------------------------------------- pruning
def test_plan_prune_counts_only_intact_checkpoints():
    newest_first = [("g6", True), ("g5", False), ("g4", True), ("g3", True), ("g2", False), ("g1", True)]
    assert store.plan_prune(newest_first, keep=3) == ["g2", "g1"]  # g5 (newer, broken) kept for inspection
    assert store.plan_prune(newest_first, keep=1) == ["g5", "g4", "g3", "g2", "g1"]
    assert store.plan_prune(newest_first, keep=10) == []
    with pytest.raises(ValueError):
        store.plan_prune(newest_first, keep=0)


def test_prune_deletes_old_and_leftovers_never_foreign_dirs(tmp_path):
    for i in range(1, 5):
        make_ckpt(tmp_path, f"g{i}", i, i)
    (tmp_path / "g3" / "model.pt").write_bytes(b"short")  # truncated: not counted
    (tmp_path / ".tmp-g9").mkdir()
    (tmp_path / "plain_ds").mkdir()
    (tmp_path / "plain_ds" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    deleted = store.prune(str(tmp_path), keep=2)
    assert sorted(deleted) == [".tmp-g9", "g1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g2", "g3", "g4", "plain_ds"]


# ------------------------------------------------------------------- commit primitives
def test_publish_replaces_an_existing_tag_and_latest_is_atomic(tmp_path):
    make_ckpt(tmp_path, "t", 1, 1)
    staging = tmp_path / ".tmp-t"
    staging.mkdir()
    (staging / "new.pt").write_bytes(b"new")
    store.publish(str(tmp_path), "t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    assert (tmp_path / "t" / "new.pt").read_bytes() == b"new"
    store.write_latest(str(tmp_path), "t")
    assert store.read_latest(str(tmp_path)) == "t"
    assert not (tmp_path / ".latest.tmp").exists()


@pytest.mark.parametrize("tag", ["", "a/b", ".tmp-x", "latest", ".."])
def test_bad_tags_are_refused(tag):
    with pytest.raises(CheckpointError, match="tag"):
        store.check_tag(tag)


# ----------------------------------------------------- the protocol, one process, real files
def _save(ckpt, root, tag, step, files, fail=None):
    staging = ckpt.begin(str(root), tag)
    for rel, data in files.items():
        path = os.path.join(staging, rel)
        if fail == rel:
            with open(path, "wb") as f:
                f.write(data[:3])
            ckpt.fail(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path), path)
            continue
        with open(path, "wb") as f:
            f.write(data)
        ckpt.record(path)
    return ckpt.finish(str(root), tag, step)


def test_protocol_commits_verifies_prunes_and_survives_a_failed_save(tmp_path):
    ckpt = DiskCheckpointer(CheckpointConfig(keep=2), rank=0, world_size=1, layout={"zero_stage": 0})
    root = tmp_path / "ckpt"
    for step in (10, 20):
        m = _save(ckpt, root, f"global_step{step}", step, {"a.pt": b"A" * step, "b.pt": b"B"})
        assert m.sequence == step // 10 and m.files[0] == FileEntry("a.pt", step, hash_file(root / m.tag / "a.pt")[1])
    assert store.read_latest(str(root)) == "global_step20"

    with pytest.raises(CheckpointError, match=r"rank 0: OSError: \[Errno 28\] No space left on device.*"
                                               r"'latest' still names 'global_step20'"):
        _save(ckpt, root, "global_step30", 30, {"a.pt": b"A" * 30, "b.pt": b"B"}, fail="b.pt")
    assert sorted(os.listdir(root)) == ["global_step10", "global_step20", "latest"]
    assert ckpt.select(str(root)) == "global_step20"

    _save(ckpt, root, "global_step30", 30, {"a.pt": b"A" * 30})
    assert sorted(os.listdir(root)) == ["global_step20", "global_step30", "latest"]  # keep=2

    flip(root / "global_step30" / "a.pt")
    assert ckpt.select(str(root)) == "global_step20"
    with pytest.raises(CheckpointError, match=r"global_step30 failed verification: file a.pt has sha256"):
        ckpt.select(str(root), "global_step30")
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.select(str(root), "global_step99")
    flip(root / "global_step20" / "a.pt")
    with pytest.raises(CheckpointError, match=r"No usable checkpoint in .*all 2 found were skipped"):
        ckpt.select(str(root))
    assert ckpt.select(str(tmp_path / "fresh")) is None


def test_verify_none_skips_hashing_but_not_sizes(tmp_path):
    ckpt = DiskCheckpointer(CheckpointConfig(verify="none"), rank=0, world_size=1)
    m = _save(ckpt, tmp_path, "t", 1, {"a.pt": b"abcdef"})
    assert m.files == (FileEntry("a.pt", 6, None),)
    flip(tmp_path / "t" / "a.pt")
    assert ckpt.select(str(tmp_path)) == "t"
    (tmp_path / "t" / "a.pt").write_bytes(b"ab")
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.select(str(tmp_path))


def test_coord_without_a_process_group_returns_local_values():
    assert coord.all_gather_json({"a": 1}, 1.0, "x") == [{"a": 1}]
    assert coord.broadcast_json(["t"], 1.0, "x") == ["t"]
    coord.barrier(1.0, "x")


def test_manifest_json_is_plain_and_sorted(tmp_path):
    d = make_ckpt(tmp_path, "t", 5, 1)
    data = json.loads((d / MANIFEST_NAME).read_text())
    assert data["format"] == 1 and data["step"] == 5 and data["layout"] == {"zero_stage": 1}
    assert [f["path"] for f in data["files"]] == ["model.pt", "shard/rank1.pt"]

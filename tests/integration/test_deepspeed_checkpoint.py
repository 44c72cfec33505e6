"""Verified, atomic DeepSpeed checkpoints (``"checkpoint"`` sub-block), ZeRO 0/1/2 on 2 CPU ranks.

Per stage, one launch of ``ds_checkpoint_worker.py`` (about 20 s) runs every scenario; each test
below reads one of them from ``results.json``:

* automatic saves at steps 10 and 20; a flipped byte in step 20's shard -> resume from 10 with one
  log line naming the tag, the file and the hash mismatch; the resumed run ends bitwise equal
  (losses and every rank's weights) to an uninterrupted vanilla DeepSpeed run;
* a truncated file, a missing manifest and a leftover temporary directory are skipped with one
  line each; an explicit bad tag and "nothing usable" are CheckpointErrors, an empty dir is a
  fresh start;
* a full disk (ENOSPC while one rank writes its shard) fails the save on every rank, leaves no
  temporary directory and ``latest`` on the previous checkpoint, which the next resume uses;
* ``keep`` prunes; plain DeepSpeed still loads through our ``latest``; a file that would run code
  when unpickled is refused and runs none; compression residuals are in the manifest and resume
  bitwise.
"""

import json
from pathlib import Path

import pytest

from _dist import run_script

pytestmark = [pytest.mark.integration]

WORKER = str(Path(__file__).with_name("ds_checkpoint_worker.py"))


@pytest.fixture(scope="module", params=[0, 1, 2], ids=lambda s: f"zero{s}")
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"ckpt_zero{request.param}")
    run_script(WORKER, ["--stage", str(request.param), "--out", str(out)], nproc=2, timeout_s=240,
                 log_path=out / "launch.log")
    return request.param, out, json.loads((out / "results.json").read_text())


def _skips(log):
    return [line for line in log if "skipped checkpoint" in line]


def test_saves_at_10_and_20_leave_training_unchanged(run):
    _, _, r = run
    assert r["hooks"] == [] and r["sync"] is False  # checkpoint block alone hooks no reduction ...
    assert r["main_losses"] == r["reference"]["losses"][:20]  # ... so training is vanilla's, bitwise
    after = r["main_after_20"]
    assert after["dirs"] == ["global_step10", "global_step20"]
    assert after["latest"] == "global_step20"
    assert sum("committed checkpoint" in line for line in after["log"]) == 2


def test_corrupted_byte_resumes_from_previous_and_continues_bitwise(run):
    _, _, r = run
    c = r["corrupt"]
    assert c["resumed_at"] == 10 and c["load_path"].endswith("global_step10/mp_rank_00_model_states.pt")
    (skip,) = _skips(c["log"])
    assert "global_step20" in skip and c["corrupted_file"] in skip and "sha256" in skip and "corrupted" in skip
    assert c["losses"] == r["reference"]["losses"][10:30]
    assert c["digests"] == r["reference"]["digests"]
    # the re-save of the corrupt tag replaced it; keep=3 holds all three
    assert c["dirs_after"] == ["global_step10", "global_step20", "global_step30"]


def test_truncated_file_skipped_and_explicit_tag_refused(run):
    _, _, r = run
    t = r["truncated"]
    assert t["resumed_at"] == 20
    (skip,) = _skips(t["log"])
    assert "global_step30" in skip and t["file"] in skip and "truncated" in skip
    err = r["explicit_bad_tag"]["error"]
    assert "global_step30" in err and t["file"] in err and "truncated" in err and "not loaded" in err


def test_missing_manifest_and_leftover_tmp_dir_skipped(run):
    _, _, r = run
    m = r["missing_manifest_and_leftover"]
    assert m["resumed_at"] == 10
    skips = _skips(m["log"])
    assert len(skips) == 3  # one line per skipped checkpoint
    assert any(".tmp-global_step40" in s and "leftover temporary directory" in s for s in skips)
    assert any("global_step20" in s and "no robust_manifest.json" in s for s in skips)
    assert any("global_step30" in s and "truncated" in s for s in skips)


def test_nothing_usable_is_an_error_and_empty_dir_a_fresh_start(run):
    _, _, r = run
    err = r["none_usable"]["error"]
    assert "No usable checkpoint" in err and "Nothing was loaded" in err and "all 4 found" in err
    assert r["empty_dir"]["load_path"] is None and "error" not in r["empty_dir"]
    assert any("starting from scratch" in line for line in r["empty_dir"]["log"])


def test_enospc_during_save_keeps_previous_checkpoint(run):
    stage, _, r = run
    e = r["enospc"]
    victim = 0 if stage == 0 else 1
    assert e["error"] and "No space left on device" in e["error"] and f"rank {victim}" in e["error"]
    assert "'latest' still names 'global_step10'" in e["error"]
    assert e["dirs"] == ["global_step10"]  # no global_step20, no .tmp-global_step20
    assert e["latest"] == "global_step10"
    a = r["after_enospc"]
    assert a["resumed_at"] == 10 and not _skips(a["log"])
    assert a["losses"] == r["reference"]["losses"][10:30]
    assert a["digests"] == r["reference"]["digests"]


def test_keep_prunes_oldest(run):
    _, _, r = run
    a = r["after_enospc"]
    assert a["dirs_after"] == ["global_step20", "global_step30"]  # keep=2
    assert any("pruned global_step10" in line for line in a["log_after"])


def test_plain_deepspeed_reads_our_latest(run):
    _, _, r = run
    v = r["vanilla_latest"]
    assert v["resumed_at"] == 30 and v["load_path"].endswith("global_step30/mp_rank_00_model_states.pt")
    assert v["digests"] == v["expected"]


def test_load_runs_no_code_from_the_file(run):
    _, _, r = run
    p = r["pickle_code"]
    assert p["code_ran"] is False
    assert "weights_only=True" in p["error"] and "mp_rank_00_model_states.pt" in p["error"]
    assert "the global os.makedirs" in p["error"]  # the refused global is named


def test_compression_residuals_are_checkpointed_and_verified(run):
    _, _, r = run
    i = r["int8"]
    assert i["resumed_at"] == 10
    assert {"robust_plugins_rank00000.pt", "robust_plugins_rank00001.pt"} <= set(i["files"])
    assert i["resumed"] == i["straight"][10:]
    assert i["digests"] == i["straight_digests"]


def test_save_cost_is_recorded(run):
    stage, _, r = run
    t = r["timing"]
    assert t["deepspeed"] > 0 and t["verified"] > 0 and t["bytes"] > 0
    print(f"zero{stage}: DeepSpeed save {t['deepspeed'] * 1e3:.1f} ms, verified save "
          f"{t['verified'] * 1e3:.1f} ms (x{t['verified'] / t['deepspeed']:.2f}), of which hashing "
          f"{t['hash_s'] * 1e3:.2f} ms, rank-0 commit {t['commit_s'] * 1e3:.1f} ms, {t['bytes']} bytes")

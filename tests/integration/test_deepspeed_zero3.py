"""DeepSpeed ZeRO-3 with the ``checkpoint`` sub-block on 2 CPU ranks: snapshots, restores, disk.

One set of ranks (``ds_zero3_worker.scenarios``) runs every scenario; each restart is a fresh
ZeRO-3 engine from a differently seeded model with differently seeded RNGs, so only restored
state can make it right. Against vanilla ZeRO-3 (no block), fp32 and bf16:

* snapshots every step leave training bitwise unchanged;
* restart -> each rank's own partitions from shared memory (step 4) -> continues bitwise;
* rank 1's shared memory wiped -> its partitions from the copy rank 0 keeps (step 6) -> bitwise;
* every snapshot gone -> the verified DeepSpeed ZeRO-3 checkpoint of step 2 -> bitwise;
* bf16: a restart from memory continues bitwise (bf16 partitions, fp32 masters, Adam).

"Bitwise" is each rank's fp32 master partition, low-precision parameter partition and Adam state,
and every loss after the restart.

The same launch checks the compressed reduce-scatter (``compression``): codec ``none`` bitwise
vanilla ZeRO-3 (fp32, bf16); int8 after one SGD(lr=1) step against an independent bound built from
every rank's plain-PyTorch gradient, and in bf16 against vanilla bf16's step; the reduce-scatter's
bytes computed by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

pytest.importorskip("deepspeed")
sys.path.insert(0, str(Path(__file__).parent))

from _dist import run_ranks  # noqa: E402

import ds_zero3_worker as worker  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    return run_ranks(worker.everything, 2, 150, str(out), init=False)


def _both(ranks, case, key):
    return [r[case][key] for r in ranks]


def test_the_model_has_persistent_and_partitioned_parameters(ranks):
    ref = ranks[0]["reference"]
    assert ref["persistent"] > 0 and ref["partitioned"] > 0, ref
    assert ranks[0]["reference"]["digest"] != ranks[1]["reference"]["digest"]  # disjoint partitions


def test_snapshots_every_step_leave_zero3_training_unchanged(ranks):
    for r in ranks:
        assert r["main"]["losses"] == r["reference"]["losses"][:4]
        assert len(r["main"]["blocking_s"]) == 5 and all(b > 0 for b in r["main"]["blocking_s"])  # 4 + step 2 again


def test_verified_save_of_zero3_writes_every_ranks_partition_files(ranks):
    files = ranks[0]["main"]["ckpt_files"]
    assert "robust_manifest.json" in files, files
    for dp in (0, 1):
        assert f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt" in files, files
        assert f"zero_pp_rank_{dp}_mp_rank_00_model_states.pt" in files, files


def test_restart_restores_each_ranks_own_partitions_and_continues_bitwise(ranks):
    for r in ranks:
        own = r["own"]
        assert own["load_path"] == "memory://step4/memory" and own["resumed_at"] == 4
        assert own["restored"]["source"] == "memory" and own["rng_restored"]
        assert own["losses"] == r["reference"]["losses"][4:6]


def test_wiped_rank_restores_its_partitions_from_the_peer_copy(ranks):
    assert [r["peer"]["restored"]["source"] for r in ranks] == ["memory", "peer:0"]
    for r in ranks:
        assert r["peer"]["resumed_at"] == 6 and r["peer"]["rng_restored"]
        assert r["peer"]["losses"] == r["reference"]["losses"][6:8]
        assert r["peer"]["digest"] == r["reference"]["digest"]


def test_without_snapshots_the_verified_zero3_disk_checkpoint_resumes_bitwise(ranks):
    for r in ranks:
        d = r["disk"]
        assert d["resumed_at"] == 2 and "global_step2" in d["load_path"], d["load_path"]
        assert d["losses"] == r["reference"]["losses"][2:8]
        assert d["digest"] == r["reference"]["digest"]
    log = ranks[0]["disk"]["log"]  # said once, on rank 0
    assert any("in-memory snapshots skipped" in ln for ln in log), log


def test_bf16_zero3_restart_from_memory_is_bitwise(ranks):
    for r in ranks:
        assert r["bf16_reference"]["dtype"] == "torch.bfloat16"
        assert r["bf16_main"]["losses"] == r["bf16_reference"]["losses"][:3]
        own = r["bf16_own"]
        assert own["load_path"] == "memory://step3/memory" and own["rng_restored"]
        assert own["losses"] == r["bf16_reference"]["losses"][3:6]
        assert own["digest"] == r["bf16_reference"]["digest"]


def test_no_shared_memory_left(ranks):
    assert [r["shm_left"] for r in ranks] == [[], []]


# ------------------------------------------------------------------ compression (ZeRO-3 reduce-scatter)
def test_codec_none_is_bitwise_vanilla_zero3_fp32_and_bf16(ranks):
    for r in ranks:
        for dtype in ("fp32", "bf16"):
            van, none = r["compression"][f"{dtype}_vanilla"], r["compression"][f"{dtype}_none"]
            assert none["plugin"] and not van["plugin"]
            assert none["losses"] == van["losses"], dtype
            assert none["digest"] == van["digest"], dtype


def test_oracle_matches_vanilla_zero3_sgd_step(ranks):
    """The independent oracle (plain-PyTorch gradients of every rank, laid out as DeepSpeed's
    reduce-scatter shard) reproduces vanilla ZeRO-3's SGD(lr=1) update of this rank's partition."""
    import torch

    for r in ranks:
        s = r["compression"]["sgd"]
        assert s["same_start"]
        oracle, vanilla = torch.tensor(s["oracle_update"]), torch.tensor(s["vanilla_update"])
        assert torch.allclose(oracle, vanilla, rtol=1e-5, atol=1e-7), (oracle - vanilla).abs().max()


def test_int8_reduce_scatter_update_is_within_the_codec_bound(ranks):
    """After one SGD(lr=1) step, vanilla - int8 weights = int8's gradient error. Each sender's int8
    block error is at most absmax(block) / 254 (round to nearest, 127 levels); the decoded sum
    adds the senders' errors: the worker's bound per element is the sum over ranks of its block's
    absmax / 254, blocks as the reduce-scatter lays them out, from every rank's plain gradient."""
    import torch

    for r in ranks:
        s = r["compression"]["sgd"]
        diff, bound = torch.tensor(s["vanilla_minus_int8"]), torch.tensor(s["bound"])
        assert diff.abs().max() > 0, "int8 gave vanilla's exact update: compression did not run"
        excess = diff.abs() - (bound * 1.001 + 1e-7)
        assert excess.max() <= 0, f"{int((excess > 0).sum())} of {diff.numel()} elements beyond the int8 bound"
        assert (diff.abs() > bound / 8).any(), "errors far below int8's bound: not int8 rounding"


def test_int8_zero3_error_feedback_residual_is_what_the_first_step_lost(ranks):
    """After one int8 step from zero residuals, each rank's sender residual is, element by element,
    what it sent (its shard for each destination of its gradient / world) minus that row's int8
    round trip, computed by hand from its plain-PyTorch gradient: within half an int8 step of its
    block, the same direction (cosine) and energy as by hand. A residual kept with the wrong sign,
    scale or layout, or not kept, fails."""
    import torch

    for r in ranks:
        s = r["compression"]["sgd_residual"]
        got, want, half = torch.tensor(s["got"]), torch.tensor(s["expected"]), torch.tensor(s["half_step"])
        assert got.numel() == want.numel() and want.norm() > 0
        assert (got.abs() <= half * 1.001 + 1e-9).all(), float((got.abs() - half).max())
        cosine = float(got @ want / (got.norm() * want.norm()))
        assert cosine > 0.99, cosine
        assert abs(float(got.norm() / want.norm()) - 1) < 0.02


def test_int8_bf16_one_step_is_vanilla_bf16_within_int8_and_bf16_rounding(ranks):
    """bf16 ZeRO-3, one SGD(lr=1) step from the same weights and batch: the fp32 master partitions
    move by the reduced gradient, so vanilla's update minus int8's is int8's error plus bf16's
    rounding (vanilla rounds its bf16 sum, int8 its fp32 result to bf16: 2^-8 of the value each).
    The int8 part is the fp32 oracle's largest per-element bound, with 25 % for the bf16 model's
    gradients differing from the fp32 model's. Norms agree to 2 %: a gradient divided by the world
    size once more (0.5 x) fails; one passed uncompressed fails on the bytes and the error floor."""
    import math

    import torch

    bf16_half_ulp = 2.0**-8
    w, bs = 2, 256
    for r in ranks:
        b, s = r["compression"]["sgd_bf16"], r["compression"]["sgd"]
        van, q = torch.tensor(b["vanilla_update"]), torch.tensor(b["int8_update"])
        assert van.numel() == q.numel() > 0 and b["compressed"] > 0
        ratio, rel = float(q.norm() / van.norm()), float((q - van).norm() / van.norm())
        assert abs(ratio - 1) < 0.02, f"int8 bf16 reduced gradient norm {ratio:.4f} x vanilla bf16's"
        assert 0 < rel < 0.05, rel
        diff, int8_bound = (q - van).abs(), 1.25 * max(s["bound"])
        excess = diff - (int8_bound + 2 * bf16_half_ulp * van.abs() + 1e-8)
        assert excess.max() <= 0, f"{int((excess > 0).sum())} of {diff.numel()} elements beyond the bound"
        assert (diff > int8_bound / 10).any(), "errors of bf16 rounding only: not int8"
        by_op = b["by_op"]["bf16_int8"]
        padded = math.ceil(s["shard_numel"] / bs) * bs
        assert by_op.get("all_to_all_single") == (w - 1) * (padded + 4 * padded // bs), by_op
        assert "reduce_scatter_tensor" not in by_op and "reduce_scatter_tensor" in b["by_op"]["bf16_vanilla"]


def test_reduce_scatter_wire_bytes_computed_by_hand(ranks):
    """Vanilla: reduce_scatter_tensor of the interleaved fp32 bucket, (W-1)/W of its W*S*4 bytes.
    int8: one all_to_all_single row per destination, each ceil(S/256)*256 code bytes + 4 bytes a
    block of scales; the row for this rank itself does not go on the wire."""
    import math

    w, bs = 2, 256
    for r in ranks:
        s = r["compression"]["sgd"]
        shard = sum(math.ceil(n / w) for n in s["numels"])
        assert shard == s["shard_numel"]
        by_op = s["by_op"]
        assert by_op["vanilla"].get("reduce_scatter_tensor") == (w - 1) * shard * 4, by_op["vanilla"]
        padded = math.ceil(shard / bs) * bs
        assert by_op["int8"].get("all_to_all_single") == (w - 1) * (padded + 4 * padded // bs), by_op["int8"]
        assert "reduce_scatter_tensor" not in by_op["int8"], by_op["int8"]


def test_zero3_telemetry_counts_all_gather_and_reduce_scatter_by_hand(ranks):
    """Rank 0's records (int8, 2 ranks, log every step). From step 2 on (step 1 records the
    prefetch trace and gathers everything), forward all-gathers each partitioned parameter once:
    (W-1)/W x 4 x its aligned numel, summed; backward re-gathers nothing (kept since forward) and
    reduce-scatters one bucket: the int8 all-to-all row of the hand computation above."""
    import math

    t = ranks[0]["compression"]["telemetry"]
    steps = [r for r in t["records"] if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    w = 2
    gather = sum(math.ceil(n / w) * w * 4 * (w - 1) // w for n in t["partitioned_numels"])
    shard = sum(math.ceil(n / w) for n in ranks[0]["compression"]["sgd"]["numels"])
    padded = math.ceil(shard / 256) * 256
    row = padded + 4 * padded // 256
    for r in steps:
        z = r["zero3"]
        assert z["backward_reduce_scatter_bytes"] == (w - 1) * row, z
        assert z["forward_reduce_scatter_bytes"] == 0 and z["forward_comm_s"] > 0 and z["backward_comm_s"] > 0, z
    for r in steps[1:]:
        assert r["zero3"]["forward_all_gather_bytes"] == gather, r["zero3"]
        assert r["zero3"]["backward_all_gather_bytes"] == 0, r["zero3"]


def test_int8_zero3_trains_like_vanilla_and_its_residuals_survive_a_restart(ranks):
    for r in ranks:
        c = r["compression"]
        van, q = c["fp32_vanilla_long"]["losses"], c["int8_long"]["losses"]
        assert q != van and c["int8_long"]["residual_sq"] > 0  # compressed, with residuals kept
        assert c["int8_long"]["detach"] == [True, False]  # bound on the optimizer; detach() removes it
        assert _tracks(q, van), (q[-5:], van[-5:])
        # snapshots of partitions + residuals: a restart at step 10 ends bitwise the uninterrupted run
        restart = c["int8_restart"]
        assert restart["load_path"] == "memory://step10/memory"
        assert restart["losses"] == q and restart["digest"] == c["int8_long"]["digest"]


def test_int8_zero3_with_bf16_gradients_trains_like_vanilla_bf16(ranks):
    for r in ranks:
        c = r["compression"]
        van, q = c["bf16_vanilla_long"]["losses"], c["bf16_int8_long"]["losses"]
        assert q != van and c["bf16_int8_long"]["compressed"] > 0
        assert _tracks(q, van), (q[-5:], van[-5:])


def _tracks(q: list[float], van: list[float]) -> bool:
    """Each of the last 5 losses within 2 % of vanilla's at the same step, but for one: this tiny
    model's loss jumps at step 20 on one rank (3.0 -> 4.7), where runs that agreed to 1e-3 until
    then part by up to 8 % (fp32 and bf16 vanilla too, by CPU: oneDNN's kernels differ)."""
    rel = sorted(abs(a - b) / b for a, b in zip(q[-5:], van[-5:]))
    return rel[-2] < 0.02

"""DeepSpeed's pipeline engine with the ``checkpoint`` sub-block: 2 stages x 2 data-parallel replicas.

One set of 4 ranks (``ds_pipeline_worker.scenarios``), ZeRO-1, fp32: vanilla pipeline training
(no block) is the reference; with snapshots every step and a verified save at step 2 it is
unchanged; a restart (fresh engine, other seed) restores each stage's own snapshot and continues
bitwise; with every snapshot gone it loads the verified pipeline checkpoint (DeepSpeed's per-layer
files) and continues bitwise. Each stage's data-parallel gradient reduction with codec ``none`` is
bitwise vanilla; with ``int8`` it goes through the compressed collective (bytes counted on the
stage's data-parallel group) and the loss stays within 2 % of vanilla's. With
``topology.hierarchical`` (simulated layouts) each stage's DP group is mapped onto the node and
rail groups: ``none`` bitwise vanilla, ``int8`` across nodes within its bound of vanilla's update
after one SGD(lr=1) step with the bytes by hand, nothing quantized inside a node, ``auto`` told a
slow link sends int8.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

pytest.importorskip("deepspeed")
sys.path.insert(0, str(Path(__file__).parent))

from _dist import run_ranks  # noqa: E402

import ds_pipeline_worker as worker  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    return run_ranks(worker.scenarios, 4, 150, str(out), init=False)


def test_layout_is_two_stages_of_two_replicas(ranks):
    assert sorted((r["reference"]["stage"], r["reference"]["dp"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    losses = {tuple(r["reference"]["losses"]) for r in ranks}
    assert len(losses) == 1, losses  # train_batch's loss reaches every stage


def test_snapshots_leave_pipeline_training_unchanged_and_save_layer_files(ranks):
    for r in ranks:
        assert r["main"]["losses"] == r["reference"]["losses"][:3]
    files = ranks[0]["main"]["ckpt_files"]
    assert "robust_manifest.json" in files and any(f.startswith("layer_") for f in files), files


def test_restart_restores_each_stage_from_memory_and_continues_bitwise(ranks):
    for r in ranks:
        own = r["own"]
        assert own["load_path"] == "memory://step3/memory" and own["resumed_at"] == 3
        assert own["restored"]["source"] == "memory"
        assert own["losses"] == r["reference"]["losses"][3:]
        assert own["digest"] == r["reference"]["digest"]


def test_without_snapshots_the_verified_pipeline_checkpoint_resumes_bitwise(ranks):
    for r in ranks:
        d = r["disk"]
        assert d["resumed_at"] == 2 and "global_step2" in d["load_path"], d["load_path"]
        assert d["losses"] == r["reference"]["losses"][2:]
        assert d["digest"] == r["reference"]["digest"]


def test_no_shared_memory_left(ranks):
    assert all(r["shm_left"] == [] for r in ranks)


def test_codec_none_is_bitwise_the_vanilla_pipeline_engine(ranks):
    for r in ranks:
        assert r["codec_none"]["losses"] == r["reference"]["losses"]
        assert r["codec_none"]["digest"] == r["reference"]["digest"]
        assert r["codec_none"]["compressed_elements"] == 0


def test_int8_compresses_each_stages_data_parallel_reduction(ranks):
    import math

    for r in ranks:
        q, van = r["codec_int8"], r["reference"]
        assert q["compressed_elements"] > 0 and q["digest"] != van["digest"]
        assert abs(q["losses"][-1] - van["losses"][-1]) / van["losses"][-1] < 0.02, (q["losses"], van["losses"])
        # One step on the stage's 2-rank DP group, computed by hand. The gradient (N elements,
        # one bucket) is padded to a multiple of 2 x 256 and cut in 2 chunks; each chunk travels
        # as int8 codes + one fp32 scale per 256: one row to the peer in the all-to-all, one row
        # in the all-gather of the reduced chunks. ZeRO-1 then all-gathers the updated fp32
        # parameters: (W-1)/W x 4N bytes. Vanilla's fp32 ring all-reduce would be 2 (W-1)/W x 4N.
        n, w = q["grad_numel"], 2
        chunk = math.ceil(n / (w * 256)) * 256
        row = chunk + 4 * (chunk // 256)
        assert q["by_op"]["all_to_all_single"] == (w - 1) * row, q["by_op"]
        assert q["by_op"]["all_gather_into_tensor"] == (w - 1) * row + (w - 1) * n * 4 // w, q["by_op"]
        assert 2 * (w - 1) * row / (2 * (w - 1) / w * 4 * n) < 0.26
        assert math.isclose(r["codec_none"]["losses"][0], van["losses"][0])


def test_pipeline_telemetry_reports_the_last_stages_loss_and_each_stages_dp_bytes(ranks):
    """Rank 0's records (int8, log every step): the loss is train_batch's (the last stage's mean of
    its micro-batches), tokens are the first stage's (2 replicas x 2 micro-batches x 4 x 32 a
    step), and each rank's gradient bytes are its stage's compressed DP reduction: the all-to-all
    row and the all-gather row of the hand computation in the test above."""
    import math

    steps = [r for r in ranks[0]["telemetry"] if r.get("kind") == "step"]
    losses = ranks[0]["codec_int8"]["losses"]
    assert [r["step"] for r in steps] == list(range(1, len(losses) + 1))
    for rec, loss in zip(steps, losses):
        assert math.isclose(rec["loss"], loss, rel_tol=1e-6), (rec["loss"], loss)
    for rec in steps[1:]:
        assert rec["tokens_per_s"] > 0
    by_rank = steps[-1]["grad_bytes_per_step_by_rank"]
    for rank, r in enumerate(ranks):
        n = r["codec_int8"]["grad_numel"]
        chunk = math.ceil(n / 512) * 256
        assert by_rank[rank] == 2 * (chunk + 4 * (chunk // 256)), (rank, by_rank)


def test_hierarchy_maps_each_stages_dp_group_onto_the_topology(ranks):
    """Stage-major grid: DP pairs {0,1} and {2,3}. On "2x2" a pair is one node (node group = the
    pair, no rail); on "4x1" a pair spans two nodes (node group = the rank, rail = the pair)."""
    for rank, r in enumerate(ranks):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        h = r["hier"]
        for name in ("hier_none_4x1", "hier_int8_4x1", "auto_4x1"):
            assert h[name]["planned"] and (h[name]["intra"], h[name]["rail"]) == ([rank], pair), (name, h[name])
        for name in ("hier_none_2x2", "hier_int8_2x2"):
            assert h[name]["planned"] and (h[name]["intra"], h[name]["rail"]) == (pair, [rank]), (name, h[name])
        for name in ("hier_none_4x1", "hier_none_2x2", "hier_int8_4x1", "hier_int8_2x2"):
            codec = name.split("_")[1]
            # Every element of the step went through the hierarchy, with the configured codec.
            assert h[name]["hier"] == h[name]["numel"] and h[name]["by_codec"] == {codec: h[name]["numel"]}, h[name]


def test_hierarchical_none_is_bitwise_the_vanilla_pipeline_engine(ranks):
    import torch

    for r in ranks:
        h = r["hier"]
        for name in ("hier_none_4x1", "hier_none_2x2"):
            assert torch.equal(h[name]["update"], h["vanilla"]["update"]), name  # a sum of two, either order


def test_hierarchical_int8_across_nodes_within_its_bound_and_bytes_by_hand(ranks):
    """One SGD(lr=1) step: the update is the stage's reduced gradient, vanilla's is the oracle.
    Each DP rank's local gradient (at most ``absmax``) is quantized once to the rail peer (half an
    int8 step: absmax / 254 a sender, two senders), the reduced sum (at most 2 x absmax) once
    more for the all-gather, and DeepSpeed divides by 2: at most absmax / 127 an element."""
    import math

    import torch

    for rank, r in enumerate(ranks):
        h = r["hier"]
        van = h["vanilla"]["update"]
        pair = (rank - rank % 2, rank - rank % 2 + 1)
        bound = max(ranks[x]["hier"]["vanilla"]["absmax"] for x in pair) / 127
        for name in ("hier_int8_4x1", "auto_4x1"):
            err = float((h[name]["update"] - van).abs().max())
            assert 0 < err <= bound * (1 + 1e-5), (name, err, bound)
            rel = float((h[name]["update"] - van).norm() / van.norm())
            assert 1e-4 < rel < 3e-2, (name, rel)
        # Across nodes: one int8 row to the rail peer in the all-to-all and one in the all-gather
        # (chunk = the gradient padded to 2 x 256, halved; a 4-byte scale per 256); the node
        # group is the rank alone.
        n = h["hier_int8_4x1"]["numel"]
        chunk = math.ceil(n / 512) * 256
        assert h["hier_int8_4x1"]["bytes"] == {"rail": 2 * (chunk + 4 * (chunk // 256)), "intra": 0}
        # Told a slow link, auto sends int8 across it too (flat: on a pair with one rank a node the
        # hierarchy's route carries the same bytes).
        assert {c for _, c in h["auto_4x1"]["decisions"]} == {"int8"}, h["auto_4x1"]["decisions"]
        # Inside a node nothing is quantized: the pair's sum in fp32, as vanilla's.
        assert torch.equal(h["hier_int8_2x2"]["update"], van)
        assert h["hier_int8_2x2"]["bytes"]["rail"] == 0
    decisions = [r["hier"]["auto_4x1"]["decisions"] for r in ranks]
    assert decisions[0] == decisions[1] and decisions[2] == decisions[3], decisions  # a DP pair agrees


def test_flat_int8_one_step_is_vanilla_within_its_bound_with_vanilla_norms(ranks):
    """The flat two-phase int8 all-reduce of each stage's DP pair, one SGD(lr=1) step against the
    vanilla pipeline engine's: within absmax / 127 an element (as the hierarchical test above),
    the norms agree to 2 % (a gradient averaged twice is 0.5 x) and the error is not 0 (a
    gradient passed uncompressed)."""
    for rank, r in enumerate(ranks):
        h = r["hier"]
        got, van = h["flat_int8"]["update"], h["vanilla"]["update"]
        assert h["flat_int8"]["by_codec"].get("int8", 0) > 0, h["flat_int8"]["by_codec"]
        ratio, rel = float(got.norm() / van.norm()), float((got - van).norm() / van.norm())
        assert abs(ratio - 1) < 0.02 and 1e-4 < rel < 3e-2, (ratio, rel)
        pair = (rank - rank % 2, rank - rank % 2 + 1)
        bound = max(ranks[x]["hier"]["vanilla"]["absmax"] for x in pair) / 127
        err = float((got - van).abs().max())
        assert 0 < err <= bound * (1 + 1e-5), (err, bound)

"""megatron-core in 3D on gloo ranks: its own pipeline schedules and optimizers, with robust_plugins.

Two launches (4 ranks, then 2) run every scenario in one process group each: TP x PP x DP
layouts, fp32 and bf16 (``Float16Module``), fp32 and bf16 gradient buffers, megatron's
``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer`` from
``get_megatron_optimizer``, 1F1B and interleaved (virtual stages), every model chunk enabled; the
interleaved DP 2 scenario with the telemetry recorder; on 2 ranks, ``MegatronCheckpointer`` on
both chunks of an interleaved model (fp16 with the dynamic loss scaler; bf16 with the distributed
optimizer), restored into fresh builds. Vanilla megatron-core is the oracle: codec ``none`` trains bitwise as it does; ``int8``'s reduced gradient of step 1 (same
weights, same batch) differs from vanilla's on every stage by at most the codec's bound: half a
quantization step of the largest local gradient per quantization (two for the all-reduce, one
for the distributed optimizer's reduce-scatter), summed over the two stages (the tied embedding's
gradient is both stages' reduced gradients, added by megatron's embedding-group all-reduce).
"""

from __future__ import annotations

import math

import pytest
import torch

from _dist import run_ranks

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]

STEPS = 4
ALL, EXACT = (None, "none", "int8"), (None, "none")
FOUR = [  # 4 ranks
    {"name": "pp2_dp2_fp32", "tp": 1, "pp": 2, "bf16": False, "distopt": False, "codecs": ALL},
    {"name": "pp2_dp2_fp32_distopt", "tp": 1, "pp": 2, "bf16": False, "distopt": True, "codecs": ALL},
    {"name": "pp2_dp2_bf16_distopt", "tp": 1, "pp": 2, "bf16": True, "distopt": True, "codecs": ALL},
    {"name": "pp2_dp2_bf16_distopt_overlap", "tp": 1, "pp": 2, "bf16": True, "distopt": True, "overlap": True,
     "codecs": ALL},
    {"name": "pp2_vpp2_dp2_bf16_distopt", "tp": 1, "pp": 2, "vpp": 2, "bf16": True, "distopt": True, "codecs": ALL,
     "telemetry": True},
    # bf16 gradient buffers (grad_reduce_in_fp32 = False): the all-reduce and the reduce-scatter in bf16
    {"name": "pp2_dp2_bf16_bf16grads", "tp": 1, "pp": 2, "bf16": True, "distopt": False, "grad_fp32": False,
     "codecs": ALL},
    {"name": "pp2_dp2_bf16_bf16grads_distopt", "tp": 1, "pp": 2, "bf16": True, "distopt": True, "grad_fp32": False,
     "codecs": ALL},
    {"name": "tp2_pp2_fp32", "tp": 2, "pp": 2, "bf16": False, "distopt": False, "codecs": EXACT},
    {"name": "tp2_pp2_bf16", "tp": 2, "pp": 2, "bf16": True, "distopt": False, "codecs": EXACT},
]
TWO = [  # 2 ranks: pipeline only
    {"name": "pp2_fp32", "tp": 1, "pp": 2, "bf16": False, "distopt": False, "codecs": EXACT},
    {"name": "pp2_bf16", "tp": 1, "pp": 2, "bf16": True, "distopt": False, "codecs": EXACT},
    {"name": "pp2_vpp2_fp32", "tp": 1, "pp": 2, "vpp": 2, "bf16": False, "distopt": False, "codecs": EXACT},
]
CHECKPOINTER = [  # 2 ranks, interleaved (pp 2 x vpp 2), mcore_pp_worker.checkpointer_replay
    # fp16 with megatron's dynamic loss scaler (Float16OptimizerWithFloat16Params): memory and disk
    {"name": "ckpt_vpp2_fp16", "vpp": 2, "bf16": False, "fp16": True, "distopt": False, "codec": "int8",
     "optimizer_config": {"initial_loss_scale": 1024.0, "loss_scale_window": 2}},
    # bf16, megatron's DistributedOptimizer, tied embeddings: memory; disk refused
    {"name": "ckpt_vpp2_bf16_distopt", "vpp": 2, "bf16": True, "distopt": True, "codec": "int8"},
]
INT8_HALF_STEP = 0.5 / 127
BF16_HALF_ULP = 2.0**-8  # relative: a bf16 rounding moves a value by at most 2^-8 of it (8 mantissa bits)


def _scenarios(rank, world, scenarios, steps, out_dir=None, checkpointer=()):
    from mcore_pp_worker import pipeline_scenarios

    return pipeline_scenarios(rank, world, scenarios, steps, out_dir, checkpointer)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks(_scenarios, 4, 240, FOUR, STEPS, str(tmp_path_factory.mktemp("pp4")))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(_scenarios, 2, 120, TWO, STEPS, str(tmp_path_factory.mktemp("pp2")), CHECKPOINTER)


def _results(request, name):
    return request.getfixturevalue("four" if any(s["name"] == name for s in FOUR) else "two")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [s["name"] for s in FOUR + TWO])
def test_codec_none_is_bitwise_vanilla(request, name):
    for rank, res in enumerate(_results(request, name)):
        vanilla, none = res[name]["None"], res[name]["none"]
        assert none["losses"] == vanilla["losses"], (name, rank)
        assert none["digest"] == vanilla["digest"], (name, rank)
        assert none["grad1"].equal(vanilla["grad1"]), (name, rank)
        assert all(math.isfinite(v) for v in vanilla["losses"]) and vanilla["losses"][-1] < vanilla["losses"][0]
        assert none["steps"] and all(s == STEPS for s in none["steps"]), none["steps"]  # every chunk synced
        assert none["chunks"] == (2 if "vpp" in name else 1)
        want = {"DistributedOptimizer"} if "distopt" in name else (
            {"Float16OptimizerWithFloat16Params"} if "bf16" in name else {"FP32Optimizer"})
        assert set(vanilla["inner"]) == want, vanilla["inner"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [s["name"] for s in FOUR if "int8" in s["codecs"]])
def test_int8_step1_gradients_of_every_stage_within_the_codec_bound(request, name):
    res = _results(request, name)
    stages = set()
    for rank, r in enumerate(res):
        vanilla, int8 = r[name]["None"], r[name]["int8"]
        assert int8["compressed"] > 0, (name, rank)
        err = float((int8["grad1"].float() - vanilla["grad1"].float()).abs().max())
        # The largest local gradient any sender of this stage quantized, plus the other stage's:
        # the tied embedding's gradient is both stages' reduced gradients summed by megatron's
        # embedding-group all-reduce, so it carries both stages' errors.
        local = sum(max(q[name]["int8"]["absmax1"] for q in res if q[name]["int8"]["pp_rank"] == stage)
                    for stage in (0, 1))
        phases = 1 if "distopt" in name else 2
        bound = phases * INT8_HALF_STEP * local
        if "bf16grads" in name:  # vanilla's bf16 sum and int8's bf16 result are each rounded once
            assert vanilla["grad1"].dtype == torch.bfloat16
            bound += 2 * BF16_HALF_ULP * float(vanilla["grad1"].float().abs().max())
        print(f"{name} rank {rank} stage {vanilla['pp_rank']}: max |int8 - vanilla| {err:.3e}, bound {bound:.3e}")
        if "overlap" not in name:  # with overlap the local gradients are gone before the hook sees them
            assert 0 < err <= bound * (1 + 1e-5), (name, rank, err, bound)
        rel = float((int8["grad1"].float() - vanilla["grad1"].float()).norm() / vanilla["grad1"].float().norm())
        assert 0 < rel < 0.03, (name, rank, rel)
        # Each model chunk (two with virtual stages) on its own: its plugin compressed, and its
        # step-1 gradient has vanilla's norm with int8's error (a chunk left uncompressed, or
        # scaled twice, is not hidden by the other's).
        assert len(int8["grad1_by_chunk"]) == int8["chunks"] == len(int8["compressed_by_chunk"]), (name, rank)
        for c, (g, v, n) in enumerate(zip(int8["grad1_by_chunk"], vanilla["grad1_by_chunk"],
                                          int8["compressed_by_chunk"])):
            g, v = g.float(), v.float()
            ratio, rel_c = float(g.norm() / v.norm()), float((g - v).norm() / v.norm())
            assert n > 0 and abs(ratio - 1) < 0.02 and 0 < rel_c < 0.03, (name, rank, c, n, ratio, rel_c)
        assert int8["digest"] != vanilla["digest"]
        assert abs(int8["losses"][-1] - vanilla["losses"][-1]) / vanilla["losses"][-1] < 0.02
        stages.add(vanilla["pp_rank"])
    assert stages == {0, 1}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [s["name"] for s in FOUR if s["tp"] == 1])
def test_data_parallel_replicas_of_each_stage_stay_identical(request, name):
    res = _results(request, name)
    for r in res:
        for codec, v in r[name].items():
            peers = {res[p][name][codec]["digest"] for p in v["dp_ranks"]}
            assert len(peers) == 1, (name, codec, v["dp_ranks"])


@pytest.mark.timeout(300)
def test_interleaved_pp2_with_batch_p2p_comm_on_gloo_is_refused(two):
    for r in two:
        msg = r["refusal"]
        assert msg is not None and "batch_p2p_comm = True" in msg and "pipeline_model_parallel_size = 2" in msg
        assert "overlap_p2p_comm = True" in msg


REFUSALS = {  # what is refused: (error class, the key, its value, what is allowed)
    "checkpointer_one_of_two_chunks": ("ConfigError", "virtual_pipeline_model_parallel_size", "= 2", "pass 2"),
    "precision_aware": ("UnsupportedError", "use_precision_aware_optimizer", "= True", "set it to False"),
    "instances": ("UnsupportedError", "num_distributed_optimizer_instances", "= 2", "allowed: 1"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("what", sorted(REFUSALS))
def test_what_is_not_served_is_refused_naming_key_value_and_allowed(two, what):
    for r in two:
        msg = r["refusals"][what]
        assert msg is not None, f"{what} was not refused"
        cls, key, value, allowed = REFUSALS[what]
        assert msg.startswith(cls) and f"{key} {value}" in msg and allowed in msg, msg


@pytest.mark.timeout(300)
def test_interleaved_telemetry_counts_every_chunks_buckets_tokens_and_loss(four):
    """One recorder a rank over both model chunks (interleaved, PP 2 x DP 2, distributed optimizer):
    gradient bytes are each rank's reduce-scatter of every chunk's buckets, counted independently
    from the bucket sizes ((dp-1)/dp x 4 bytes x fp32 elements); int8 sends a quarter of that;
    tokens once per sample; the loss is the last stage's, as every rank reported it."""
    name = "pp2_vpp2_dp2_bf16_distopt"
    assert all(r[name][c]["telemetry_shared"] for r in four for c in ("none", "int8"))
    (none,) = four[0][name]["none"]["telemetry"]
    (int8,) = four[0][name]["int8"]["telemetry"]
    elements = [r[name]["none"]["grad_elements"] for r in four]
    assert none["grad_bytes_per_step_by_rank"] == [0.5 * 4 * n for n in elements], (none, elements)
    for b, p in zip(none["grad_bytes_per_step_by_rank"], int8["grad_bytes_per_step_by_rank"]):
        assert 0.25 <= p / b < 0.27, (b, p)  # int8 codes + one fp32 scale per 256
    assert int8["codec_share"] == {"int8": 1.0}
    tokens = none["tokens_per_s"] * none["window_s"] / none["steps_in_window"]
    assert abs(tokens - 2 * 4 * 2 * 64) < 1e-6 * tokens, tokens  # dp x micro-batches x micro batch x seq
    losses = [v for r in four for v in r[name]["None"]["losses"]]
    assert abs(none["loss"] - sum(losses) / len(losses)) < 1e-6, (none["loss"], losses)
    assert none["steps_in_window"] == STEPS and len(none["step_time_s_by_rank"]) == 4
    assert all(t > 0 for t in none["step_time_s_by_rank"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [s["name"] for s in CHECKPOINTER])
def test_interleaved_checkpointer_restores_every_chunk_bitwise(two, name):
    """Every chunk, the optimizer over both, each chunk's residuals, RNG: a fresh build restored
    from the step-2 snapshot (and, where served, the step-2 disk checkpoint) replays step 3 bitwise
    as the uninterrupted run; fp16's dynamic loss scaler (scale, growth and hysteresis trackers)
    comes back as it was at step 2, not as a fresh one's."""
    for rank, r in enumerate(two):
        res = r[name]
        ref, mem = res["reference"], res["memory"]
        assert ref["chunks"] == 2, (name, rank)
        # 2 ranks at PP 2: data-parallel size 1, so each chunk's sync sends and quantizes nothing
        # (no residual to restore here; interleaved residuals at DP 2: tests/fault/test_megatron_3d_memory.py).
        assert ref["compressed"] == [0, 0], ref["compressed"]
        assert (mem["start"], mem["source"]) == (2, "memory"), (name, rank, mem)
        assert mem["losses"] == ref["losses"][2:] and mem["digest"] == ref["digest"], (name, rank)
        assert mem["scalers"] == ref["scalers"][2:], (name, rank)
        assert mem["loaded_scalers"] == ref["scalers"][1], (name, rank)
        assert res["shm_left"] == []
        if "fp16" in name:
            assert ref["inner"] == ["Float16OptimizerWithFloat16Params"]
            assert mem["loaded_scalers"] != mem["fresh_scalers"], mem  # the restore moved the scaler
            assert ref["scalers"][0][0]["hysteresis_tracker"] == 1.0  # step 1's inf: one overflow counted
            assert ref["scalers"][2][0]["scale"] == 2048.0  # grew after two good steps
            disk = res["disk"]
            assert res["disk_refusal"] is None and disk["start"] == 2 and "iter_0000002" in disk["files"]
            assert disk["losses"] == ref["losses"][2:] and disk["digest"] == ref["digest"], (name, rank)
            assert disk["loaded_scalers"] == ref["scalers"][1], (name, rank)
        else:
            assert ref["inner"] == ["DistributedOptimizer"]
            msg = res["disk_refusal"]
            assert msg.startswith("UnsupportedError") and "virtual_pipeline_model_parallel_size = 2" in msg, msg
            assert "share_embeddings_and_output_weights = True" in msg and "Allowed: in-memory snapshots" in msg
            assert "disk" not in res

"""Elastic resume of a megatron-core job (issue 4): the megatron_gpt recipe (cpu-tiny, distributed
optimizer: megatron's own ``DistributedOptimizer``) under ``robust run``, relaunched at another
data-parallel size.

One chain of three launches (about 60 s), global batch 16 (micro batch 4) throughout:

1. 4 ranks (dp 4, no accumulation) train 12 steps, saving at 4, 8 and 12: the reference;
2. shrink: the step-8 and step-12 checkpoints are removed and the job is relaunched on 2 ranks;
   ``MegatronCheckpointer.load`` reshards the step-4 checkpoint (dist_checkpointing; the distributed
   optimizer's ``fully_reshardable`` format saves main parameters and moments per parameter) and
   sets gradient accumulation 2, logging it; the job trains to 12, saving at 8 and 12;
3. grow: the step-12 checkpoint is removed, the job relaunched on 4 ranks resumes from the dp-2 run's
   step-8 checkpoint with accumulation 1 and trains to 12.

What is compared with the reference, and why not everything bitwise: the first resumed step's global
loss is bitwise the reference's (same weights, same samples in the same micro-batch shapes, the slice
losses added in one order). Later steps differ in the last bits: on 2 ranks each rank sums two
micro-batches' gradients before the all-reduce, on 4 ranks the all-reduce sums four, and float
addition is not associative. They are held to 1e-5 relative (loss) and 1e-4 absolute (each
parameter tensor's sum), as the DeepSpeed elastic test is.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import robust_run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = ["-m", "robust_plugins.recipes.megatron_gpt.train", "--preset", "cpu-tiny", "--distributed-optimizer",
          "--steps", "12", "--save-every", "4", "--global-batch", "16", "--log-every", "0"]


def _launch(run_dir, nproc):
    job = robust_run(run_dir, nproc, "--max-restarts", "0", script=SCRIPT, timeout_s=120)
    assert job.returncode == 0, job.output[-3000:]
    return job


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mcore_elastic")
    ckpt = run_dir / "ckpt"
    ref = _launch(run_dir, 4)
    ref_result, ref_log = ref.result, ref.output
    for tag in ("iter_0000008", "iter_0000012"):
        shutil.rmtree(ckpt / tag)
    shrink = _launch(run_dir, 2)
    shrink_result, shrink_log = shrink.result, shrink.output
    shutil.rmtree(ckpt / "iter_0000012")
    grow = _launch(run_dir, 4)
    return {"ref": (ref_result, ref_log), "shrink": (shrink_result, shrink_log), "grow": (grow.result, grow.output)}


CASES = {"shrink": (4, 2, 4, 2), "grow": (2, 4, 8, 1)}  # saved dp, resumed dp, resumed step, accumulation


@pytest.mark.parametrize("case", sorted(CASES))
def test_resumes_at_the_saved_step_keeping_the_global_batch(chain, case):
    saved_dp, dp, start, gas = CASES[case]
    result, log = chain[case]
    assert result["dp"] == dp and result["start"] == start and result["gradient_accumulation_steps"] == gas
    line = (f"from dp {saved_dp} to {dp} (dist_checkpointing); global batch 16 kept: gradient_accumulation_steps "
            f"{4 // saved_dp} -> {gas} (micro batch 4)")
    assert line in result["resharded"]
    assert line in log  # said in the job's log, once (rank 0)
    assert log.count("robust_plugins: resharding checkpoint") == 1  # the result JSON line quotes it once more


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_and_weights_follow_the_uninterrupted_run(chain, case):
    ref, _ = chain["ref"]
    result, _ = chain[case]
    start = result["start"]
    want, got = ref["global_losses"][start:], result["global_losses"]
    assert len(got) == len(want) == 12 - start
    if case == "shrink":  # resumed from the reference's own checkpoint: its first step is bitwise
        assert got[0] == want[0]
    for a, b in zip(want, got):
        assert abs(a - b) <= 1e-5 * abs(a), (want, got)
    for a, b in zip(ref["param_sums"], result["param_sums"]):
        assert abs(a - b) <= 1e-4, (a, b)


def test_the_reference_did_not_reshard(chain):
    ref, log = chain["ref"]
    assert ref["start"] == 0 and ref["resharded"] is None and "resharding" not in log

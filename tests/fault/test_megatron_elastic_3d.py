"""Elastic resume of a 3D megatron-core job through ``dist_checkpointing``: the recipe's ``cpu-3d``
preset (PP 2, bf16, megatron's ``DistributedOptimizer``, global batch 16 of micro-batches of 2)
saved by 4 ranks (DP 2) resumes on 2 ranks (DP 1, PP kept) with twice the gradient accumulation.

The distributed optimizer's ``fully_reshardable`` checkpoint (fp32 main parameters and Adam
moments per parameter) is resharded on load. The first resumed step's global loss is bitwise the
uninterrupted run's (same weights, same samples, slice losses added in one order); later ones
differ in the last bits (accumulation on one rank sums micro-batch gradients in another order than
the reduce-scatter), held to 1e-4 relative, parameter sums to one bf16 step per element.
Resuming without the distributed optimizer (the recipe's default at DP 1) is refused, naming the
optimizers.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import robust_run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration]

SCRIPT = ["-m", "robust_plugins.recipes.megatron_gpt.train", "--preset", "cpu-3d", "--steps", "8",
          "--save-every", "4", "--global-batch", "16", "--log-every", "0"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mcore_elastic_3d")
    ref = robust_run(run_dir, 4, "--max-restarts", "0", script=SCRIPT, timeout_s=150)
    assert ref.returncode == 0, ref.output[-3000:]
    reference = ref.result
    shutil.rmtree(run_dir / "ckpt" / "iter_0000008")
    refused = robust_run(run_dir, 2, "--max-restarts", "0", script=SCRIPT, timeout_s=150)
    shrink = robust_run(run_dir, 2, "--max-restarts", "0", script=[*SCRIPT, "--distributed-optimizer"],
                        timeout_s=150)
    assert shrink.returncode == 0, shrink.output[-3000:]
    return reference, refused, shrink.result


@pytest.mark.timeout(300)
def test_pp2_dp2_checkpoint_resumes_at_dp1_keeping_the_global_batch(chain):
    ref, _, res = chain
    assert (ref["pp"], ref["dp"], ref["distopt"]) == (2, 2, True) and (res["pp"], res["dp"]) == (2, 1)
    assert res["start"] == 4 and res["gradient_accumulation_steps"] == 8
    assert "from dp 2 to 1 (dist_checkpointing); global batch 16 kept: gradient_accumulation_steps 4 -> 8" \
        in res["resharded"]
    want, got = ref["global_losses"][4:], res["global_losses"]
    assert len(got) == 4 and got[0] == want[0]
    for a, b in zip(want, got):
        assert abs(a - b) <= 1e-4 * abs(a), (want, got)
    # bf16 parameters: each element within one bf16 step (2^-7 relative at most) of the reference,
    # so a tensor's sum within 2^-7 of its sum of |p|. (Small tensors such as the QKV bias, 192
    # elements near zero, come to ~3e-3 of it on some CPUs; the weights to ~1e-5.)
    for a, b, s in zip(ref["param_sums"], res["param_sums"], ref["param_abs_sums"]):
        assert abs(a - b) <= 2 ** -7 * s, (a, b, s)


@pytest.mark.timeout(300)
def test_another_optimizer_kind_is_refused_naming_both(chain):
    _, refused, _ = chain
    assert refused.returncode != 0
    assert ("saved with optimizer=DistributedOptimizer, this job has "
            "optimizer=Float16OptimizerWithFloat16Params") in refused.output, refused.output[-3000:]

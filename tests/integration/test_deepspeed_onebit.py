"""1-bit Adam mode (``compression.sign_mode: momentum``) in real DeepSpeed ZeRO 0 engines, 2 CPU ranks.

One launch of ``ds_onebit_worker.py`` (freeze_steps 4, 14 steps, tiny GPT). The assertions:

* the freeze steps are vanilla DeepSpeed bitwise (same losses, same fp32 all-reduce bytes);
* after the freeze no gradient is all-reduced in backward, and what ``engine.step`` sends is exactly
  the two-phase sign all-reduce of the whole momentum (counted by intercepting torch.distributed),
  under 0.04x of vanilla's fp32 all-reduce;
* replicas stay bitwise identical, the model trains, and the weights differ from vanilla's;
* saved after the freeze (to disk, and as an in-memory snapshot) and resumed into an engine built
  from another seed, the run ends bitwise equal to the uninterrupted one; Adam's second moment did
  not move after the freeze;
* ZeRO 1, SGD, AMSGrad and bf16 are refused with the reason.
"""

import json
from pathlib import Path

import pytest

from _dist import run_script

pytestmark = [pytest.mark.integration]

WORKER = str(Path(__file__).with_name("ds_onebit_worker.py"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("onebit")
    run_script(WORKER, ["--out", str(out)], nproc=2, timeout_s=240, log_path=out / "launch.log")
    return json.loads((out / "results.json").read_text())


def test_freeze_steps_are_vanilla_then_only_the_1bit_momentum_goes_on_the_wire(results):
    f, van, ob = results["freeze"], results["vanilla"], results["onebit"]
    assert ob["losses"][:f + 1] == van["losses"][:f + 1]  # step f's loss is computed before its update
    assert ob["sent"][:f] == van["sent"][:f]
    fp32 = van["sent"][0]["backward"]
    assert fp32 > 0
    for step in range(f, results["steps"]):
        sent, van_step = ob["sent"][step], van["sent"][step]["step"]
        assert sent["backward"] == 0, f"step {step}: gradients were still all-reduced in backward"
        assert sent["step"] - van_step == results["expected_onebit_bytes"], (step, sent)
        assert sent["calls"].get("all_to_all_single") == 1 and sent["calls"].get("all_gather_into_tensor") == 1
    assert results["expected_onebit_bytes"] / fp32 < 0.04
    assert ob["onebit_steps"] == results["steps"] - f


def test_trains_and_replicas_agree(results):
    van, ob = results["vanilla"], results["onebit"]
    assert len(set(ob["digests"])) == 1, "replicas diverged"
    assert ob["digests"] != van["digests"], "1-bit mode gave vanilla's weights: it never ran"
    assert sum(ob["losses"][-3:]) / 3 < 0.75 * ob["losses"][0], ob["losses"]


def test_resume_after_freeze_is_bitwise(results):
    r, ob = results["resumed"], results["onebit"]
    assert r["resumed_at"] == results["freeze"] + 3
    assert r["residual_file"]
    assert r["losses"] == ob["losses"]
    assert r["digests"] == ob["digests"]
    assert r["v_unchanged_after_freeze"]


def test_resume_from_a_memory_snapshot_after_freeze_is_bitwise(results):
    r, ob = results["memory_resumed"], results["onebit"]
    assert r["resumed_at"] == results["freeze"] + 3 and r["load_path"].startswith("memory://"), r
    assert r["losses"] == ob["losses"]
    assert r["digests"] == ob["digests"]


@pytest.mark.parametrize("case,words", [
    ("zero1", ["needs ZeRO stage 0", "stage 1"]),
    ("sgd", ["torch.optim.Adam", "SGD"]),
    ("amsgrad", ["amsgrad"]),
    ("bf16", ["fp32"]),
])
def test_unsupported_engines_are_refused(results, case, words):
    msg = results["refused"][case]
    assert msg.startswith("UnsupportedError"), msg
    for w in words:
        assert w in msg, msg

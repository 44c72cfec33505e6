"""Elastic restart on ZeRO-3: a verified checkpoint saved on 2 data-parallel ranks resumes on 1 rank
(shrink) and on 4 ranks (grow), through DeepSpeed's universal checkpoint (``ds_elastic_worker.py``
with ``--stage 3``; three launches).

The conversion runs in a child process whose every ``torch.load`` is ``weights_only=True``; the
ZeRO-3 load of the converted files (``stage3.load_hp_checkpoint_state``, which calls ``torch.load``
itself) goes through the same safe load. The global batch is kept (accumulation 2 -> 4 on one rank,
-> 1 on four); the first resumed step is bitwise the uninterrupted run's, later ones agree to
~1e-6 relative (another number of ranks sums the gradients in another order).
"""

import json
from pathlib import Path

import pytest

from _dist import run_script

pytestmark = [pytest.mark.integration]

WORKER = str(Path(__file__).with_name("ds_elastic_worker.py"))
SAVE_AT = 6  # ds_elastic_worker.SAVE_AT


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic_zero3")
    for phase, nproc in (("save", 2), ("shrink", 1), ("grow", 4)):
        run_script(WORKER, ["--stage", "3", "--out", str(out), "--phase", phase], nproc=nproc,
                     timeout_s=60, log_path=out / f"{phase}.log")
    return out, {p: json.loads((out / f"{p}.json").read_text()) for p in ("save", "shrink", "grow")}


@pytest.mark.parametrize("phase,world,gas", [("shrink", 1, 4), ("grow", 4, 1)])
def test_zero3_resumes_at_another_dp_size_keeping_the_global_batch(run, phase, world, gas):
    out, r = run
    res, saved = r[phase], r["save"]
    assert res["world"] == world and res["resumed_at"] == SAVE_AT
    assert (res["gas_before"], res["gas_after"], res["train_batch_size"]) == (2, gas, 8)
    assert res["load_path"].startswith(str(out / "ckpt" / f"global_step{SAVE_AT}")), res["load_path"]
    assert res["client_state"] == {"next_step": SAVE_AT, "note": "elastic", "marker": [0, SAVE_AT, 2 * SAVE_AT]}
    (line,) = [ln for ln in res["log"] if "resharding" in ln]
    assert "from dp_world_size 2 to" in line and "(universal)" in line and f"-> {gas}" in line
    assert res["losses"][0] == saved["losses"][SAVE_AT]  # the first resumed step: bitwise
    for got, want in zip(res["losses"], saved["losses"][SAVE_AT:]):
        assert abs(got - want) <= 1e-5 * abs(want), (res["losses"], saved["losses"][SAVE_AT:])
    assert not (out / "ckpt" / ".universal").exists()  # the converted copy is removed

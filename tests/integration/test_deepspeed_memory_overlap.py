"""``memory_copy: background`` with DeepSpeed ZeRO 1 (2 CPU ranks, one launch of
``ds_memory_overlap_worker.py``, about 20 s): parameters and optimizer state are copied on the
snapshot thread while the next forward and backward run, and

* ``engine.step`` waits until that copy is committed: the snapshot holds exactly the state of its
  step (parameters and the fp32 partition, bitwise), the step's update comes after it, and the
  wait is counted in the snapshot's blocking time;
* a snapshot in flight is not visible to a restore (not committed yet);
* a parameter changed in place outside the optimizer step while its copy is in flight fails that
  snapshot with an error naming the parameter; the previous snapshot stays the restore point.
"""

import json
from pathlib import Path

import pytest

from _dist import run_script

pytestmark = [pytest.mark.integration]

WORKER = str(Path(__file__).with_name("ds_memory_overlap_worker.py"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("mem_overlap")
    run_script(WORKER, ["--out", str(out)], nproc=2, timeout_s=180, log_path=out / "launch.log")
    return json.loads((out / "results.json").read_text())


def test_the_optimizer_step_waits_for_the_copy_in_flight(ranks):
    for r in ranks:
        assert r["in_flight_committed"] == [1]  # step 2 in flight: a restore would take step 1
        assert r["unchanged_after_backward"]  # forward and backward leave the copied tensors alone
        assert r["snapshot_is_step2"]  # bitwise, although step 3's optimizer step came next
        assert r["step3_changed_params"]
        assert r["committed_after"] == [2, 3]
        # one wait a snapshot, at the next step; held by the gate here, so it is not zero
        assert len(r["wait_s"]) == 2 and r["wait_s"][1] > 0
        assert r["blocking_s"][1] >= r["wait_s"][1]


def test_a_parameter_changed_outside_the_step_fails_the_snapshot_in_flight(ranks):
    for r in ranks:
        err = r["torn_error"]
        assert err is not None and "changed in place while the snapshot of step 4" in err
        assert r["param_name"] in err and "memory_copy" in err
        assert r["committed_after_torn"] == [3]  # step 4 never committed; step 3 is the restore point

"""The megatron_gpt recipe under ``robust run``: step signals reach the monitor, an injected NaN
is detected at its step and rolled back, and the run ends bitwise as a fault-free one.

``MegatronCheckpointer.step_end`` sends every step (with the loss) to ``robust run``;
``--inject nan:rank=1,step=8`` makes rank 1 report a NaN loss at step 8 (the model is untouched),
so only the signal path can catch it. The restarted ranks resume from the newest verified
checkpoint before the fault and must end with the clean run's parameters.
"""

from __future__ import annotations

import json

import pytest
from conftest import robust_run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]

SCRIPT = ["-m", "robust_plugins.recipes.megatron_gpt.train", "--preset", "cpu-tiny", "--codec", "int8",
          "--steps", "12", "--save-every", "4", "--log-every", "0"]


def test_nan_injected_in_a_megatron_run_is_detected_and_rolled_back(tmp_path):
    clean = robust_run(tmp_path / "clean", 2, "--max-restarts", "0", script=SCRIPT, timeout_s=120)
    assert clean.returncode == 0 and clean.faults == [], clean.output[-3000:]
    job = robust_run(tmp_path / "nan", 2, "--max-restarts", "1", "--inject", "nan:rank=1,step=8",
                     script=SCRIPT, timeout_s=170)
    assert job.returncode == 0, job.output[-3000:]
    (fault,) = job.faults
    assert (fault["kind"], fault["suspect_ranks"], fault["step"], fault["action"]) == ("nan", [1], 8, "rollback")
    assert fault["detail"]["what"] == "loss"
    # step 8 reported NaN: the newest checkpoint a rollback may use is step 4
    assert fault["resumed_at_step"] == 5 and job.result["start"] == 4
    assert job.result["digest"] == clean.result["digest"]
    assert job.result["losses"] == clean.result["losses"][job.result["start"]:]
    assert json.loads((job.run_dir / "result.json").read_text())["steps"] == 12

"""The multi-GPU check (benchmarks/gpu_check_multi.py) on CPU: every part prints its skip line and the
JSON says why; its judge and command builder on made-up runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check_multi", ROOT / "benchmarks" / "gpu_check_multi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs the check is run by hand")
def test_on_cpu_every_part_skips_with_its_reason_and_the_json_is_written(tmp_path, capsys):
    check = _load()
    assert check.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check_multi.json").read_text())
    assert list(report["parts"]) == list(check.PARTS)
    for name in check.PARTS:
        assert report["parts"][name] == {"status": "skipped", "reason": "needs CUDA GPUs"}
        assert f"part {name}: skipped (needs CUDA GPUs)" in out
    assert "GPU CHECK MULTI SKIPPED (needs CUDA GPUs)" in out
    with pytest.raises(SystemExit):
        check.main(["--out", str(tmp_path), "--parts", "kill,warp"])


def test_commands_and_plans_name_every_feature_and_the_injected_fault(tmp_path):
    check = _load()
    check.write_plan(tmp_path / "hang")
    cmd = check.command("hang", tmp_path / "hang", 8)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8" and "hang:rank=5,step=14" in cmd
    assert "--inject" not in check.command("features", tmp_path / "f", 8)
    block = json.loads((tmp_path / "hang" / "ds.json").read_text())["robust_plugins"]
    assert set(block) == {"compression", "topology", "checkpoint", "telemetry"}
    plan = json.loads((tmp_path / "hang" / "plan.json").read_text())["runs"][0]
    assert plan["resume"] and plan["config"] == "ds.json"


def test_judge_passes_the_expected_faults_and_fails_a_blamed_bystander():
    check = _load()
    good_hang = [{"kind": "hang", "suspect_ranks": [5], "resumed_at_step": 13,
                  "detail": {"verdict": {"by": "flight_recorder", "stuck": [5], "blame": True}}}]
    results = [{"losses": [5.5, 5.4]}]
    assert all(check.judge("hang", 0, good_hang, results, True).values())
    by_stacks = [{**good_hang[0], "detail": {"verdict": {"by": "stacks", "stuck": []}}}]
    assert not check.judge("hang", 0, by_stacks, results, True)["hang verdict from the flight recorder"]
    wrong = [{**good_hang[0], "suspect_ranks": [0, 5]}]
    assert not check.judge("hang", 0, wrong, results, True)["faults as injected"]
    assert not check.judge("features", 0, [], [{"losses": [float("nan")]}], True)["finite losses"]
    assert not check.judge("features", 0, [], results, False)["telemetry written"]
    assert all(check.judge("kill", 0, [{"kind": "crash", "suspect_ranks": [3], "resumed_at_step": 12}],
                           results, True).values())

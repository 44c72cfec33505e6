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


def _recipe_args(cmd: list[str]) -> tuple[str, list[str]]:
    """The recipe module and its arguments in a ``robust run`` command line."""
    at = cmd.index("-m", cmd.index("run"))
    return cmd[at + 1], cmd[at + 2:]


@pytest.mark.parametrize("gpus", [4, 8])
def test_dry_run_plans_every_part_and_the_recipes_accept_them(tmp_path, capsys, gpus):
    # What --dry-run writes is what the parts run: every config passes the package's schema and
    # the recipes' parsers, ZeRO-3 and megatron PP 2 x DP are among them, and each fault lands on
    # a rank and step of the run (plan_problems), so the parts can pass by construction.
    from robust_plugins.config import PluginConfig
    from robust_plugins.recipes.deepspeed_gpt import train as ds_train
    from robust_plugins.recipes.megatron_gpt import train as mc_train
    from robust_plugins.recipes.megatron_gpt.model import PRESETS

    check = _load()
    assert check.main(["--out", str(tmp_path), "--gpus", str(gpus), "--dry-run"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("part ")]
    assert [ln.split(":")[0][5:] for ln in lines] == list(check.PARTS)
    stages = {}
    for part in check.PARTS:
        run_dir = tmp_path / part
        module, args = _recipe_args(check.command(part, run_dir, gpus))
        if module.endswith("deepspeed_gpt.train"):
            ds = json.loads((run_dir / "ds.json").read_text())
            PluginConfig.from_ds_config(ds)
            stages[part] = ds["zero_optimization"]["stage"]
            specs = ds_train.build_specs(ds_train.parse_args(args))
            assert [s.steps for s in specs] == [check.STEPS] and specs[0].resume
        else:
            parsed = mc_train.parse_args(args)
            preset = PRESETS[parsed.preset]
            assert preset.device == "cuda" and parsed.pp == 2 and preset.tp == 1 and gpus // 2 >= 2
            PluginConfig.from_dict(mc_train.plugin_block(parsed.codec, parsed.plugin_json))
            stages[part] = "pp2"
    assert stages == {"features": 0, "kill": 0, "hang": 0, "nan": 0, "zero3": 3, "zero3_faults": 3,
                      "mcore_3d": "pp2", "mcore_3d_faults": "pp2"}
    assert check.plan_problems(list(check.PARTS), gpus) == []
    faults = check.command("zero3_faults", tmp_path, gpus)
    assert [faults[i + 1] for i, x in enumerate(faults) if x == "--inject"] == [
        "kill:rank=3,step=6", f"hang:rank={gpus - 1},step=12", "nan:rank=2,step=18"]


def test_plan_problems_refuse_what_no_package_could_pass():
    check = _load()
    assert any("PP 2 x DP" in p for p in check.plan_problems(["mcore_3d"], 3))
    assert check.plan_problems(["hang"], 4) == []  # rank 5 of 4 GPUs is the last rank
    assert check.injects("hang", 4) == [("hang", 3, 14)]
    check.PART_SPECS["bad"] = ("zero0", [("kill", -9, 30), ("nan", 1, 30)])
    try:
        problems = check.plan_problems(["bad"], 8)
    finally:
        del check.PART_SPECS["bad"]
    assert any("rank -1 of 8" in p for p in problems) and any("two faults at one step" in p for p in problems)
    assert any("step 30" in p for p in problems)


def test_judge_of_the_three_faults_in_one_run():
    check = _load()
    results = [{"losses": [5.5, 5.4]}]
    run = [{"kind": "crash", "suspect_ranks": [3], "resumed_at_step": 6},
           {"kind": "hang", "suspect_ranks": [3], "resumed_at_step": 12,
            "detail": {"verdict": {"by": "flight_recorder", "stuck": [3], "blame": True}}},
           {"kind": "straggler", "suspect_ranks": [1]},
           {"kind": "nan", "suspect_ranks": [2], "resumed_at_step": 17}]
    assert all(check.judge("zero3_faults", 0, run, results, True, gpus=4).values())
    # The kill's NCCL peers aborted too and were named: a bystander blamed.
    aborted = [{**run[0], "suspect_ranks": [0, 1, 2, 3]}, *run[1:]]
    assert not check.judge("zero3_faults", 0, aborted, results, True, gpus=4)["faults as injected"]
    unresumed = [*run[:3], {**run[3], "resumed_at_step": None}]
    assert not check.judge("mcore_3d_faults", 0, [{**run[0], "suspect_ranks": [1]}, *unresumed[1:]],
                           results, True, gpus=4)["resumed"]


def test_judge_on_cpu_takes_the_stacks_verdict():
    check = _load()
    hang = [{"kind": "hang", "suspect_ranks": [3], "resumed_at_step": 14,
             "detail": {"verdict": {"by": "stacks", "stuck": [], "blame": True}}}]
    results = [{"losses": [5.5]}]
    assert all(check.judge("hang", 0, hang, results, True, gpus=4, cpu=True).values())
    assert not all(check.judge("hang", 0, hang, results, True, gpus=4).values())

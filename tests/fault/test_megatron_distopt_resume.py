"""megatron_gpt recipe with megatron's own ``DistributedOptimizer`` (``--distributed-optimizer``:
gradients reduce-scattered, Adam moments and fp32 main parameters sharded over data-parallel ranks,
checkpointed in its ``fully_reshardable`` format), int8,
2 gloo ranks under torchrun: save every 10 steps, SIGKILL the job after the step-20 checkpoint,
resume from the newest verified checkpoint, end bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_megatron_resume import _kill, _start, _wait_for

from _dist import run_script

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(240)]

MODULE = str(Path(__file__).with_name("mcore_rng_train.py"))  # the recipe, loss scaled by RNG draws
STEPS = 60
ARGS = ["--noise", "torch", "--preset", "cpu-tiny", "--codec", "int8", "--distributed-optimizer", "--log-every", "5"]


def _run(out: Path, *extra: str) -> dict:
    run_script(MODULE, [*ARGS, "--steps", str(STEPS), "--out", str(out), *extra], nproc=2, timeout_s=120,
                 log_path=out.with_suffix(".log"))
    return json.loads(out.read_text())


def test_distributed_optimizer_kill_and_resume_is_bitwise(tmp_path):
    reference = _run(tmp_path / "full.json")
    assert reference["losses"][-1] < reference["losses"][0]
    ckpt = tmp_path / "ckpt"
    proc = _start(tmp_path / "killed.log", "--distributed-optimizer", "--ckpt-dir", str(ckpt), "--save-every", "10")
    try:
        _wait_for(lambda: (ckpt / "iter_0000020").is_dir(), proc, "the step-20 checkpoint")
    finally:
        _kill(proc)
        proc.wait(10)
    committed = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_"))
    newest = int(committed[-1][5:])
    assert 20 <= newest < STEPS, committed
    res = _run(tmp_path / "resumed.json", "--ckpt-dir", str(ckpt))
    assert res["start"] == newest
    assert res["digest"] == reference["digest"]
    assert res["losses"] == reference["losses"][newest:]

"""megatron_gpt recipe (cpu-tiny, int8, 2 gloo ranks under torchrun, plain DDP and megatron's
``FP32Optimizer``): save, kill, resume bitwise.

* SIGKILL the whole job after its step-20 checkpoint, flip one byte of the newest committed
  checkpoint, resume: the corrupt one is skipped, the newest intact one loads, and the run ends
  bitwise equal to an uninterrupted one (model, optimizer, error-feedback residuals, step).
* SIGTERM the launcher mid-run: every rank writes an emergency checkpoint at the same step and
  exits; resuming from it again ends bitwise equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from robust_plugins.checkpoint.manifest import read_manifest
from robust_plugins.launch import free_port, torchrun_command

from _dist import run_script

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(300)]

# The recipe with a loss scaled by torch and model-parallel tracker RNG draws (what its disk
# checkpoints restore): a resume that left the RNG states out would not end bitwise equal.
MODULE = str(Path(__file__).with_name("mcore_rng_train.py"))
STEPS = 60
# Plain DDP (all-reduce) stepped by megatron's FP32Optimizer: the distributed optimizer's resume
# is test_megatron_distopt_resume.py.
COMMON = ["--noise", "torch", "--preset", "cpu-tiny", "--codec", "int8", "--log-every", "5",
          "--no-distributed-optimizer"]


def _run(out: Path, *extra: str) -> dict:
    run_script(MODULE, [*COMMON, "--steps", str(STEPS), "--out", str(out), *extra], nproc=2, timeout_s=120,
                 log_path=out.with_suffix(".log"))
    return json.loads(out.read_text())


def _start(log: Path, *extra: str) -> subprocess.Popen:
    cmd = torchrun_command(MODULE, [*COMMON, "--steps", "3000", *extra], 2, free_port())
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _ranks(proc: subprocess.Popen) -> list[int]:
    """torchrun's worker pids: torch starts each rank in a session of its own, so a signal to
    torchrun's process group does not reach them."""
    try:
        return [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    except OSError:
        return []


def _kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to torchrun and every rank's process group (ranks' own children included)."""
    for pgid in [proc.pid, *_ranks(proc)]:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


def _wait_for(pred, proc: subprocess.Popen, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("mcore_ref") / "full.json")


def test_kill_then_resume_from_newest_intact_checkpoint_is_bitwise(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    proc = _start(tmp_path / "killed.log", "--ckpt-dir", str(ckpt), "--save-every", "10")
    try:
        _wait_for(lambda: (ckpt / "iter_0000020").is_dir(), proc, "the step-20 checkpoint")
    finally:
        _kill(proc)
        proc.wait(10)
    committed = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_"))
    assert "iter_0000020" in committed
    newest = ckpt / committed[-1]
    assert int(newest.name[5:]) < STEPS, "the killed job outran the reference run; raise STEPS"
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    res = _run(tmp_path / "resumed.json", "--ckpt-dir", str(ckpt))
    assert res["start"] == int(committed[-2][5:]), (committed, res["start"])
    assert res["digest"] == reference["digest"]
    assert res["losses"] == reference["losses"][res["start"]:]
    log = (tmp_path / "resumed.log").read_text()
    assert f"skipped checkpoint {newest}" in log and "corrupted" in log


def test_sigterm_writes_an_emergency_checkpoint_and_resumes_bitwise(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "term.log"
    proc = _start(log, "--ckpt-dir", str(ckpt))
    ranks: list[int] = []
    try:
        _wait_for(lambda: "step 15 loss" in log.read_text(errors="replace"), proc, "step 15")
        ranks = _ranks(proc)
        assert len(ranks) == 2
        _kill(proc, signal.SIGTERM)  # what a scheduler's preemption sends to every process
        proc.wait(60)
    finally:
        _kill(proc)
        for pid in ranks:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)
    tags = [p.name for p in ckpt.iterdir() if p.name.startswith("iter_")]
    assert len(tags) == 1, tags  # no periodic saves: the emergency one only
    manifest = read_manifest(ckpt / tags[0])
    assert manifest.world_size == 2 and 15 <= manifest.step < STEPS
    assert {f.path for f in manifest.files} >= {"robust_plugins_rank00000.pt", "robust_plugins_rank00001.pt"}

    res = _run(tmp_path / "resumed.json", "--ckpt-dir", str(ckpt))
    assert res["start"] == manifest.step
    assert res["digest"] == reference["digest"]

"""An Accelerate training loop with DeepSpeed on 2 CPU ranks: ``recipes/accelerate``.

``accelerate launch --config_file recipes/accelerate/accelerate_config.yaml`` (DEEPSPEED, 2
processes, ZeRO 2) runs the recipe three times, with ``--deepspeed_config_file`` set to the
recipe's baseline.json (vanilla), the same file with ``"compression": {"codec": "none"}`` and the
recipe's plugin.json (int8). Then one ``robust run`` job of the same script with
``checkpoint.memory_every: 1`` and a SIGKILL of rank 1 at step 30 is compared with the vanilla run
(same model, data, seed and DeepSpeed LR schedule; 24 steps an epoch, so the resume lands mid-epoch).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

HERE = Path(__file__).parent
RECIPE = HERE.parent.parent / "recipes" / "accelerate"
STEPS = 60  # the recipe's DeepSpeed scheduler decays to 0 at step 60
_spec = importlib.util.spec_from_file_location("_fault_conftest", HERE.parent / "fault" / "conftest.py")
_fault = sys.modules.setdefault("_fault_conftest", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_fault)  # its job helpers: process-session clean-up after robust run


def _config(tmp: Path, name: str, block: dict | None) -> Path:
    cfg = json.loads((RECIPE / "baseline.json").read_text())
    if block is not None:
        cfg["robust_plugins"] = block
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def _accelerate_launch(out: Path, ds_config: Path, timeout_s: float = 240.0) -> tuple[dict, list[str], str]:
    """``accelerate launch`` the recipe; returns rank 0's result, every rank's digest, the log."""
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
           str(RECIPE / "accelerate_config.yaml"), "--deepspeed_config_file", str(ds_config),
           "--main_process_port", "0", str(RECIPE / "train.py"), "--steps", str(STEPS), "--out", str(out)]
    out.mkdir(parents=True, exist_ok=True)
    job = _fault.run_job(cmd, out, timeout_s)  # accelerate, its torchrun agent and both ranks
    text = job.output
    assert job.returncode == 0, text[-4000:]
    digests = sorted(p.read_text().strip() for p in out.glob("digest.rank*"))
    return json.loads((out / "result.json").read_text()), digests, text


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate")
    return tmp, {"vanilla": RECIPE / "baseline.json", "int8": RECIPE / "plugin.json",
                 "codec_none": _config(tmp, "none", {"compression": {"codec": "none"}})}


def _launched(configs, name: str) -> tuple[dict, list[str], str]:
    tmp, paths = configs
    return _accelerate_launch(tmp / name, paths[name])


# One launch a fixture, so each test pays only for the launches it adds (~30 s each alone).
@pytest.fixture(scope="module")
def vanilla(configs):
    return _launched(configs, "vanilla")


@pytest.fixture(scope="module")
def codec_none(configs):
    return _launched(configs, "codec_none")


@pytest.fixture(scope="module")
def int8(configs):
    return _launched(configs, "int8")


@pytest.mark.timeout(240)
def test_accelerate_launch_runs_deepspeed_on_2_ranks_and_codec_none_is_bitwise(vanilla, codec_none):
    van, van_digests, _ = vanilla
    none, none_digests, _ = codec_none
    for r in (van, none):
        # Accelerate's own state agrees with DeepSpeed's process group (see make_accelerator).
        assert r["num_processes"] == 2 and r["dp_world_size"] == 2, r
        assert r["distributed_type"] == "DistributedType.DEEPSPEED" and r["zero_stage"] == 2, r
        assert r["global_step"] == STEPS and len(r["losses"]) == STEPS, r
    assert not van["plugin"] and none["plugin"]
    assert len(van_digests) == 2 and len(set(van_digests)) == 1, van_digests  # the replicas agree
    assert none["losses"] == van["losses"]
    assert none_digests == van_digests


@pytest.mark.timeout(240)
def test_accelerate_launch_int8_trains_and_says_so_on_rank_0(vanilla, int8):
    van, van_digests, van_log = vanilla
    q, q_digests, log = int8
    assert q["plugin"] and q["global_step"] == STEPS
    assert len(set(q_digests)) == 1, "replicas diverged under int8"
    assert q_digests != van_digests, "int8 gave vanilla's exact weights: compression did not run"
    last, ref = statistics.fmean(q["losses"][-10:]), statistics.fmean(van["losses"][-10:])
    assert abs(last - ref) / ref < 0.02, f"int8 loss {last:.4f} vs vanilla {ref:.4f} (last 10 of {STEPS} steps)"
    assert last < 0.9 * statistics.fmean(q["losses"][:5]), "did not learn"
    lines = [ln for ln in log.splitlines() if "robust_plugins active:" in ln]
    assert len(lines) == 1 and "[Rank 0] robust_plugins active: compression(codec=int8" in lines[0], lines
    # Vanilla (the plugin imported, no block) prints nothing of ours.
    assert "robust_plugins active:" not in van_log


def _robust_run(run_dir: Path, config: Path, *args: str, timeout_s: float = 300.0) -> "_fault.Job":
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(run_dir), "--standalone",
           "--nproc-per-node", "2", "--monitor-interval", "0.1", "--watchdog", "straggler_factor=0", *args,
           "-m", "robust_plugins.recipes.accelerate.train", "--ds-config", str(config), "--steps", str(STEPS),
           "--out", str(run_dir / "out")]
    return _fault.run_job(cmd, run_dir, timeout_s)


@pytest.mark.timeout(240)
def test_kill_under_robust_run_resumes_the_loop_at_the_right_step(vanilla, tmp_path):
    van, van_digests, _ = vanilla
    # robust run's defaults: it restarts, and the engine resumes inside accelerator.prepare.
    config = _config(tmp_path, "memory", {"checkpoint": {"memory_every": 1}})
    job = _robust_run(tmp_path / "job", config, "--inject", "kill:rank=1,step=30")
    assert job.returncode == 0, job.output[-4000:]
    assert [(f["kind"], f["step"], f["suspect_ranks"]) for f in job.faults] == [("crash", 30, [1])], job.faults
    assert "training completed; 1 fault(s) recovered" in job.output
    resumed = [ln for ln in job.output.splitlines() if "checkpoint.resume: resumed from" in ln]
    assert len(resumed) == 1 and resumed[0].startswith("[Rank 0] "), resumed
    out = job.run_dir / "out"
    res = json.loads((out / "result.json").read_text())
    # The last incarnation started at the restored step and ran only the steps left.
    start = res["start_step"]
    assert 0 < start < 30 and f"engine.global_steps = {start}, the script continues at step {start + 1}" in resumed[0]
    assert res["global_step"] == STEPS and len(res["losses"]) == STEPS - start
    assert res["num_processes"] == 2 and res["distributed_type"] == "DistributedType.DEEPSPEED"
    # Rank 0's per-step log: the first incarnation's steps up to the kill, then the resumed ones;
    # each step's last record has the fault-free run's loss and learning rate.
    records = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["start"] for r in records] == [0] * (len(records) - (STEPS - start)) + [start] * (STEPS - start)
    final = {r["step"]: r for r in records}
    assert sorted(final) == list(range(1, STEPS + 1))
    assert [final[s]["loss"] for s in range(1, STEPS + 1)] == van["losses"]
    assert [final[s]["lr"] for s in range(1, STEPS + 1)] == van["lrs"]
    assert res["losses"] == van["losses"][start:]
    digests = sorted(p.read_text().strip() for p in out.glob("digest.rank*"))
    assert digests == van_digests, "final weights differ from the fault-free run's"

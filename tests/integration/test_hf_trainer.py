"""The HF Trainer with DeepSpeed on 2 CPU ranks, ``import robust_plugins`` its only addition.

One launch of ``hf_trainer_worker.py`` per ZeRO stage (1 and 2) trains ``recipes/hf_trainer``'s
model 60 steps with vanilla DeepSpeed (the patch undone), the plugin without a block (stage 2),
codec ``none`` and codec ``int8``; stage 2 also checks that ZeRO-3 refuses codec ``sign``. Then one ``robust run``
job of the recipe with ``checkpoint.memory_every: 1`` and robust run's defaults, a SIGKILL of rank 1
at step 30 and a NaN loss on rank 0 at step 45, is compared with stage 2's vanilla run (same model, data, seed and
schedule: 12 steps an epoch, 2 micro-batches a step, dropout on).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

from _dist import run_script

pytestmark = [pytest.mark.integration]

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

HERE = Path(__file__).parent
WORKER = str(HERE / "hf_trainer_worker.py")
STEPS = 60
GRAD_ACCUM = 2  # hf_trainer_worker.GRAD_ACCUM
_spec = importlib.util.spec_from_file_location("_fault_conftest", HERE.parent / "fault" / "conftest.py")
_fault = sys.modules.setdefault("_fault_conftest", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_fault)  # its job helpers: process-session clean-up after robust run


def _launch(tmp_path_factory, stage: int, runs: str, *extra: str) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp(f"hf_zero{stage}")
    run_script(WORKER, ["--stage", str(stage), "--steps", str(STEPS), "--out", str(out), "--runs", runs, *extra],
                 nproc=2, timeout_s=800, log_path=out / "launch.log")
    return out, json.loads((out / "results.json").read_text()), (out / "launch.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    return _launch(tmp_path_factory, 2, "vanilla,no_block,codec_none,int8", "--zero3")


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    return _launch(tmp_path_factory, 1, "vanilla,codec_none,int8,int8_wandb")


@pytest.fixture(params=[1, 2], ids=["zero1", "zero2"])
def stage(request):
    return request.getfixturevalue(f"zero{request.param}")


def _steps(log_history: list[dict]) -> list[dict]:
    return [h for h in log_history if "loss" in h]


def test_no_block_and_codec_none_are_bitwise_vanilla(stage):
    _, r, _ = stage
    van = r["vanilla"]
    assert van["global_step"] == STEPS and len(van["losses"]) == STEPS and not van["plugin"]
    assert len(set(van["digests"])) == 1 and len(van["digests"]) == 2  # the replicas agree
    for name in ("no_block", "codec_none"):
        if name not in r:
            continue
        assert r[name]["plugin"] == (name == "codec_none"), name  # no block: nothing attached
        assert r[name]["losses"] == van["losses"], name
        assert r[name]["digests"] == van["digests"], name


def test_int8_loss_within_2pct_and_bytes_on_the_wire(stage):
    out, r, _ = stage
    van, q = r["vanilla"], r["int8"]
    assert q["plugin"] and q["global_step"] == STEPS
    assert len(set(q["digests"])) == 1, "replicas diverged under int8"
    assert q["digests"] != van["digests"], "int8 gave vanilla's exact weights: compression did not run"
    last = statistics.fmean(q["losses"][-10:])
    ref = statistics.fmean(van["losses"][-10:])
    assert abs(last - ref) / ref < 0.02, f"int8 loss {last:.4f} vs vanilla {ref:.4f} (last 10 of {STEPS} steps)"
    assert last < 0.9 * q["losses"][0], "did not learn"
    records = [json.loads(x) for x in (out / "telemetry" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in records if x.get("kind") == "step"]
    assert len(steps) == STEPS
    # compression_ratio: every rank's gradient bytes on the wire over one fp32 ring all-reduce of
    # every gradient. ZeRO-2 reduces at every micro-batch (2 a step here), as vanilla DeepSpeed
    # does, ZeRO-1 once a step: the bound is per reduction.
    reductions = GRAD_ACCUM if q["zero_stage"] == 2 else 1
    worst = max(x["compression_ratio"] for x in steps) / reductions
    assert 0 < worst <= 0.27, worst


def test_active_line_on_rank_0_only(stage):
    _, r, log = stage
    lines = [ln for ln in log.splitlines() if "robust_plugins active:" in ln]
    # codec none, int8 (and int8_wandb: ZeRO 1), nothing for vanilla / no block, from rank 0's print.
    assert len(lines) == (3 if "int8_wandb" in r else 2), lines
    assert all("[Rank 0] robust_plugins active: compression(codec=" in ln for ln in lines), lines
    assert not any(ln.startswith("[default1]") for ln in lines), lines
    assert "codec=none" in lines[0] and "codec=int8" in lines[1], lines


def test_wandb_trainer_run_and_plugin_run_share_one_group(zero1):
    """report_to=["wandb"] and telemetry.wandb: two offline runs (rank 0), one project and group."""
    sys.path.insert(0, str(HERE.parent))
    from _wandb_offline import read_run

    out, _, log = zero1
    trainer_runs = list((out / "int8_wandb" / "trainer" / "wandb").glob("offline-run-*"))
    plugin_runs = list((out / "int8_wandb" / "telemetry" / "wandb").glob("offline-run-*"))
    assert len(trainer_runs) == 1 and len(plugin_runs) == 1, (trainer_runs, plugin_runs)
    hf, ours = read_run(trainer_runs[0]), read_run(plugin_runs[0])
    assert hf["project"] == ours["project"] == "robust_plugins"
    assert hf["group"] == ours["group"] == "hf-wandb", (hf["group"], ours["group"])  # the Trainer's run_name
    assert any("train/loss" in h for h in hf["history"]), hf["history"][:3]
    assert any("compression_ratio" in h for h in ours["history"]), ours["history"][:3]
    assert "share project 'robust_plugins', group 'hf-wandb', mode offline" in log


def test_zero3_with_codec_sign_is_refused(zero2):
    _, r, _ = zero2
    err = r["zero3"]["error"]
    assert err and err.startswith("UnsupportedError") and "compression.codec = 'sign'" in err, err
    assert "ZeRO-3" in err, err


def _robust_run(run_dir: Path, config: Path, *args: str, timeout_s: float = 600.0) -> "_fault.Job":
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--run-dir", str(run_dir), "--standalone",
           "--nproc-per-node", "2", "--monitor-interval", "0.1", "--watchdog", "straggler_factor=0", *args,
           "-m", "robust_plugins.recipes.hf_trainer.train", "--ds-config", str(config), "--steps", str(STEPS),
           "--windows", "192", "--grad-accum", "2", "--out", str(run_dir / "out")]
    return _fault.run_job(cmd, run_dir, timeout_s)


def test_kill_and_nan_resume_the_trainer_exactly(zero2, tmp_path):
    _, r, _ = zero2
    ref = r["vanilla"]
    cfg = json.loads((HERE.parent.parent / "recipes" / "hf_trainer" / "baseline.json").read_text())
    # robust run's defaults: it restarts (3 times) and the engine resumes inside deepspeed.initialize.
    cfg["robust_plugins"] = {"checkpoint": {"memory_every": 1}}
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(cfg))
    job = _robust_run(tmp_path / "job", config, "--inject", "kill:rank=1,step=30", "--inject", "nan:rank=0,step=45")
    assert job.returncode == 0, job.output[-4000:]
    kinds = [(f["kind"], f["step"], f["suspect_ranks"]) for f in job.faults]
    assert kinds == [("crash", 30, [1]), ("nan", 45, [0])], kinds
    assert "training completed; 2 fault(s) recovered" in job.output
    # Each restart resumed the Trainer itself (not only the engine), and said so on rank 0.
    resumed = [ln for ln in job.output.splitlines() if "Trainer resumed at global step" in ln]
    assert len(resumed) == 2 and all(ln.startswith("[Rank 0] ") for ln in resumed), resumed
    # The NaN's rank held (took no step 46: watchdog/hold.py), so the rollback found step 44 in
    # memory (CI once saw only [46, 45] there, and the job restarted from step 0).
    assert "resumed at global step 44 " in resumed[1], resumed
    res = json.loads((job.run_dir / "out" / "result.json").read_text())
    # The Trainer's log: exactly the fault-free run's steps, losses, grad norms, learning rates
    # and epochs, and its closing train_loss (the loss accumulators came back with the state).
    assert res["global_step"] == STEPS and res["epoch"] == ref["log_history"][-1]["epoch"]
    assert _steps(res["log_history"]) == _steps(ref["log_history"])
    assert res["log_history"][-1]["train_loss"] == ref["log_history"][-1]["train_loss"]
    digests = sorted(p.read_text().strip() for p in (job.run_dir / "out").glob("digest.rank*"))
    assert digests == ref["digests"], "final weights differ from the fault-free run's"


def test_active_line_on_rank_0_of_a_plain_script(tmp_path):
    """The same line from a plain DeepSpeed script where nobody set up logging; the library adds
    no handler (root or its own)."""
    out = tmp_path / "plain.json"
    run_script(str(HERE / "hf_plain_worker.py"), [str(out)], nproc=2, timeout_s=300, log_path=tmp_path / "launch.log")
    log = (tmp_path / "launch.log").read_text(errors="replace")
    lines = [ln for ln in log.splitlines() if "robust_plugins active:" in ln]
    # torchrun prefixes each local rank's stream ("[default0]:").
    assert len(lines) == 1 and "[Rank 0] robust_plugins active: compression(codec=int8" in lines[0], lines
    assert not lines[0].startswith("[default1]"), lines
    assert json.loads(out.read_text()) == {"root_handlers": 0, "robust_handlers": 0}

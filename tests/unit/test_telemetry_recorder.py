"""The recorder in one process (world of one, no process group): windows, records, fault events
copied from a robust run directory's faults.jsonl, W&B offline run read back, close()."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from robust_plugins.config import PluginConfig
from robust_plugins.telemetry import read_records, sinks
from robust_plugins.telemetry.recorder import Telemetry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _wandb_offline import read_run  # noqa: E402


def _tel(tmp_path, info_fn=None, **block):
    cfg = PluginConfig.from_dict({"telemetry": {"dir": str(tmp_path / "tel"), "log_every": 2, **block}})
    return Telemetry(cfg.telemetry, run_config={"robust_plugins": dict(cfg.raw)}, n_grad_elements=1000,
                     grad_element_size=4, dp_world_size=1, device=torch.device("cpu"),
                     flops_per_token=6000.0, residual_sq_fn=lambda: 4.0, grad_norm_fn=lambda: 0.5,
                     info_fn=info_fn)


def _steps(tel, n, start=1):
    for s in range(start, start + n):
        tel.count_tokens(64)
        with tel.grad_window(torch.tensor(float(s))):
            pass
        tel.step_end(s)


def test_windows_and_records(tmp_path):
    tel = _tel(tmp_path, peak_flops=1e9)
    _steps(tel, 4)
    tel.close()
    tel.close()  # idempotent
    recs = read_records(tmp_path / "tel")
    assert [r["kind"] for r in recs] == ["start", "step", "step", "end"]
    s = recs[2]
    assert s["step"] == 4 and s["steps_in_window"] == 2 and s["loss"] == pytest.approx(3.5)
    assert s["grad_bytes_per_step"] == 0 and s["compression_ratio"] is None  # world of one: no wire
    assert s["residual_norm"] == pytest.approx(2.0) and s["grad_norm"] == 0.5
    assert s["tokens_per_s"] == pytest.approx(128 / s["window_s"])
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] * 6000.0 / 1e9)
    assert s["mem_bytes_max"] > 10e6 and recs[0]["mem_kind"] == "peak_rss"
    assert recs[0]["config"]["robust_plugins"]["telemetry"]["log_every"] == 2


def test_faults_from_run_dir_and_wandb(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("ROBUST_RUN_DIR", str(run_dir))
    fault = {"kind": "crash", "step": 3, "suspect_ranks": [1], "suspect_hosts": ["h"], "detected_after_s": 0.2,
             "action": "restart", "time": "2026-11-30T08:17:31.913+00:00", "resumed_at_step": 2,
             "lost_steps": 2, "evidence": [], "incarnation": 0, "detail": {}}
    (run_dir / "faults.jsonl").write_text(json.dumps(fault) + "\n")
    tel = _tel(tmp_path, dir=None, wandb={"project": "p", "group": "g"})
    assert tel.dir == run_dir / "telemetry"
    _steps(tel, 2)
    tel.close()
    # A restarted incarnation appends and does not copy the same fault again.
    monkeypatch.setenv("ROBUST_INCARNATION", "1")
    with open(run_dir / "faults.jsonl", "a") as f:
        f.write(json.dumps({**fault, "kind": "hang", "step": 5}) + "\n")
    tel = _tel(tmp_path, dir=None)
    _steps(tel, 4, start=3)
    tel.close()
    recs = read_records(run_dir / "telemetry")
    faults = [r for r in recs if r["kind"] == "fault"]
    assert [f["fault_kind"] for f in faults] == ["crash", "hang"] and faults[1]["fault_index"] == 1
    assert [r["kind"] for r in recs].count("start") == 2
    last = [r for r in recs if r["kind"] == "step"][-1]
    assert last["faults_total"] == 2 and 0 < last["ettr"] <= 1
    wb = read_run(next((run_dir / "telemetry" / "wandb").glob("offline-run-*")))
    assert wb["project"] == "p" and wb["group"] == "g" and wb["name"] == "run/telemetry"
    rows = {h["_step"]: h for h in wb["history"]}
    assert rows[2]["watchdog/faults/nrows"] == 1 and rows[2]["loss"] == pytest.approx(1.5)


def _logging_child(tmp_path, **popen_kw) -> subprocess.Popen:
    """A child that logs 4 steps to a recorder with a W&B sink under ``tmp_path/tel``, prints
    ``ready`` and sleeps: for the tests that stop it with a signal."""
    script = textwrap.dedent(f"""
        import os, signal, sys, time, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from test_telemetry_recorder import _tel, _steps
        from pathlib import Path
        tel = _tel(Path({str(tmp_path)!r}), wandb={{"project": "p"}})
        _steps(tel, 4)
        print("ready", flush=True)
        time.sleep(60)
    """)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, **popen_kw)


def test_sigterm_finishes_the_wandb_run_then_terminates(tmp_path):
    # How torch's elastic agent stops the healthy ranks of a job that robust run restarts.
    proc = _logging_child(tmp_path)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # still dies of the signal
    recs = read_records(tmp_path / "tel")
    assert recs[-1]["kind"] == "end"
    wb = read_run(next((tmp_path / "tel" / "wandb").glob("offline-run-*")))
    assert [h["_step"] for h in wb["history"] if "loss" in h] == [2, 4]


def test_sigkill_of_the_process_group_keeps_the_wandb_steps_flushed_before_it(tmp_path):
    # How robust run stops the ranks of a job it restarts from warm standbys: SIGKILL to each
    # rank's process group, wandb-core included, with no chance to finish the run. wandb-core's
    # default (a write every 15 s) left header-only .wandb files; the sink asks for one a second.
    proc = _logging_child(tmp_path, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(3 * sinks.WANDB_FLUSH_S + 1.0)  # at least one write after the last step
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    recs = read_records(tmp_path / "tel")
    assert recs[-1]["kind"] != "end"  # nothing ran after the kill
    wb = read_run(next((tmp_path / "tel" / "wandb").glob("offline-run-*")))
    assert wb["project"] == "p"
    # Step 4's row stays open in W&B until a later step (or finish) commits it: what a kill loses.
    assert [h["_step"] for h in wb["history"] if "loss" in h] == [2]


def test_codec_shares_and_auto_decisions_reach_jsonl_and_wandb(tmp_path):
    decisions = [{"group": [0, 1], "numel": 4096, "codec": "int8", "reason": "slow link",
                  "predicted_s": {"none": 0.2, "int8": 0.06}}]
    info = {"codec_share": {"int8": 0.75, "none": 0.25}, "auto_decisions": decisions}
    tel = _tel(tmp_path, info_fn=lambda: info, wandb={"project": "p"})
    _steps(tel, 4)
    tel.close()
    steps = [r for r in read_records(tmp_path / "tel") if r["kind"] == "step"]
    assert steps[-1]["codec_share"] == {"int8": 0.75, "none": 0.25}
    assert steps[-1]["auto_decisions"][0]["reason"] == "slow link"
    wb = read_run(next((tmp_path / "tel" / "wandb").glob("offline-run-*")))
    rows = {h["_step"]: h for h in wb["history"]}
    assert rows[4]["codec/int8"] == 0.75 and rows[2]["compression/auto_decisions/nrows"] == 1
    assert "compression/auto_decisions/nrows" not in rows[4]  # logged again only when it changes


def test_the_wandb_run_opens_on_a_thread_and_a_failed_open_is_raised(tmp_path, monkeypatch):
    import threading

    import wandb

    real_init, opened, release = wandb.init, threading.Event(), threading.Event()

    def slow_init(**kwargs):
        opened.set()
        assert release.wait(30)
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", slow_init)
    tel = _tel(tmp_path, wandb={"project": "p"})  # returns while wandb.init still waits
    assert opened.wait(30) and tel._wandb.run is None
    release.set()
    _steps(tel, 2)  # the first record waits for the run, then logs into it
    tel.close()
    wb = read_run(next((tmp_path / "tel" / "wandb").glob("offline-run-*")))
    assert [h["_step"] for h in wb["history"] if "loss" in h] == [2]

    def failing_init(**kwargs):
        raise ValueError("no such entity")

    monkeypatch.setattr(wandb, "init", failing_init)
    tel = _tel(tmp_path / "again", wandb={"project": "p"})
    tel.count_tokens(64)
    with pytest.raises(sinks.RobustPluginsError, match="wandb.init failed: ValueError\\('no such entity'\\)"):
        tel.step_end(2)
    tel.close()  # a run that never opened: logged, not raised again

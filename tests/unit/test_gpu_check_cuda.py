"""The one-GPU check of issue 18 (benchmarks/gpu_check_cuda.py) on CPU: every part either runs
(the distributed ones over a 1-rank gloo group) or prints its skip line, and the JSON is written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_check_cuda", ROOT / "benchmarks" / "gpu_check_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the check is run by hand (tests/gpu)")
def test_gpu_check_runs_on_cpu_up_to_its_gpu_parts_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check = _load()
    assert check.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("part ")]
    report = json.loads((tmp_path / "gpu_check_cuda.json").read_text())
    assert list(report["parts"]) == list(check.PARTS) and len(lines) == len(check.PARTS)
    ran = {"auto", "coord", "heatmap", "pipelined", "threads"}
    for name, part in report["parts"].items():
        if name in ran:
            assert part["status"] == "ok", (name, part)
            assert part["checks"] and all(part["checks"].values())
        else:
            assert part == {"status": "skipped", "reason": "needs a CUDA device", "seconds": part["seconds"]}
            assert f"part {name}: skipped (needs a CUDA device)" in "\n".join(lines)
    skipped = len(check.PARTS) - len(ran)
    assert f"PASSED ({len(ran)} ok, {skipped} skipped) - the skipped parts did NOT run" in out
    assert report["env"]["backend"] == "gloo"
    assert not torch.distributed.is_initialized()  # the check leaves no process group behind


def test_gpu_check_refuses_unknown_parts(tmp_path):
    with pytest.raises(SystemExit):
        _load().main(["--out", str(tmp_path), "--parts", "auto,warp"])


@pytest.mark.timeout(60)
def test_the_emergency_parts_drive_the_packages_listener_thread(tmp_path):
    # gpu_check_faults' part_device and part_stream_save ask through ask_emergency_save: the
    # package's own client, on_emergency, step_end, listener and save threads. Here on CPU.
    import threading

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check_faults as faults
    from robust_plugins.watchdog import client as client_mod, emergency_rank

    before = (client_mod._client, client_mod._checked, sys.excepthook)
    seen = []
    done = faults.ask_emergency_save(str(tmp_path), lambda step: seen.append((step, threading.current_thread().name)))
    assert seen == [(7, "robust-emergency-save")]
    assert done["phase"] == "done" and done["ok"] is True and done["via"] == "monitor" and done["s"] == 7
    # Nothing of the drive is left behind for the next part.
    assert (client_mod._client, client_mod._checked, sys.excepthook) == before
    assert "listener" not in emergency_rank._emergency


@pytest.mark.timeout(180)
def test_the_gloo_ranks_part_runs_its_two_ranks_on_cpu(tmp_path):
    # gpu_check_ranks' two gloo ranks with CPU tensors: what part_gloo_ranks runs with CUDA ones.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check_ranks

    from _dist import run_ranks

    res = gpu_check_ranks.merge(run_ranks(gpu_check_ranks.rank_checks, gpu_check_ranks.WORLD, 150, "cpu"))
    assert res["unsupported"] == {} and len(res["checks"]) == 8, res
    assert all(res["checks"].values()), res
    assert res["numbers"]["int8 bytes_sent"] > 0

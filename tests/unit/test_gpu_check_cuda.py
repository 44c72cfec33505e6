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

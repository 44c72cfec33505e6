"""On a CUDA machine: the one-GPU check of issue 18 passes as one call (skipped without CUDA).

Run by hand where a GPU is lent: ``pytest tests/gpu`` (the check's JSON goes to pytest's tmp dir;
``python benchmarks/gpu_check_cuda.py --out DIR`` keeps it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_gpu_check_passes_on_one_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check_cuda.py"), "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=620)
    report = json.loads((tmp_path / "gpu_check_cuda.json").read_text())
    failed = {k: v for k, v in report["parts"].items() if v["status"] == "FAILED"}
    assert done.returncode == 0 and not failed, (done.stdout[-4000:], failed)
    assert report["env"]["backend"] == "nccl"

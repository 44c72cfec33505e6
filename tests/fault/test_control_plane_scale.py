"""The control plane with many fake ranks (benchmarks/control_plane_scale.py at a suite size):
real agents, monitors and one c10d rendezvous; a crash and a hang injected into ranks of
different nodes must each be detected, named on the right rank, and reach every node's job view.
The large sizes are in the benchmark only (BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fault, pytest.mark.distributed, pytest.mark.timeout(300)]

_PATH = Path(__file__).parents[2] / "benchmarks" / "control_plane_scale.py"
_spec = importlib.util.spec_from_file_location("control_plane_scale", _PATH)
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

NODES, RANKS = 2, 8


def test_crash_and_hang_among_many_fake_ranks_are_detected_and_named(tmp_path):
    r = scale.run_scale(tmp_path, NODES, RANKS, timeout_s=240, steady_steps=15, stack_dump_timeout_s=5)
    assert r["exit_codes"] == [0] * NODES, r
    # The crash (the last rank, last node) is named alone, within a second of the kill (the agent polls
    # at 0.1 s), and reaches every node's job view.
    assert r["crash_ranks"] == [NODES * RANKS - 1] and r["crash_detect_s"] < 1.0, r
    assert r["agree_s"] is not None and r["agree_s"] < 30, r
    # The hang (the middle rank, the other node) is named, after its timeout and no more than 10 s of stack
    # dumps and verdict beyond it.
    assert r["hang_rank"] in r["hang_ranks"] and r["hang_timeout_s"] >= scale.HANG_MIN_S, r
    assert 0 <= r["hang_overhead_s"] < 10, r
    assert r["rdzv_s"] < 60, r

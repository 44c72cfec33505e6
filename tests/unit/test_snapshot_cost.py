"""The arithmetic of ``benchmarks/snapshot_cost.py`` (not its timings): each part is its row minus
the row before, the parts add up to the defaults' overhead over the host, the table says so."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "snapshot_cost.py"
_spec = importlib.util.spec_from_file_location("snapshot_cost", _PATH)
snapshot_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(snapshot_cost)


def test_the_parts_add_up_to_the_overhead_of_the_defaults():
    step = {"host": 50.0, "monitor": 51.5, "copy": 56.0, "check": 58.25}
    parts = snapshot_cost.split(step)
    assert parts == {"monitor": 1.5, "copy": 4.5, "check": 2.25}
    assert sum(parts.values()) == pytest.approx(step["check"] - step["host"])
    assert snapshot_cost.ratio(step) == pytest.approx(58.25 / 50.0)
    # Rows come in SETTINGS order whatever order they were measured in; a missing row is skipped.
    assert snapshot_cost.split({"check": 7.0, "host": 5.0, "monitor": 5.5}) == {"monitor": 0.5, "check": 1.5}
    with pytest.raises(ValueError, match="'host'"):
        snapshot_cost.split({"copy": 1.0, "check": 2.0})


def test_the_table_prints_each_part_and_the_ratio_to_the_host():
    rows = {s: [{"step_ms": v, "blocking_ms": b, "cpu_ms": 2 * v}, {"step_ms": v + 2, "blocking_ms": b, "cpu_ms": 2 * v}]
            for s, v, b in (("host", 10.0, 0.0), ("monitor", 11.0, 0.0), ("copy", 14.0, 1.0), ("check", 15.0, 1.5))}
    text = snapshot_cost.table("ds", rows)
    # medians: 15 vs 11 (host); CPU 28 vs 20
    assert "| copy | 15.00 ms | +3.00 ms | 1.00 ms | 1.364 | 28.00 ms | +6.00 ms | 1.400 |" in text
    assert "| check | 16.00 ms | +1.00 ms | 1.50 ms | 1.455 | 30.00 ms | +2.00 ms | 1.500 |" in text
    assert "| host | 11.00 ms |  | 0.00 ms | 1.000 | 20.00 ms |  | 1.000 |" in text

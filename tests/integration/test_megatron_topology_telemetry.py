"""megatron-core with ``topology.hierarchical``, codec ``auto`` and the telemetry recorder.

4 gloo ranks as a simulated 2 x 2 cluster (``ROBUST_TOPOLOGY_SIM``), data-parallel GPT: the
hierarchical route really carries the buckets (counted), with and without ``overlap_grad_reduce``
(the sync thread), trains as vanilla does (within 2 % after 12 steps), and replicas stay bitwise
equal; ``auto`` records its decisions; telemetry writes aggregated records with gradient bytes.
"""

from __future__ import annotations

import json

import pytest

from _dist import run_ranks

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]

STEPS = 12


def _blocks(rank, world, variants, steps):
    from mcore_worker import block_variants

    return block_variants(rank, world, variants, steps)


@pytest.mark.timeout(200)
def test_hierarchical_auto_and_telemetry_on_megatron(tmp_path):
    tel = {"telemetry": {"log_every": 4, "dir": str(tmp_path / "tel")}}
    hier = {"compression": {"codec": "int8"}, "topology": {"hierarchical": True}}
    variants = [
        {"block": tel, "overlap": False},                                  # vanilla sync + telemetry
        {"block": hier, "overlap": False},
        {"block": hier, "overlap": True},
        {"block": {"compression": {"codec": "auto", "auto_candidates": ["none", "int8"]}}, "overlap": True},
    ]
    res = run_ranks(_blocks, 4, 190, variants, STEPS, env={"ROBUST_TOPOLOGY_SIM": "2x2"})
    base = res[0][0]
    for v in (1, 2):
        r = res[0][v]
        assert r["hierarchical"] > 0 and r["by_codec"].get("int8", 0) > 0
        assert abs(r["losses"][-1] - base["losses"][-1]) / base["losses"][-1] < 0.02
        assert len({res[k][v]["digest"] for k in range(4)}) == 1
    assert not res[0][1]["threaded"] and res[0][2]["threaded"]
    auto = res[0][3]
    assert auto["auto"] > 0 and auto["threaded"]
    assert len({res[k][3]["digest"] for k in range(4)}) == 1
    # telemetry: rank 0 wrote a record every 4 steps, with the gradient traffic of the window
    steps = [r for r in res[0][0]["records"] if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == [4, 8, 12]
    lines = [json.loads(x) for x in (tmp_path / "tel" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("kind") == "step"] == [4, 8, 12]
    print(steps[-1])
    assert all(r["loss"] > 0 for r in steps)
    assert res[1][0].get("records") is None or res[1][0]["records"] == []

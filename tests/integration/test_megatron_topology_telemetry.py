"""megatron-core with ``topology.hierarchical``, codec ``auto`` and the telemetry recorder.

4 gloo ranks as a simulated 2 x 2 cluster (``ROBUST_TOPOLOGY_SIM``), data-parallel GPT: the
hierarchical route really carries the buckets (counted), with and without ``overlap_grad_reduce``
(the sync thread), reduces step 1's gradient to vanilla megatron's (scale and int8 error), trains as
vanilla does (within 2 % after 12 steps), and replicas stay bitwise equal; ``auto`` carries what it
decided, with the same gradient and loss checks; telemetry writes aggregated records whose
gradient bytes are the ring all-reduce's, computed from the parameter count.
"""

from __future__ import annotations

import json

import pytest

from _dist import run_ranks
from test_megatron_compression import assert_grad_close

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]

STEPS = 12


def _blocks(rank, world, variants, steps):
    from mcore_worker import block_variants

    return block_variants(rank, world, variants, steps)


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
        for k in range(4):  # step 1: vanilla's averaged gradient, int8's error only, on every rank
            assert_grad_close(res[k][v]["grad1"], res[k][0]["grad1"], f"hierarchical int8 variant {v} rank {k}")
    assert not res[0][1]["threaded"] and res[0][2]["threaded"]
    auto = res[0][3]
    assert auto["auto"] > 0 and auto["threaded"]
    assert len({res[k][3]["digest"] for k in range(4)}) == 1
    assert abs(auto["losses"][-1] - base["losses"][-1]) / base["losses"][-1] < 0.02
    # the route: what the wire carried is what auto decided, and what it decided is a candidate
    chosen = {d["codec"] for d in auto["decisions"]}
    assert chosen <= {"none", "int8"} and chosen == {c for c, n in auto["by_codec"].items() if n > 0}, auto
    for k in range(4):
        assert_grad_close(res[k][3]["grad1"], res[k][0]["grad1"], f"auto rank {k}", exact_ok=True)
    # telemetry: rank 0 wrote a record every 4 steps, with the gradient traffic of the window
    steps = [r for r in res[0][0]["records"] if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == [4, 8, 12]
    lines = [json.loads(x) for x in (tmp_path / "tel" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("kind") == "step"] == [4, 8, 12]
    assert all(r["loss"] > 0 for r in steps)
    # the gradient bytes, by hand: megatron's fp32 all-reduce of every gradient element on 4 ranks
    # counts as a ring's 2 (W-1)/W x 4 bytes an element on each rank
    ring = 2 * (4 - 1) / 4 * 4 * base["n_params"]
    for r in steps:
        assert r["grad_bytes_per_step_rank0"] == pytest.approx(ring, rel=1e-6), (r, ring)
        assert r["compression_ratio"] == pytest.approx(1.0, rel=1e-6)
    assert res[1][0].get("records") is None or res[1][0]["records"] == []

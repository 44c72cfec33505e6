"""The topology rank order applied at launch: TP groups megatron-core builds stay inside a node.

4 gloo ranks, TP=2 x DP=2. With ``ROBUST_TOPOLOGY_SIM=2x2`` (node-major: launcher ranks 0,1 on
node 0) the order is the launcher's and TP groups are {0,1} and {2,3}. With a topology file that
puts launcher ranks 0 and 2 on one host and 1 and 3 on the other (a launcher that interleaves
nodes), megatron's default order would pair 0 with 1 across hosts; after
``apply_rank_order`` every TP group is one host's pair and DP runs across hosts. The recipe under
torchrun does the same by default.
"""

from __future__ import annotations

import json
import math

import pytest

from _dist import run_ranks
from _dist import run_script

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]

HOSTS = {"hostA": {"ranks": [0, 2]}, "hostB": {"ranks": [1, 3]}}


def _host(rank: int) -> str:
    return next(h for h, e in HOSTS.items() if rank in e["ranks"])


def _worker(rank, world, topology_file, steps):
    from mcore_worker import rank_order_tp2

    return rank_order_tp2(rank, world, topology_file, steps)


@pytest.mark.timeout(120)
def test_sim_topology_keeps_node_major_order_and_tp_groups_intra_node():
    res = run_ranks(_worker, 4, 110, None, 2, env={"ROBUST_TOPOLOGY_SIM": "2x2"})
    for launcher, r in enumerate(res):
        assert r["source"] == "sim:2x2" and r["rank"] == launcher
        assert {x // 2 for x in r["tp_launcher"]} == {launcher // 2}  # one simulated node
        assert len({x // 2 for x in r["dp_launcher"]}) == 2


@pytest.mark.timeout(120)
def test_interleaved_hosts_are_renumbered_so_tp_groups_stay_on_one_host(tmp_path):
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps(HOSTS))
    res = run_ranks(_worker, 4, 110, str(topo), 2)
    assert sorted(r["rank"] for r in res) == [0, 1, 2, 3]
    assert [r["rank"] for r in res] != [0, 1, 2, 3]  # really renumbered
    for launcher, r in enumerate(res):
        assert r["launcher_rank"] == launcher
        assert launcher in r["tp_launcher"] and len(r["tp_launcher"]) == 2
        assert len({_host(x) for x in r["tp_launcher"]}) == 1, r
        assert len({_host(x) for x in r["dp_launcher"]}) == 2, r
        assert all(math.isfinite(v) for v in r["losses"])


def test_recipe_applies_the_rank_order_at_launch(tmp_path):
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps(HOSTS))
    out = tmp_path / "res.json"
    run_script("robust_plugins.recipes.megatron_gpt.train",
                 ["--preset", "cpu-tiny", "--tp", "2", "--steps", "3", "--codec", "int8",
                  "--topology-file", str(topo), "--out", str(out)], nproc=4, timeout_s=140,
                 log_path=tmp_path / "log")
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and sorted(res["tp_group_launcher_ranks"]) == [0, 2]

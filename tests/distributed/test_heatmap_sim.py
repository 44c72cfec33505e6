"""The heat map on the network-namespace simulator: one node's link is slowed with tc, and the
probe (real gloo send/recv between real processes) must name that node's links and the node.
Skipped without root / iproute2, failed instead where ``CI`` is set (``tests/_netns.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _netns import need_netns

from robust_plugins.sim import SimCluster

pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def _simulator_available():
    need_netns()  # skip, or fail where CI is set


FAST, SLOW = 1e9, 40e6  # bits/s; 25x apart, far beyond the probe's 0.5x threshold


def _slow_node(cluster: SimCluster, node: int, bits: float) -> None:
    # Both ends of the node's veth pair, as the simulator limits them (tbf; netem is unavailable).
    tbf = ["tbf", "rate", f"{int(bits)}bit", "burst", str(128 * 1024), "latency", "50ms"]
    for ns, dev in ((cluster.node_ns[node], "eth0"), (cluster.switch_ns, f"p{node}")):
        subprocess.run(["tc", "-n", ns, "qdisc", "change", "dev", dev, "root", *tbf], check=True, timeout=20)


def test_heatmap_names_the_slow_node_links(tmp_path):
    with SimCluster(nodes=3, ranks_per_node=1, rate=FAST) as cluster:
        _slow_node(cluster, 2, SLOW)
        results = cluster.run([sys.executable, "-m", "robust_plugins.telemetry.heatmap", "--out", str(tmp_path),
                               "--timeout", "60"], timeout_s=150)
    line = json.loads(results[0].stdout.strip().splitlines()[-1])
    res = json.loads((tmp_path / "heatmap.json").read_text())
    hosts = res["hosts"]
    assert len(set(hosts)) == 3, hosts  # one simulated host per node (ROBUST_TOPOLOGY_SIM)
    named = {(s["src"], s["dst"]) for s in res["outliers"]["links"]}
    assert named == {(0, 2), (2, 0), (1, 2), (2, 1)}, res["outliers"]
    assert res["outliers"]["hosts"] == [hosts[2]]
    # The measured numbers themselves: the slow links near the tbf rate, the others far above it.
    for a, b in named:
        assert res["bw"][a][b] * 8 < 1.5 * SLOW, res["bw"]
    assert min(res["bw"][0][1], res["bw"][1][0]) * 8 > 5 * SLOW, res["bw"]
    assert hosts[2] in line["summary"] and (tmp_path / "heatmap.png").stat().st_size > 5000

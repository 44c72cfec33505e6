"""The network-namespace cluster simulator: real namespaces, real tbf-limited links, real gloo ranks.

Runs when root and iproute2 are present; skipped with the reason otherwise, except where ``CI`` is
set: there a missing root or ``ip netns`` fails every test (CI must run them).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _netns import need_netns

from robust_plugins.sim import SimCluster, SimError
from robust_plugins.sim.netns import cleanup_leftovers, list_namespaces

pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def _simulator_available():
    need_netns()  # skip, or fail where CI is set


RATE_BITS = 50e6  # slow enough that 2 MB takes ~0.3 s, far from what the 2 CPU cores can push


@pytest.mark.timeout(120)
def test_two_nodes_two_ranks_inter_node_traffic_is_rate_limited_and_torn_down():
    with SimCluster(nodes=2, ranks_per_node=2, rate=RATE_BITS) as cluster:
        assert len(cluster.exists()) == 3  # switch + 2 nodes
        results = cluster.run(
            [sys.executable, "-m", "robust_plugins.sim.probe", "--mbytes", "2"], timeout_s=90
        )
        qdisc = subprocess.run(["tc", "-n", cluster.node_ns[1], "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        names = {*cluster.node_ns, cluster.switch_ns}
    assert [r.returncode for r in results] == [0, 0, 0, 0]
    measured = json.loads(results[0].stdout.strip().splitlines()[-1])
    assert "tbf" in qdisc and "50Mbit" in qdisc, qdisc
    # Near R: tbf's burst lets a little through early, TCP/gloo overhead takes a little.
    assert 0.6 * RATE_BITS < measured["inter_bits_per_s"] < 1.3 * RATE_BITS, measured
    # Inside a node the ranks talk over loopback, not the limited link.
    assert measured["intra_bits_per_s"] > 5 * RATE_BITS, measured
    assert names.isdisjoint(list_namespaces())


@pytest.mark.timeout(60)
def test_run_is_bounded_and_a_failed_rank_is_reported():
    with SimCluster(nodes=2, ranks_per_node=1, rate="1gbit") as cluster:
        start = time.monotonic()
        with pytest.raises(SimError, match="timed out after 1 s; ranks still running: \\[0, 1\\]"):
            cluster.run(["sleep", "30"], timeout_s=1)
        assert time.monotonic() - start < 15
        prog = "import os,sys; r=int(os.environ['RANK']); print(os.environ['GLOO_SOCKET_IFNAME'], " \
               "os.environ['MASTER_ADDR'], os.environ['ROBUST_TOPOLOGY_SIM']); sys.exit(3 if r == 1 else 0)"
        with pytest.raises(SimError, match="failed on ranks \\[1\\]"):
            cluster.run([sys.executable, "-c", prog], timeout_s=30)
        ok = cluster.run([sys.executable, "-c", prog.replace("3 if r == 1 else 0", "0")], timeout_s=30)
        assert [r.stdout.split() for r in ok] == [["eth0", "10.213.0.1", "2x1"]] * 2
        cluster.set_rate("20mbit")
        qdisc = subprocess.run(["tc", "-n", cluster.switch_ns, "qdisc", "show", "dev", "p0"],
                               capture_output=True, text=True).stdout
        assert "20Mbit" in qdisc, qdisc
    assert cluster.exists() == []


_HOLDER = textwrap.dedent("""
    import sys, time
    from robust_plugins.sim import SimCluster
    cluster = SimCluster(nodes=2, ranks_per_node=1, rate="100mbit")
    cluster.up()
    print(cluster.name, flush=True)
    time.sleep(60)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_namespaces_removed_when_the_creator_is_terminated_or_killed(how):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith("rpsim-"), name
        assert sum(ns.startswith(name + "-") for ns in list_namespaces()) == 3
        proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if how == "sigterm":  # the signal handler unwinds and atexit tears down
        assert proc.returncode == 128 + signal.SIGTERM
    else:  # nothing in the process can run: the leftovers are removed by the next cleanup
        assert any(ns.startswith(name + "-") for ns in list_namespaces())
        deleted = cleanup_leftovers()
        assert {ns for ns in deleted if ns.startswith(name + "-")} == {f"{name}-sw", f"{name}-n0", f"{name}-n1"}
    assert not any(ns.startswith(name + "-") for ns in list_namespaces())


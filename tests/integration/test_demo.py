"""`robust demo` end to end at a reduced size: 2 ranks, 80 steps; the comparison on the simulated
2-node cluster (as root; loopback otherwise), then a crash, a hang and a NaN injected into the
plugin job under robust run (as root: one agent per simulated node, one rank each). The demo must
recover all three, name each once on the node it hit, print the table, leave a report whose
charts all decode in headless Chromium and W&B offline runs in one group, and leave none of its
network namespaces behind, also when it is stopped mid-job."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _browser import load  # noqa: E402
from _netns import need_netns  # noqa: E402
from _wandb_offline import read_run  # noqa: E402

from robust_plugins.sim.netns import list_namespaces, netns_unavailable_reason, pid_running  # noqa: E402
from robust_plugins.watchdog.faults import fault_view_path  # noqa: E402

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(330)]


def _demo(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "robust_plugins.cli.main", "demo", "--nproc", "2",
                             "--out-dir", str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _namespaces_of(pid: int) -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(f"rpsim-{pid}-")]


def test_demo_recovers_three_faults_and_reports(tmp_path):
    out = tmp_path / "demo"
    proc = _demo(out, "--steps", "80", "--timeout", "240")
    try:
        stdout, stderr = proc.communicate(timeout=320)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    text = stdout
    sim = netns_unavailable_reason() is None
    # The demo says where the ranks talk, for both jobs.
    assert ("simulated 2-node cluster" in text) == sim, text[:600]
    assert ("one robust run agent per simulated node" in text) == sim, text[:900]
    assert ("2 ranks over loopback" in text) == (not sim), text[:900]
    # Each fault once, on the rank (and, on the simulator, the node) it hit: rank 1 runs on node 1.
    expect = {"crash": 1, "hang": 0, "nan": 1}
    for kind, rank in expect.items():
        node = f" \\(node 10\\.213\\.0\\.{rank + 1}\\)" if sim else ""
        assert len(re.findall(rf"! {kind} at step \d+ on rank\(s\) \[{rank}\]{node}:", text)) == 1, (kind, text)
    assert "3 fault(s) detected and recovered, 4 incarnation(s)" in text, text
    # Each fault's recovery time and how the ranks came back (faults.jsonl detail).
    assert len(re.findall(r"first step \d+\.\d s after detection \((warm standbys|cold start)\)", text)) == 3, text
    ratio = float(re.search(r"gradient bytes sent per step \(rank 0\).*?([0-9.]+)x", text).group(1))
    assert 0.2 < ratio < 0.3
    view = fault_view_path(out / "plugin-faults" / "node0") if sim else out / "plugin-faults" / "faults.jsonl"
    assert view.name == ("job_faults.jsonl" if sim else "faults.jsonl")
    faults = [json.loads(line) for line in view.read_text().splitlines()]
    assert sorted((f["kind"], f["suspect_ranks"]) for f in faults) == [("crash", [1]), ("hang", [0]), ("nan", [1])]
    assert all(f["resumed_at_step"] is not None for f in faults)
    # Recovery as robust run gives it by default: from the in-memory snapshots, a step at most.
    assert all(f["lost_steps"] <= 1 for f in faults), faults
    assert len(re.findall(r"\(\d steps redone\).*, restored from memory on 2 rank\(s\)", text)) == 3, text
    if sim:
        assert {f["kind"]: f["node"] for f in faults} == {"crash": "10.213.0.2", "hang": "10.213.0.1",
                                                         "nan": "10.213.0.2"}
        assert (out / "plugin-faults" / "node1" / "job_faults.jsonl").read_text() == view.read_text()
        assert _namespaces_of(proc.pid) == []
    # The links are probed once a job: a restart does not probe them again.
    records = [json.loads(x) for x in (out / "plugin-faults" / "telemetry" / "metrics.jsonl").read_text().splitlines()]
    assert [r["incarnation"] for r in records if r["kind"] == "start"] == [0, 1, 2, 3]
    heat = [r for r in records if r["kind"] == "heatmap"]
    assert len(heat) == 1 and heat[0]["step"] < 10, heat
    result = json.loads((out / "plugin-faults.json").read_text())
    assert result["loaded"] and result["steps"] == 80 and result["plugin_active"]
    # The report: every chart decodes, both runs in the table, the three faults listed.
    report = Path(re.search(r"report: (\S+)", text).group(1))
    dom, console = load(report)
    assert console == []
    expected = re.search(r'data-charts-expected="(\d+)"', dom).group(1)
    assert int(expected) == 7 and f'data-charts-ok="{expected}"' in dom  # 4 charts + 3 heat maps
    assert dom.count("<td>crash</td>") == 1 and dom.count("<td>hang</td>") == 1 and dom.count("<td>nan</td>") == 1
    # W&B: baseline and plugin (one run per incarnation) in one project and group.
    runs = [read_run(d) for d in sorted([*out.glob("*/wandb/offline-run-*"),
                                          *out.glob("*/telemetry/wandb/offline-run-*")])]
    assert len(runs) == 2 + 4  # baseline, plugin + the fault job's four incarnations
    assert {(r["project"], r["group"]) for r in runs} == {("robust_plugins-demo", f"demo-{out.name}")}


@pytest.mark.timeout(200)
def test_demo_stopped_during_the_fault_job_leaves_no_namespace_and_no_rank(tmp_path):
    # SIGTERM while the fault job's agents run in their simulated nodes: the demo unwinds through
    # the simulator's `with` block (its SIGTERM handler raises SystemExit), stopping the agents
    # and deleting the namespaces, which also kills anything left inside them.
    need_netns()
    out = tmp_path / "demo"
    proc = _demo(out, "--steps", "40", "--faults", "none", "--timeout", "150")
    workers = [out / "plugin-faults" / f"node{i}" / "workers.jsonl" for i in (0, 1)]
    try:
        deadline = time.monotonic() + 150
        while not all(w.exists() for w in workers):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the fault job's ranks did not start"
            time.sleep(0.2)
        assert len(_namespaces_of(proc.pid)) == 3  # the switch and two nodes
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM
    assert _namespaces_of(proc.pid) == []
    pids = [int(p) for w in workers for line in w.read_text().splitlines() for p in json.loads(line)["pids"].values()]
    # A rank killed after its agent is a zombie of PID 1 until that reaps it (seconds, in these
    # containers): dead, not running. Running ones would still be running after the wait.
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in pids if pid_running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"ranks left running: {alive}"

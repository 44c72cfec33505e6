"""`robust demo` end to end at a reduced size: 2 ranks, 80 steps; the comparison on the simulated
2-node cluster (as root; loopback otherwise), then a crash, a hang and a NaN injected into the
plugin job under robust run. The demo must recover all three, print the table, and leave a report
whose charts all decode in headless Chromium and W&B offline runs in one group."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _browser import load  # noqa: E402
from _wandb_offline import read_run  # noqa: E402

from robust_plugins.sim.netns import netns_unavailable_reason  # noqa: E402

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.timeout(330)]


def test_demo_recovers_three_faults_and_reports(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "robust_plugins.cli.main", "demo", "--nproc", "2", "--steps", "80",
                           "--out-dir", str(out), "--timeout", "240"],
                          capture_output=True, text=True, timeout=320)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    # The demo says where the ranks talk.
    assert ("simulated 2-node cluster" in text) == (netns_unavailable_reason() is None), text[:600]
    assert "over loopback: robust run cannot yet" in text
    for kind in ("crash", "hang", "nan"):
        assert re.search(rf"! {kind} at step \d+ on rank", text), kind
    assert "3 fault(s) detected and recovered, 4 incarnation(s)" in text, text
    # Each fault's recovery time and how the ranks came back (faults.jsonl detail).
    assert len(re.findall(r"first step \d+\.\d s after detection \((warm standbys|cold start)\)", text)) == 3, text
    ratio = float(re.search(r"gradient bytes sent per step \(rank 0\).*?([0-9.]+)x", text).group(1))
    assert 0.2 < ratio < 0.3
    faults = [json.loads(line) for line in (out / "plugin-faults" / "faults.jsonl").read_text().splitlines()]
    assert sorted(f["kind"] for f in faults) == ["crash", "hang", "nan"]
    assert all(f["resumed_at_step"] is not None for f in faults)
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

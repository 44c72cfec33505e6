"""An unsupported DeepSpeed (its version faked before the plugin's hook reads it): DeepSpeed without
the block trains, one warning says what is off, the block is refused naming the version, and
``robust prebuild`` fails naming it. One subprocess (~10 s, mostly imports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from robust_plugins.patches import _ranges

from robust_plugins.launch import launch_env

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

#: A DeepSpeed version just below the supported range (0.16.0 -> 0.15.9).
OLD = f"{_ranges.DEEPSPEED.minimum[0]}.{_ranges.DEEPSPEED.minimum[1] - 1}.9"
WORKER = Path(__file__).with_name("ds_unsupported_worker.py")


@pytest.fixture(scope="module")
def run():
    env = launch_env()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)  # another test's process group: the worker picks a free port of its own
    proc = subprocess.run([sys.executable, str(WORKER), "--version", OLD], env=env,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stderr


def test_deepspeed_without_the_block_trains_unchanged(run):
    result, _ = run
    losses = result["plain_losses"]
    assert len(losses) == 3 and losses[2] < losses[0] and not result["plain_has_plugin"]


def test_one_warning_names_host_version_range_and_what_is_off(run):
    _, stderr = run
    lines = [x for x in stderr.splitlines() if f"found deepspeed {OLD}" in x and "Off:" in x]
    assert len(lines) == 1, stderr[-3000:]
    assert _ranges.DEEPSPEED.spec in lines[0] and "robust_plugins block" in lines[0]


def test_a_config_with_the_block_is_refused_naming_the_version(run):
    result, _ = run
    assert result["block"] is not None
    assert f"found deepspeed {OLD}" in result["block"] and "remove the robust_plugins block" in result["block"]


def test_prebuild_fails_naming_the_version(run):
    result, stderr = run
    assert result["prebuild_rc"] != 0
    assert any(x.startswith("robust prebuild: error:") and f"found deepspeed {OLD}" in x for x in stderr.splitlines())

"""Stack collection from a really hung process: py-spy, and the faulthandler fallback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from robust_plugins.launcher.monitor import stacks
from robust_plugins.watchdog import protocol

pytestmark = [pytest.mark.fault, pytest.mark.timeout(60)]

HUNG = textwrap.dedent("""
    import sys
    from robust_plugins.watchdog import client, inject_rank
    client.step_end(1)
    getattr(inject_rank, sys.argv[1])(60.0)
""")


@pytest.fixture(params=["_hang_in_python", "_hang_in_syscall"])
def hung_rank(tmp_path, request):
    """A process that registered with a (fake) monitor and then hangs (Python loop or syscall)."""
    address = str(tmp_path / "m.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(address)
    srv.settimeout(30)
    env = {**os.environ, protocol.ENV_SOCKET: address, protocol.ENV_RUN_DIR: str(tmp_path), "RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-c", HUNG, request.param], env=env, stdin=subprocess.DEVNULL)
    try:
        hello = json.loads(srv.recv(65536))
        assert hello["k"] == "hello" and hello["pid"] == proc.pid
        assert json.loads(srv.recv(65536))["k"] == "end"
        time.sleep(0.5)  # from the step's datagram into the hang loop
        yield proc.pid, hello["fh"], tmp_path, request.param
    finally:
        proc.kill()
        proc.wait(timeout=10)
        srv.close()
    assert proc.poll() is not None


@pytest.mark.parametrize("tool", ["py-spy", "faulthandler"])
def test_hung_python_stack_is_collected(hung_rank, tool, monkeypatch):
    pid, fh, tmp, where = hung_rank
    if tool == "py-spy" and stacks.pyspy_path() is None:
        pytest.skip("py-spy is not installed")
    if tool == "faulthandler":
        monkeypatch.setenv("ROBUST_WATCHDOG_NO_PYSPY", "1")
    got = stacks.collect({0: (pid, fh)}, tmp / "stacks", "t", timeout_s=15.0)
    assert got[0].tool == tool
    assert got[0].frames[0][0] == where, got[0].frames
    assert os.path.exists(got[0].path)


def test_unreachable_rank_gives_no_stack_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("ROBUST_WATCHDOG_NO_PYSPY", "1")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    got = stacks.collect({3: (proc.pid, None)}, tmp_path, "t", timeout_s=2.0)
    assert got[3].tool == "none" and got[3].frames == []

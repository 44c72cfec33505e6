"""The network-namespace simulator tests' precondition: skip without root / iproute2, fail in CI.

The README's "tested as root" rests on these tests, so where ``CI`` is set a missing precondition
is an error, not a skip (a CI image that lost root or iproute2 must turn red).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from robust_plugins.sim.netns import netns_unavailable_reason


def unavailable_reason() -> str | None:
    """Why the simulator cannot run here (no root, no ``ip``/``tc``, ``ip netns`` failing), or None."""
    reason = netns_unavailable_reason()
    if reason is not None:
        return reason
    try:
        probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns list` did not run: {exc}"
    if probe.returncode != 0:
        return f"`ip netns list` failed (exit {probe.returncode}): {probe.stderr.strip()}"
    return None


def need_netns() -> None:
    """Skip the calling test when the simulator cannot run here; fail instead when ``CI`` is set."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI={os.environ['CI']!r} is set, so the network-namespace simulator tests must run, but "
                    f"{reason}. Run CI as root with iproute2 installed (ip, tc, ip netns).", pytrace=False)
    pytest.skip(reason)

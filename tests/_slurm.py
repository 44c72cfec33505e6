"""The SLURM tests' precondition: skip without root / iproute2 / Debian's slurm-wlm and munge.

`make slurm` installs the packages (root + apt-get, bounded). Where ``CI`` is set and this is
root, a missing package is an error, not a skip: CI runs `make slurm` first.
"""

from __future__ import annotations

import os

import pytest

from robust_plugins.sim.slurm import slurm_unavailable_reason


def need_slurm() -> None:
    """Skip the calling test when SLURM cannot run on the simulator; fail in CI as root."""
    reason = slurm_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") and os.geteuid() == 0:
        pytest.fail(f"CI={os.environ['CI']!r} is set and this is root, so the SLURM tests must run, but "
                    f"{reason}. Run `make slurm` before the tests.", pytrace=False)
    pytest.skip(reason)

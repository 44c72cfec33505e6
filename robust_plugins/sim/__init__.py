"""Simulated clusters on one machine (see :mod:`robust_plugins.sim.netns`)."""

from __future__ import annotations

from robust_plugins.sim.netns import (
    RankResult,
    SimCluster,
    SimError,
    cleanup_leftovers,
    format_rate,
    parse_rate,
    require_netns,
)

__all__ = [
    "RankResult",
    "SimCluster",
    "SimError",
    "cleanup_leftovers",
    "format_rate",
    "parse_rate",
    "require_netns",
]

"""The node monitor of ``robust run``: one :class:`Monitor` per node, in the agent process."""

from __future__ import annotations

from robust_plugins.launcher.monitor.monitor import Monitor

__all__ = ["Monitor"]

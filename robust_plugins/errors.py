"""Exception hierarchy: catch ``RobustPluginsError`` to catch everything this library raises."""

from __future__ import annotations


class RobustPluginsError(Exception):
    """Base class of every error raised by robust_plugins."""


class ConfigError(RobustPluginsError, ValueError):
    """A ``robust_plugins`` config block (or CLI flag) has an unknown key, wrong type or bad value."""


class UnsupportedError(RobustPluginsError):
    """The requested feature cannot run with this host setup (engine, ZeRO stage, version)."""


class HostVersionError(UnsupportedError, ImportError):
    """An installed DeepSpeed / megatron-core does not match what a patch was written for."""


class CheckpointError(RobustPluginsError):
    """Plugin state in a checkpoint is missing, corrupt or does not match the running job."""

"""robust_plugins: compressed gradient communication and robustness for DeepSpeed / megatron-core.

``import robust_plugins`` is cheap and safe: it imports neither DeepSpeed, megatron-core nor
Triton. It registers a post-import hook so that when DeepSpeed is imported (before or after this
module) ``deepspeed.initialize`` learns to read the ``"robust_plugins"`` block of its config.
Without the block, DeepSpeed behaves exactly as it does without this package.
"""

from __future__ import annotations

from robust_plugins.config import CompressionConfig, PluginConfig
from robust_plugins.errors import (
    CheckpointError,
    ConfigError,
    HostVersionError,
    RobustPluginsError,
    UnsupportedError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CompressionConfig",
    "ConfigError",
    "HostVersionError",
    "PluginConfig",
    "RobustPluginsError",
    "UnsupportedError",
    "__version__",
]

from robust_plugins import _hooks as _hooks

_hooks.install_deepspeed_hook()

"""robust_plugins: compressed gradient communication and robustness for DeepSpeed / megatron-core.

``import robust_plugins`` is cheap and safe: it imports neither DeepSpeed, megatron-core nor
Triton. It registers a post-import hook so that when DeepSpeed is imported (before or after this
module) ``deepspeed.initialize`` learns to read the ``"robust_plugins"`` block of its config.
Without the block, DeepSpeed behaves exactly as it does without this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from robust_plugins.errors import (
    CheckpointError,
    ConfigError,
    HostVersionError,
    RobustPluginsError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from robust_plugins.config import CompressionConfig, PluginConfig
    from robust_plugins.snapshot import Snapshotter

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CompressionConfig",
    "ConfigError",
    "HostVersionError",
    "PluginConfig",
    "RobustPluginsError",
    "Snapshotter",
    "UnsupportedError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # The config models load on first use: importing pydantic (~175 ms CPU) and building them
    # (~170 ms) would cost 20x the rest of this import (~16 ms), measured on the dev machine.
    if name in ("CompressionConfig", "PluginConfig"):
        from robust_plugins import config

        return getattr(config, name)
    if name == "Snapshotter":  # in-memory snapshots of a plain PyTorch loop (imports the watchdog)
        from robust_plugins.snapshot import Snapshotter

        return Snapshotter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from robust_plugins import _hooks as _hooks  # noqa: E402

_hooks.install_deepspeed_hook()

"""``PluginConfig``: the whole ``robust_plugins`` block, its entry points and cross-section checks."""

import os
from typing import Any, ClassVar, Mapping

from pydantic import PrivateAttr, model_validator

from robust_plugins.errors import ConfigError
from robust_plugins.schema._base import Section
from robust_plugins.schema.checkpoint import CheckpointConfig
from robust_plugins.schema.common import BLOCK_KEY, load_json
from robust_plugins.schema.compression import CompressionConfig
from robust_plugins.schema.telemetry import TelemetryConfig
from robust_plugins.schema.topology import TopologyConfig
from robust_plugins.schema.watchdog import WatchdogConfig


class PluginConfig(Section):
    """The whole ``robust_plugins`` block. A missing sub-block means that feature is off."""

    where: ClassVar[str] = BLOCK_KEY

    compression: CompressionConfig | None = None
    """Compressed gradient communication; ``None`` leaves the host's all-reduce untouched."""

    watchdog: WatchdogConfig | None = None
    """Fault detection settings read by ``robust run``; ``None`` means the defaults there."""

    checkpoint: CheckpointConfig | None = None
    """Verified, atomic disk checkpoints; ``None`` leaves DeepSpeed's own save/load unchanged."""

    telemetry: TelemetryConfig | None = None
    """Per-step metrics to a JSONL file and W&B; ``None`` records nothing."""

    topology: TopologyConfig | None = None
    """Topology-aware (hierarchical) gradient reduction; ``None``: flat, as the host does it."""

    # The block as given (after environment overrides), for logs and W&B run configs: not a
    # setting, so it is neither validated nor compared.
    _raw: Mapping[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def raw(self) -> Mapping[str, Any]:
        """The block as given (after environment overrides), for logs and W&B run configs."""
        return self._raw

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in type(self).model_fields)

    @model_validator(mode="after")
    def _cross_checks(self) -> "PluginConfig":
        topo, comp = self.topology, self.compression
        if topo is not None and topo.hierarchical and comp is not None and comp.sign_mode == "momentum":
            raise ConfigError(
                f"{BLOCK_KEY}.topology.hierarchical does not combine with compression.sign_mode = 'momentum' "
                f"(the momentum all-reduce is flat); remove one of the two."
            )
        if topo is not None and topo.hierarchical and comp is None:
            raise ConfigError(
                f"{BLOCK_KEY}.topology.hierarchical = true needs a {BLOCK_KEY}.compression sub-block "
                f"(the hierarchy replaces the compressed gradient all-reduce); add "
                f'"compression": {{"codec": "none"}} for fp32 all the way, or a codec such as "int8".'
            )
        return self

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None) -> "PluginConfig":
        """Validate a ``robust_plugins`` block (the value, not the whole DeepSpeed config)."""
        if block is None:
            return cls()
        if not isinstance(block, Mapping):
            raise ConfigError(f"{BLOCK_KEY} must be a JSON object, got {type(block).__name__}: {block!r}.")
        block = _apply_env_overrides(dict(block))
        cfg = cls.parse(block)
        cfg._raw = block
        return cfg

    @classmethod
    def from_kwargs(cls, **sections: Any) -> "PluginConfig":
        """Build from Python: ``PluginConfig.from_kwargs(compression={"codec": "int4"})``."""
        return cls.from_dict(sections)

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | str | os.PathLike | None) -> "PluginConfig":
        """Extract and validate the block from a whole DeepSpeed config (dict or JSON path)."""
        if ds_config is None:
            return cls()
        if isinstance(ds_config, (str, os.PathLike)):
            ds_config = load_json(ds_config)
        if not isinstance(ds_config, Mapping):
            raise ConfigError(f"A DeepSpeed config must be a JSON object, got {type(ds_config).__name__}.")
        if os.environ.get("ROBUST_DISABLE", "0") not in ("", "0"):
            return cls()
        return cls.from_dict(ds_config.get(BLOCK_KEY))

    def replace(self, **changes: Any) -> "PluginConfig":
        """A validated copy with ``changes``; ``raw`` is kept."""
        new = super().replace(**changes)
        new._raw = self._raw
        return new

    @property
    def active(self) -> bool:
        """True when a feature that hooks the host engine is configured (the watchdog sub-block
        alone makes the engine report its steps under ``robust run``)."""
        return (self.compression is not None or self.checkpoint is not None or self.telemetry is not None
                or self.watchdog is not None)

    def describe(self) -> str:
        """One line naming every active feature with its settings."""
        parts = [s.describe() for s in (self.compression, self.watchdog, self.checkpoint, self.telemetry,
                                        self.topology) if s is not None]
        return "; ".join(parts) if parts else "no features active"


def _apply_env_overrides(block: dict[str, Any]) -> dict[str, Any]:
    codec = os.environ.get("ROBUST_CODEC")
    if codec:
        comp = block.get("compression")
        # A non-object compression value is left for the schema to refuse with its own message.
        if comp is None or isinstance(comp, Mapping):
            block["compression"] = {**(comp or {}), "codec": codec}
    return block

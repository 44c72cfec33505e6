"""One record per rank: where it sits (host, NVLink domain, rail, switches). Pure data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from robust_plugins.errors import RobustPluginsError


class TopologyError(RobustPluginsError, ValueError):
    """The discovered or described topology cannot be used as asked (the message has the numbers)."""


class UnevenTopologyError(TopologyError):
    """NVLink domains (nodes) hold different numbers of ranks, so rail groups cannot be formed."""


@dataclass(frozen=True, order=True)
class RankRecord:
    """Where one rank runs.

    Fields are ordered so that sorting records sorts them by ``rank``.
    """

    rank: int
    """Global rank in the default process group."""
    host: str
    """Host name (a simulated node is ``sim-node<i>``)."""
    nvlink_domain: str
    """Ranks in one domain share the fast intra-node (or multi-node NVLink) fabric; defaults to ``host``."""
    local_index: int
    """Index of the rank on its host; ranks with equal ``local_index`` on different hosts share a rail."""
    switches: tuple[str, ...] = field(default=())
    """Network switches above the host, lowest tier first (e.g. ``("leaf-3", "spine-0")``); may be empty."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise TopologyError(f"rank = {self.rank!r} must be an int >= 0.")
        if isinstance(self.local_index, bool) or not isinstance(self.local_index, int) or self.local_index < 0:
            raise TopologyError(f"rank {self.rank}: local_index = {self.local_index!r} must be an int >= 0.")
        for name in ("host", "nvlink_domain"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TopologyError(f"rank {self.rank}: {name} = {value!r} must be a non-empty string.")
        if not isinstance(self.switches, tuple) or not all(isinstance(s, str) and s for s in self.switches):
            raise TopologyError(
                f"rank {self.rank}: switches = {self.switches!r} must be a tuple of non-empty strings."
            )

    def to_dict(self) -> dict:
        """A JSON-ready dict (``switches`` as a list)."""
        return {
            "rank": self.rank,
            "host": self.host,
            "nvlink_domain": self.nvlink_domain,
            "local_index": self.local_index,
            "switches": list(self.switches),
        }

"""The straggler detector (pure): ranks whose compute time stays above their peers', and episodes.

Nothing here touches processes or sockets; the node monitor (``launcher/monitor/detectors.py``)
feeds it each rank's compute time per step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


@dataclass
class Straggler:
    """A rank whose compute time per step stays above ``factor`` x its peers' median."""

    rank: int
    compute_s: float
    """The rank's median compute time over the window (step time minus collective time)."""
    peers_s: float
    """The median of its peers' window medians (the other ranks of its group)."""
    ratio: float


def peer_median(medians: Mapping[int, float], rank: int,
                groups: Mapping[int, Any] | None = None) -> float | None:
    """The median of the ``medians`` of ``rank``'s peers, or None when it has none.

    Peers: the other ranks of its group, ``groups[r]`` (ranks that do the same work: the ranks of
    one pipeline stage); a rank ``groups`` leaves out, or every rank when ``groups`` is None, is in
    the group ``None``."""
    key = groups.get(rank) if groups else None
    peers = [m for q, m in medians.items() if q != rank and (groups.get(q) if groups else None) == key]
    return statistics.median(peers) if peers else None


def stragglers(compute: Mapping[int, Sequence[float]], factor: float, window: int,
               groups: Mapping[int, Any] | None = None) -> list[Straggler]:
    """Ranks whose median compute time over their last ``window`` steps exceeds ``factor`` times
    the median of their peers' medians (:func:`peer_median`: the other ranks of the same
    ``groups`` key); ``[]`` until every rank has ``window`` values. A rank alone in its group has
    no peers and is not judged.

    Compute time, not step time: ranks of a data-parallel job wait for each other in every
    collective, so their step times are equal and only the time *outside* collectives tells the
    slow rank from those waiting for it. Groups, because pipeline stages do different work (the
    first holds the embedding, the last the output layer and the loss): a stage is compared with
    itself only. Medians (over steps, then over peers) keep
    one slow step (garbage collection, a checkpoint save) or one slow peer from deciding.
    """
    if factor <= 0 or len(compute) < 2:
        return []
    if any(len(v) < window for v in compute.values()):
        return []
    medians = {r: statistics.median(list(v)[-window:]) for r, v in compute.items()}
    out = []
    for r, mine in sorted(medians.items()):
        peers = peer_median(medians, r, groups)
        if peers is not None and peers > 0 and mine > factor * peers:
            out.append(Straggler(r, mine, peers, mine / peers))
    return out


@dataclass
class StragglerEpisode:
    """One rank's straggling, from its first detection to its end: reported once, when it ends.

    The detector (:func:`stragglers`) names a rank once its window's median compute time crosses
    the bar; from then on every step of the rank is judged on its own (``compute > factor x
    peers``), and the episode ends once ``window`` of its steps in a row were not slow *and* the
    rank's clock moved ``gap_s`` past its last slow step (:meth:`over`). A rank that slows down
    again within that stays in the same episode: a load that moves now and then makes one report,
    not one per move. An episode the detector stops naming before it :meth:`lasted` a minimum
    duration is a blip of a shared machine, not a straggler; the caller drops it.
    """

    rank: int
    first_step: int
    """The first step of the slow run that made the detector name the rank."""
    onset_wall: float
    detected_wall: float
    last_slow_step: int
    last_slow_wall: float
    seen_step: int
    """The newest step judged."""
    seen_wall: float = 0.0
    """The rank's wall time at the end of the newest step judged."""
    slow: list[float] = field(default_factory=list)
    """Compute seconds of each slow step."""
    ratios: list[float] = field(default_factory=list)
    """Each slow step's compute over its peers' median."""
    peers: list[float] = field(default_factory=list)
    group: Any = None
    """The group it is compared within (:func:`stragglers`' ``groups``; None: every rank)."""
    announced: bool = False
    """Its warning was logged (once, when it first :meth:`lasted` the minimum duration)."""

    def observe(self, step: int, compute_s: float, peers_s: float, factor: float, wall: float) -> None:
        """Judge one step of the rank (steps already judged are ignored)."""
        if step <= self.seen_step:
            return
        self.seen_step, self.seen_wall = step, wall
        if peers_s > 0 and compute_s > factor * peers_s:
            self.slow.append(compute_s)
            self.ratios.append(compute_s / peers_s)
            self.peers.append(peers_s)
            self.last_slow_step, self.last_slow_wall = step, wall

    def over(self, window: int, gap_s: float = 0.0) -> bool:
        """The episode has ended: ``window`` steps in a row judged not slow, spanning at least
        ``gap_s`` seconds of the rank's clock since its last slow step (the hysteresis that keeps
        a rank hovering at the bar in one episode)."""
        return (self.seen_step - self.last_slow_step >= window
                and self.seen_wall - self.last_slow_wall >= gap_s)

    def lasted(self, min_s: float) -> bool:
        """The slow run spanned at least ``min_s`` seconds from its onset to its last slow step."""
        return self.last_slow_wall - self.onset_wall >= min_s

    def summary(self) -> dict[str, Any]:
        """The report's numbers: duration, count of slow steps, median and highest ratio."""
        med = statistics.median(self.slow) if self.slow else 0.0
        peers = statistics.median(self.peers) if self.peers else 0.0
        return {"first_step": self.first_step, "last_slow_step": self.last_slow_step,
                "duration_s": round(max(0.0, self.last_slow_wall - self.onset_wall), 3),
                "slow_steps": len(self.slow), "compute_s": round(med, 4), "peers_compute_s": round(peers, 4),
                "ratio": round(statistics.median(self.ratios), 2) if self.ratios else 0.0,
                "ratio_max": round(max(self.ratios), 2) if self.ratios else 0.0, "group": self.group}

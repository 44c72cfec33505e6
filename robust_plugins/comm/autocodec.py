"""The ``auto`` codec: pick, per bucket size, the wire format that minimises all-reduce time.

Compression pays only where the link is slow compared with the cost of encoding (on a fast link
it is slower than fp32: BENCHMARKS.md), so the choice is made from measurements, in two layers:

* :func:`choose_codec` is pure: given a link estimate (bus bandwidth and per-collective latency of
  the group), each codec's measured compute cost per element and relative error, and the bucket
  size, it predicts each candidate's time and picks the fastest one whose error passes the quality
  guard, keeping ``none`` unless a codec is predicted at least ``min_gain`` faster. Unit tests call
  it with made-up numbers.
* :class:`AutoCodec` measures those inputs (:meth:`AutoCodec.probe`, with the timed measurements
  of :mod:`robust_plugins.comm.auto_measure`): one tiny and one
  ``probe_bytes`` fp32 all-reduce on the group give latency and bus bandwidth (or the bandwidth is
  given, ``link_gbit``), and one local encode / reduce / decode of a sample of the real bucket gives
  each codec's cost and error. Every number is max-reduced over the group, so every rank computes
  the same decision (ranks that picked different codecs would post mismatched collectives). It
  probes at the first bucket and again every ``recheck_steps`` steps; every new decision is logged
  on rank 0 and kept in :meth:`AutoCodec.decisions` for metrics.

The cost model and the pure choices live in :mod:`robust_plugins.comm.auto_model`, the
measurements in :mod:`robust_plugins.comm.auto_measure`; both are re-exported here.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any, Callable, Mapping, Sequence

import torch

from robust_plugins._logging import get_logger, log_rank0
from robust_plugins.config import AUTO_CANDIDATES
from robust_plugins.comm.auto_measure import (  # noqa: F401  (measurements; re-exported)
    CodecCost,
    _max_over_group,
    _ranks_of,
    measure_bf16_allreduce,
    measure_codec,
    measure_link,
    measure_links,
    timed_runs,
)
from robust_plugins.comm.auto_model import (  # noqa: F401  (the cost model; re-exported)
    CLOSE_FACTOR,
    CLOSE_RERUNS,
    COLLECTIVES,
    FLAT_ONLY,
    HOST_ROUTES,
    HOST_TRIALS,
    TRIAL_FACTOR,
    Decision,
    LinkEstimate,
    bytes_per_element,
    choose_codec,
    choose_host_wire,
    choose_route,
    predict_reduce_scatter_seconds,
    predict_route_seconds,
    predict_seconds,
    rerun_routes,
    step_gain,
    trial_routes,
)
from robust_plugins.errors import ConfigError

_log = get_logger(__name__)


class AutoCodec:
    """Measures and decides the ``auto`` codec for one group (see the module docstring).

    Args:
        candidates: codecs to choose among (``none`` is always one).
        block_size: scale block of the compressed codecs.
        min_gain, max_error: as for :func:`choose_codec`.
        link_gbit: the group's link rate in Gbit/s, if known; then only latency and codec costs
            are measured (the bus bandwidth is taken as this rate).
        probe_bytes: size of the fp32 all-reduce that measures bandwidth.
        sample_numel: at most this many elements of the bucket are encoded to measure codec costs.
        recheck_steps: probe again when ``step_fn()`` has advanced this many steps (0: never).
        bf16_error_feedback: whether the ``bf16_allreduce`` route feeds back its cast's rounding
            (what its measured cost includes; ``compression.auto_bf16_error_feedback``).
        step_fn: the host's optimizer step counter (default: number of probes-worthy calls made).
    """

    def __init__(
        self,
        *,
        candidates: Sequence[str] = AUTO_CANDIDATES,
        block_size: int = 256,
        min_gain: float = 0.1,
        max_error: float = 0.1,
        link_gbit: float | None = None,
        probe_bytes: int = 4 << 20,
        sample_numel: int = 1 << 20,
        recheck_steps: int = 1000,
        step_fn: Callable[[], int] | None = None,
        bf16_error_feedback: bool = False,
    ):
        bad = [c for c in candidates if c not in AUTO_CANDIDATES]
        if bad or not candidates:
            raise ConfigError(f"auto candidates {list(candidates)!r}: allowed are {', '.join(AUTO_CANDIDATES)}.")
        self.candidates = tuple(dict.fromkeys(("none", *candidates)))
        self.block_size = block_size
        self.min_gain = min_gain
        self.max_error = max_error
        self.link_gbit = link_gbit
        self.probe_bytes = probe_bytes
        self.sample_numel = sample_numel
        self.recheck_steps = recheck_steps
        self.bf16_error_feedback = bf16_error_feedback
        self._calls = 0
        self._step_fn = step_fn or (lambda: self._calls)
        self._probes: dict[Any, tuple[int, LinkEstimate, dict[str, CodecCost]]] = {}
        self._decisions: dict[tuple[Any, int], Decision] = {}
        self.history: list[dict[str, Any]] = []
        """Every decision made, in order, as dicts (step, group, numel, codec, reason, predictions)."""

    def _group_key(self, group) -> Any:
        return _ranks_of(group)

    def probe(self, sample: torch.Tensor, group=None, agree_group=None) -> tuple[LinkEstimate, dict[str, CodecCost]]:
        """Measure the group's link and each candidate's cost (a collective: every rank calls it).

        The numbers are max-reduced over ``agree_group`` (default: ``group``); a caller whose
        ``group`` is one of several disjoint groups reducing at the same moment (the rails of a
        hierarchical all-reduce) passes the group spanning them all, so every rail decides alike.
        """
        import torch.distributed as dist

        w = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        costs = {c: measure_codec(c, sample[: self.sample_numel], w, self.block_size, self.bf16_error_feedback)
                 for c in self._codec_candidates() if c != "none"}
        latency, seconds_per_byte = 0.0, 0.0
        if w > 1:
            latency, seconds_per_byte, _ = self._link(group, self.link_gbit)
        names = sorted(costs)
        # Max over the group (the slowest rank's view): identical inputs on every rank, so every
        # rank makes the same decision.
        agreed = _max_over_group(
            [latency, seconds_per_byte] + [costs[c].seconds_per_element for c in names]
            + [costs[c].rel_error for c in names], group if agree_group is None else agree_group)
        latency, seconds_per_byte = agreed[0], agreed[1]
        k = len(names)
        costs = {c: CodecCost(agreed[2 + i], agreed[2 + k + i]) for i, c in enumerate(names)}
        bandwidth = 1 / seconds_per_byte if seconds_per_byte > 0 else math.inf
        return LinkEstimate(bandwidth, latency, w), costs

    def _codec_candidates(self) -> tuple[str, ...]:
        """The candidates that are codecs of the two-phase collectives (what :meth:`codec_for`
        picks among: the rail step, a reduce): all but :data:`FLAT_ONLY`."""
        return tuple(c for c in self.candidates if c not in FLAT_ONLY)

    def codec_for(self, tensor: torch.Tensor, group=None, numel: int | None = None, agree_group=None) -> str:
        """The two-phase codec for reducing ``tensor`` (or a bucket of ``numel`` of its elements) over
        ``group`` (never a :data:`FLAT_ONLY` candidate: those are routes, see :meth:`route_for`).

        Probes first when this group was never probed or ``recheck_steps`` steps have passed (a
        collective: call it on every rank of ``group`` and of ``agree_group``, see :meth:`probe`,
        in the same order as the reductions).
        """
        self._calls += 1
        numel = tensor.numel() if numel is None else numel
        gkey = self._group_key(group)
        step = self._step_fn()
        probed = self._probes.get(gkey)
        if probed is None or (self.recheck_steps and step - probed[0] >= self.recheck_steps):
            link, costs = self.probe(tensor.reshape(-1), group, agree_group)
            self._probes[gkey] = probed = (step, link, costs)
            self._decisions = {k: v for k, v in self._decisions.items() if k[0] != gkey}
        decision = self._decisions.get((gkey, numel))
        if decision is None:
            _, link, costs = probed
            decision = choose_codec(numel, link, costs, candidates=self._codec_candidates(),
                                    block_size=self.block_size, min_gain=self.min_gain, max_error=self.max_error)
            self._decisions[(gkey, numel)] = decision
            record = {"step": step, "group": list(gkey), "link_bytes_per_s": link.bus_bytes_per_s,
                      "latency_s": link.latency_s, **decision.to_dict()}
            self.history.append(record)
            log_rank0(
                _log, logging.INFO,
                "auto codec: %d elements over %d ranks -> %s (%s; predicted %s; link %.3g MB/s, latency %.2g ms)",
                numel, link.group_size, decision.codec, decision.reason,
                ", ".join(f"{c} {t * 1e3:.1f} ms" for c, t in decision.predicted_s.items()),
                link.bus_bytes_per_s / 1e6, link.latency_s * 1e3,
            )
        return decision.codec

    # -- routes: flat or hierarchical, and the codec ------------------------------------------
    def _link(self, group, given_gbit: float | None) -> tuple[float, float, int]:
        """(latency s, seconds per bus byte, size) of one all-reduce on ``group``; unagreed."""
        return measure_link(group, given_gbit, self.probe_bytes)

    def probe_routes(self, sample: torch.Tensor, group, intra, rail) -> tuple[dict[str, LinkEstimate],
                                                                               dict[str, CodecCost]]:
        """Measure the data-parallel (``flat``), node (``intra``) and ``rail`` links and each codec's
        cost; every number max-reduced over ``group`` so that every rank decides alike (a collective
        on ``group``; the node and rail probes run on all of their disjoint groups at once).
        ``auto_link_gbit``, when given, is the rate of the flat and rail links (both cross nodes);
        the node link is always measured."""
        import torch.distributed as dist

        w = dist.get_world_size(group)
        costs = {c: measure_codec(c, sample[: self.sample_numel], w, self.block_size, self.bf16_error_feedback)
                 for c in self.candidates if c != "none"}
        kinds = {"flat": group} | {k: g for k, g in (("intra", intra), ("rail", rail)) if g is not None}
        measured = measure_links(kinds, {"flat": self.link_gbit, "intra": None, "rail": self.link_gbit},
                                 self.probe_bytes)
        for kind in ("intra", "rail"):
            measured.setdefault(kind, (0.0, 0.0, 1))  # no hierarchy: a node and a rail of one rank each
        names = sorted(costs)
        flat_values = [v for kind in ("flat", "intra", "rail") for v in measured[kind][:2]]
        agreed = _max_over_group(flat_values + [costs[c].seconds_per_element for c in names]
                                 + [costs[c].rel_error for c in names], group)
        links = {}
        for i, kind in enumerate(("flat", "intra", "rail")):
            latency, spb = agreed[2 * i], agreed[2 * i + 1]
            links[kind] = LinkEstimate(1 / spb if spb > 0 else math.inf, latency, measured[kind][2])
        k = len(names)
        costs = {c: CodecCost(agreed[6 + i], agreed[6 + k + i]) for i, c in enumerate(names)}
        return links, costs

    def _trial(self, tensor: torch.Tensor, routes: Sequence[str], run: Callable[[str, torch.Tensor], Any],
               group, predicted: Mapping[str, float]) -> dict[str, float]:
        """Run each route on a copy of ``tensor``; the agreed (max over ``group``) time of each, the
        median of ``1 + CLOSE_RERUNS`` interleaved runs for the routes :func:`rerun_routes` names."""
        times = {r: t[0] for r, t in timed_runs(tensor, routes, run, group).items()}
        close = rerun_routes(times, predicted)
        if len(close) > 1:
            again = timed_runs(tensor, close, run, group, rounds=CLOSE_RERUNS)
            for r in close:
                times[r] = statistics.median([times[r], *again[r]])
        return times

    def route_for(self, tensor: torch.Tensor, *, group, intra, rail, per_node: int,
                  run: Callable[[str, torch.Tensor], Any], numel: int | None = None,
                  collective: str = "all_reduce") -> Decision:
        """The route (layout and codec) for reducing ``tensor`` over ``group`` (see the module docstring).

        A collective on ``group``: probes the links when this group was never probed or
        ``recheck_steps`` steps have passed, and, unless ``link_gbit`` is given, runs the candidate
        routes on copies of ``tensor`` through ``run(route, copy)`` (which must reduce without
        error feedback) at the first bucket of each size. Without a hierarchy (``intra`` and
        ``rail`` ``None``) only the flat routes, i.e. the codecs, are candidates. ``collective``
        (``all_reduce`` or ``reduce_scatter``, whose ``tensor`` is the whole input) selects the time
        model of :func:`choose_route`; each collective's decisions are kept apart, and ``run`` must
        run that collective.
        """
        self._calls += 1
        numel = tensor.numel() if numel is None else numel
        gkey = ("route",) + tuple(self._group_key(group))
        step = self._step_fn()
        probed = self._probes.get(gkey)
        if probed is None or (self.recheck_steps and step - probed[0] >= self.recheck_steps):
            links, costs = self.probe_routes(tensor.reshape(-1), group, intra, rail)
            self._probes[gkey] = probed = (step, links, costs)
            self._decisions = {k: v for k, v in self._decisions.items() if k[0] != gkey}
        cache = (gkey, numel) if collective == "all_reduce" else (gkey, numel, collective)
        decision = self._decisions.get(cache)
        if decision is None:
            _, links, costs = probed
            kw = dict(per_node=per_node, hierarchical=links["rail"].group_size > 1, candidates=self.candidates,
                      block_size=self.block_size, min_gain=self.min_gain, max_error=self.max_error,
                      collective=collective)
            decision = choose_route(numel, links, costs, **kw)
            if self.link_gbit is None:
                measured = self._trial(tensor, trial_routes(decision.predicted_s), run, group,
                                       decision.predicted_s)
                decision = choose_route(numel, links, costs, measured=measured, **kw)
            self._decisions[cache] = decision
            self.history.append({"step": step, "group": list(gkey[1:]), **decision.to_dict()})
            log_rank0(
                _log, logging.INFO,
                "auto route (%s): %d elements -> %s (%s; predicted %s%s)", collective, numel, decision.route,
                decision.reason,
                ", ".join(f"{r} {t * 1e3:.1f} ms" for r, t in decision.predicted_s.items()),
                "; measured " + ", ".join(f"{r} {t * 1e3:.1f} ms" for r, t in decision.measured_s.items())
                if decision.measured_s else "",
            )
        return decision

    def due(self, step: int) -> bool:
        """Whether the next bucket at host step ``step`` makes a new decision: nothing was probed
        yet, or a probe in force expired (``recheck_steps``)."""
        if not self._probes:
            return True
        due = self.next_recheck_step()
        return due is not None and step >= due

    def measured_error(self, codec: str) -> float | None:
        """The largest relative error measured for ``codec`` by the probes in force (agreed over the
        group, on a sample of a real bucket before its reduction); None if none measured it."""
        errs = [costs[codec].rel_error for _, _, costs in self._probes.values() if codec in costs]
        return max(errs) if errs else None

    def next_recheck_step(self) -> int | None:
        """The host step at which the earliest probe in force expires (``recheck_steps`` after it),
        so that decisions are measured again; None when ``recheck_steps`` is 0 (never) or nothing
        was probed yet."""
        if not self.recheck_steps or not self._probes:
            return None
        return min(step for step, *_ in self._probes.values()) + self.recheck_steps

    def decisions(self) -> list[dict[str, Any]]:
        """The decisions now in force, as dicts (for metrics)."""
        return [{"group": [r for r in g if r != "route"], **d.to_dict()} for (g, *_), d in self._decisions.items()]

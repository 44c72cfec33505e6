"""The ``auto`` codec's decisions in force: one object per job that asks the measurer for facts and
the planner for a codec or route per bucket size.

Flow, one way: :meth:`AutoCodec.decide` measures the group's links and the candidates' codec
costs once per re-check period
(:mod:`robust_plugins.comm.auto_measure`), asks the pure planner
(:mod:`robust_plugins.comm.auto_model`) for the route of each new bucket size, times the routes the
planner names on the real bucket unless the link rate is given, and asks the planner again with
those times. Every number is agreed over the group, so every rank holds the same decision (ranks
that picked different codecs would post mismatched collectives). Each new decision is logged on
rank 0 and kept in :attr:`AutoCodec.history` and :meth:`AutoCodec.decisions` for metrics.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable, Sequence

import torch

from robust_plugins._logging import get_logger, log_rank0
from robust_plugins.comm import auto_measure as measure
from robust_plugins.comm import auto_model as model
from robust_plugins.comm.auto_model import CodecCost, Decision, LinkEstimate
from robust_plugins.config import AUTO_CANDIDATES, BF16_ALLREDUCE
from robust_plugins.errors import ConfigError

_log = get_logger(__name__)


class AutoCodec:
    """The ``auto`` decisions of one job, per group and bucket size (see the module docstring).

    Args:
        candidates: codecs to choose among (``none`` is always one).
        block_size: scale block of the compressed codecs.
        min_gain, max_error: as for :func:`~robust_plugins.comm.auto_model.choose_codec`.
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

    def _codec_candidates(self) -> tuple[str, ...]:
        """The candidates that are codecs of the two-phase collectives (a codec-only decision picks
        among these): all but :data:`~robust_plugins.comm.auto_model.FLAT_ONLY`."""
        return tuple(c for c in self.candidates if c not in model.FLAT_ONLY)

    def decide(self, tensor: torch.Tensor, group=None, *, numel: int | None = None, intra=None, rail=None, per_node: int = 1, run: Callable[[str, torch.Tensor], Any] | None = None,
               collective: str = "all_reduce") -> Decision:
        """The decision for reducing ``tensor`` (or a bucket of ``numel`` of its elements) over ``group``.

        With ``run``, a route (layout and codec): ``intra``, ``rail`` and ``per_node`` describe the
        hierarchy (``None``: flat routes only); unless ``link_gbit`` is given, the routes the planner
        names are timed on copies of ``tensor`` through ``run(route, copy)`` (which must reduce
        without error feedback) at the first bucket of each size; ``collective`` (``all_reduce`` or
        ``reduce_scatter``, whose ``tensor`` is the whole input) selects the planner's time model and
        ``run`` must run that collective. Without ``run``, a codec of the two-phase collectives from
        the planner's predictions (never a ``FLAT_ONLY`` candidate).

        A collective on ``group``, on every rank in the same order as the reductions: the facts are measured when this group was never measured or ``recheck_steps``
        steps have passed. Route and codec decisions are kept apart, and so are collectives.
        """
        self._calls += 1
        numel = tensor.numel() if numel is None else numel
        routes = run is not None
        gkey = (("route",) if routes else ()) + tuple(measure.ranks_of(group))
        step = self._step_fn()
        probed = self._probes.get(gkey)
        if probed is None or (self.recheck_steps and step - probed[0] >= self.recheck_steps):
            sample = tensor.reshape(-1)[: self.sample_numel]
            settings = dict(block_size=self.block_size, bf16_error_feedback=self.bf16_error_feedback,
                            link_gbit=self.link_gbit, probe_bytes=self.probe_bytes)
            if routes:
                links, costs = measure.probe_routes(sample, group, intra, rail, codecs=self.candidates, **settings)
            else:
                links, costs = measure.probe(sample, group, codecs=self._codec_candidates(), **settings)
            self._probes[gkey] = probed = (step, links, costs)
            self._decisions = {k: v for k, v in self._decisions.items() if k[0] != gkey}
        cache = (gkey, numel) if collective == "all_reduce" else (gkey, numel, collective)
        decision = self._decisions.get(cache)
        if decision is not None:
            return decision
        _, links, costs = probed
        guard = dict(block_size=self.block_size, min_gain=self.min_gain, max_error=self.max_error)
        if routes:
            kw = dict(per_node=per_node, hierarchical=links["rail"].group_size > 1, candidates=self.candidates,
                      collective=collective, **guard)
            decision = model.choose_route(numel, links, costs, **kw)
            if self.link_gbit is None:
                predicted = decision.predicted_s
                measured = measure.trial_times(tensor, model.trial_routes(predicted), run, group, predicted)
                decision = model.choose_route(numel, links, costs, measured=measured, **kw)
            record = {"step": step, "group": list(gkey[1:]), **decision.to_dict()}
            line = ("auto route (%s): %d elements -> %s (%s; predicted %s%s)", collective, numel, decision.route,
                    decision.reason, ", ".join(f"{r} {t * 1e3:.1f} ms" for r, t in decision.predicted_s.items()),
                    "; measured " + ", ".join(f"{r} {t * 1e3:.1f} ms" for r, t in decision.measured_s.items())
                    if decision.measured_s else "")
        else:
            decision = model.choose_codec(numel, links, costs, candidates=self._codec_candidates(), **guard)
            record = {"step": step, "group": list(gkey), "link_bytes_per_s": links.bus_bytes_per_s,
                      "latency_s": links.latency_s, **decision.to_dict()}
            line = ("auto codec: %d elements over %d ranks -> %s (%s; predicted %s; link %.3g MB/s, latency %.2g ms)",
                    numel, links.group_size, decision.codec, decision.reason,
                    ", ".join(f"{c} {t * 1e3:.1f} ms" for c, t in decision.predicted_s.items()),
                    links.bus_bytes_per_s / 1e6, links.latency_s * 1e3)
        self._decisions[cache] = decision
        self.history.append(record)
        log_rank0(_log, logging.INFO, *line)
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

    def host_wire(self, trial: Callable[[], torch.Tensor], group) -> tuple[str, str, dict[str, float]]:
        """What a host's own single-bucket reduction sends once ``auto`` handed a step back:
        ``("bf16", reason, medians)`` or ``("fp32", reason, medians)``, from the planner's
        :func:`~robust_plugins.comm.auto_model.choose_host_wire` on interleaved timed runs of both
        wires on ``trial()`` (a collective on ``group``; the medians in seconds by wire, empty when
        nothing was timed) and the bf16 error measured by the probes in force."""
        if BF16_ALLREDUCE not in self.candidates:
            return "fp32", "bf16_allreduce is not among auto_candidates", {}
        # The quality guard's error is the probe's (a real bucket before its reduction, every rank's
        # bf16 sum simulated): reduced gradients are equal on every rank, whose bf16 sum can be exact.
        rel = self.measured_error(BF16_ALLREDUCE)
        if rel is None:
            return "fp32", "no probe measured bf16_allreduce's error", {}
        times = measure.host_wire_times(trial(), group)
        wire, reason = model.choose_host_wire(times["fp32"], times["bf16"], rel, min_gain=self.min_gain,
                                              max_error=self.max_error)
        return wire, reason, {w: statistics.median(t) for w, t in times.items()}

    def decisions(self) -> list[dict[str, Any]]:
        """The decisions now in force, as dicts (for metrics)."""
        return [{"group": [r for r in g if r != "route"], **d.to_dict()} for (g, *_), d in self._decisions.items()]

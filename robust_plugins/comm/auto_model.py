"""The ``auto`` planner: pure functions from measured facts (link estimates, codec costs, trial
times) to a codec or route per bucket. No I/O, no collectives; unit tests call every function here
with made-up numbers. :mod:`robust_plugins.comm.auto_measure` produces the facts.

Cost model for a bucket of ``n`` fp32 elements on a group of ``W`` ranks (each rank sends and
receives ``2 (W-1) / W`` of the bucket in a ring all-reduce, and the same share of the compressed
bucket in the two-phase scheme)::

    none:  latency     + 2 (W-1)/W * n * 4   / bus_bandwidth
    codec: 2 * latency + 2 (W-1)/W * n * bpe / bus_bandwidth + n * cost_per_element

where ``bpe`` is the codec's bytes per element including its fp32 scale per block.

``bf16_allreduce`` is not a two-phase codec but the host's own collective on a bf16 copy
(:func:`~robust_plugins.comm.collectives.bf16_all_reduce`, the scheme of DeepSpeed's
``communication_data_type: bf16``): one collective, so one latency, 2 bytes an element, and the
cast (with error feedback of its rounding only with ``auto_bf16_error_feedback``) as compute cost::

    bf16_allreduce: latency + 2 (W-1)/W * n * 2 / bus_bandwidth + n * cost_per_element

Its quality guard counts the backend's bf16 additions too. It exists as a flat route only: the
hierarchy's rail step is a two-phase codec.

**Routes** (``topology.hierarchical`` with ``auto``): the choice is then a *route*, a layout and a
codec, among ``flat <codec>`` (``flat none`` is the host's own uncompressed all-reduce) and
``hier <codec>`` (intra-node fp32 reduce-scatter + all-gather, the codec on the rail). The model
adds the intra-node steps, priced like one fp32 all-reduce on the node group, to the rail step of
``ceil(n / ranks_per_node)`` elements::

    flat c:  codec time of n elements on the data-parallel group's link
    hier c:  none time of n elements on the node's link + codec time of n / p on the rail's link

**Reduce-scatters** choose among the same routes with the reduce-scatter's model
(:func:`predict_reduce_scatter_seconds`): each rank sends and receives ``(W-1) / W`` of the
bucket, half the all-reduce's bus traffic, in one collective::

    none:  latency + (W-1)/W * n * 4   / bus_bandwidth
    codec: latency + (W-1)/W * n * bpe / bus_bandwidth + n * cost_per_element
    hier c: none reduce-scatter of n on the node's link + codec reduce-scatter of n / p on the rail

``cost_per_element`` is the all-reduce's measured codec cost, an upper bound for the
reduce-scatter's encode and decode. :data:`FLAT_ONLY` candidates are no reduce-scatter.

The model alone decides when the link rate is given (``auto_link_gbit``). Otherwise it only
prunes (:func:`trial_routes`): the routes it names are timed on a copy of the real bucket, and
:func:`choose_route` picks from those times: the measured fastest route, an exact one unless a
lossy one measured ``min_gain`` faster. A bandwidth probe does not predict links that share cores
with the ranks (a node's loopback), which is why trials decide.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from robust_plugins.config import AUTO_CANDIDATES, BF16_ALLREDUCE
from robust_plugins.errors import ConfigError

#: Candidates that are a plain collective on the whole bucket, not a codec for the hierarchy's
#: rail step: ``auto`` offers them as flat routes only.
FLAT_ONLY = (BF16_ALLREDUCE,)


@dataclass(frozen=True)
class CodecCost:
    """Compute cost (encode + reduce + decode, seconds per element) and relative error of a codec."""

    seconds_per_element: float
    rel_error: float


def bytes_per_element(codec: str, block_size: int) -> float:
    """Wire bytes per gradient element, scales included."""
    code = {"none": 4.0, "bf16": 2.0, BF16_ALLREDUCE: 2.0, "int8": 1.0, "int4": 0.5, "sign": 0.125}
    if codec not in code:
        raise ConfigError(f"codec {codec!r} has no wire size; allowed: {', '.join(code)}.")
    scale = 0.0 if codec in ("none", "bf16", BF16_ALLREDUCE) else 4.0 / block_size
    return code[codec] + scale


@dataclass(frozen=True)
class LinkEstimate:
    """What one all-reduce on the group costs: ``latency_s + bytes_on_bus / bus_bytes_per_s``."""

    bus_bytes_per_s: float
    latency_s: float
    group_size: int


@dataclass(frozen=True)
class Decision:
    """The codec (and, for routes, the layout) chosen for buckets of ``numel`` elements, with the
    predictions (keyed by codec, or by route ``"<layout> <codec>"``) and measurements behind it."""

    numel: int
    codec: str
    predicted_s: Mapping[str, float]
    reason: str
    excluded: Mapping[str, str] = field(default_factory=dict)
    layout: str = "flat"
    """``flat`` or ``hier`` (routes only; a plain codec decision is ``flat``)."""
    measured_s: Mapping[str, float] = field(default_factory=dict)
    """Routes only: the agreed (slowest rank's) trial time of every route that was run."""
    collective: str = "all_reduce"
    """What the route reduces with: ``all_reduce`` or ``reduce_scatter``."""

    @property
    def route(self) -> str:
        """``"<layout> <codec>"``, e.g. ``"hier int8"``."""
        return f"{self.layout} {self.codec}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for logs and metrics."""
        return {"numel": self.numel, "codec": self.codec, "layout": self.layout, "route": self.route,
                "reason": self.reason, "predicted_s": dict(self.predicted_s), "measured_s": dict(self.measured_s),
                "excluded": dict(self.excluded), "collective": self.collective}


def predict_seconds(codec: str, numel: int, link: LinkEstimate, cost: CodecCost | None, block_size: int) -> float:
    """Predicted all-reduce time of ``numel`` elements with ``codec`` (the module's cost model)."""
    w = link.group_size
    if w <= 1:
        return 0.0 if codec == "none" else numel * (cost.seconds_per_element if cost else 0.0)
    bus = 2 * (w - 1) / w * numel * bytes_per_element(codec, block_size) / link.bus_bytes_per_s
    if codec == "none":
        return link.latency_s + bus
    if cost is None:
        raise ConfigError(f"no measured cost for codec {codec!r}: probe it or drop it from the candidates.")
    collectives = 1 if codec == BF16_ALLREDUCE else 2
    return collectives * link.latency_s + bus + numel * cost.seconds_per_element


def predict_reduce_scatter_seconds(codec: str, numel: int, link: LinkEstimate, cost: CodecCost | None,
                                   block_size: int) -> float:
    """Predicted reduce-scatter time of ``numel`` elements (the whole input) with ``codec`` (the
    module's reduce-scatter model: half the all-reduce's bus bytes, one collective)."""
    if codec in FLAT_ONLY:
        raise ConfigError(f"codec {codec!r} is an all-reduce of the whole bucket, not a reduce-scatter; "
                          f"allowed: none and the two-phase codecs.")
    w = link.group_size
    if w <= 1:
        return 0.0 if codec == "none" else numel * (cost.seconds_per_element if cost else 0.0)
    bus = (w - 1) / w * numel * bytes_per_element(codec, block_size) / link.bus_bytes_per_s
    if codec == "none":
        return link.latency_s + bus
    if cost is None:
        raise ConfigError(f"no measured cost for codec {codec!r}: probe it or drop it from the candidates.")
    return link.latency_s + bus + numel * cost.seconds_per_element


#: What a route reduces with, and its one-collective time model.
COLLECTIVES = {"all_reduce": predict_seconds, "reduce_scatter": predict_reduce_scatter_seconds}


def _usable_codecs(candidates, costs: Mapping[str, CodecCost], max_error: float) -> tuple[list[str], dict[str, str]]:
    """``none`` plus every candidate measured and within ``max_error``; the rest with the reason."""
    usable, excluded = ["none"], {}
    for codec in dict.fromkeys(candidates):
        if codec == "none":
            continue
        cost = costs.get(codec)
        if cost is None:
            excluded[codec] = "not measured"
        elif cost.rel_error > max_error:
            excluded[codec] = f"error {cost.rel_error:.3g} > max_error {max_error:g}"
        else:
            usable.append(codec)
    return usable, excluded


def choose_codec(
    numel: int,
    link: LinkEstimate,
    costs: Mapping[str, CodecCost],
    *,
    candidates: Sequence[str] = AUTO_CANDIDATES,
    block_size: int = 256,
    min_gain: float = 0.1,
    max_error: float = 0.1,
) -> Decision:
    """Pick the codec for a bucket of ``numel`` elements (pure; see the module docstring).

    ``none`` is always a candidate. A codec whose measured relative error exceeds ``max_error`` is
    excluded (the quality guard). The fastest remaining codec is chosen only when it is predicted
    at least ``min_gain`` (a fraction) faster than ``none``; otherwise ``none``.
    """
    if not 0 <= min_gain < 1:
        raise ConfigError(f"min_gain = {min_gain!r} must lie in [0, 1).")
    if not link.bus_bytes_per_s > 0:
        raise ConfigError(f"bus bandwidth {link.bus_bytes_per_s!r} must be > 0 (inf for a group of one).")
    usable, excluded = _usable_codecs(candidates, costs, max_error)
    predicted = {c: predict_seconds(c, numel, link, costs.get(c) if c != "none" else None, block_size)
                 for c in usable}
    best = min(predicted, key=lambda c: (predicted[c], c != "none"))
    if link.group_size <= 1:
        return Decision(numel, "none", predicted, "group of one: nothing crosses a link", excluded)
    if best == "none":
        return Decision(numel, "none", predicted, "none is predicted fastest", excluded)
    gain = 1 - predicted[best] / predicted["none"]
    if gain < min_gain:
        return Decision(numel, "none", predicted,
                        f"{best} predicted only {gain:.0%} faster than none (< min_gain {min_gain:.0%})", excluded)
    return Decision(numel, best, predicted, f"{best} predicted {gain:.0%} faster than none", excluded)


#: Routes predicted more than this many times slower than the best predicted one are not run.
TRIAL_FACTOR = 4.0


def predict_route_seconds(route: str, numel: int, links: Mapping[str, LinkEstimate],
                          costs: Mapping[str, CodecCost], block_size: int, per_node: int,
                          collective: str = "all_reduce") -> float:
    """Predicted time of ``route`` (``"flat <codec>"`` or ``"hier <codec>"``) for ``numel`` elements.

    ``links`` holds the ``"flat"`` (data-parallel group), ``"intra"`` (node group) and ``"rail"``
    link estimates; ``per_node`` is the number of ranks of a node in the data-parallel group;
    ``collective`` is ``all_reduce`` or ``reduce_scatter`` (:data:`COLLECTIVES`).
    """
    if collective not in COLLECTIVES:
        raise ConfigError(f"collective {collective!r}: allowed: {', '.join(COLLECTIVES)}.")
    one = COLLECTIVES[collective]
    layout, codec = route.split()
    cost = costs.get(codec)
    if layout == "flat":
        return one(codec, numel, links["flat"], cost, block_size)
    if layout != "hier":
        raise ConfigError(f"route {route!r}: the layout must be flat or hier.")
    if codec in FLAT_ONLY:
        raise ConfigError(f"route {route!r}: {codec} is a flat route only (the rail step needs a codec).")
    shard = -(-numel // per_node)
    return (one("none", numel, links["intra"], None, block_size)
            + one(codec, shard, links["rail"], cost, block_size))


def trial_routes(predicted: Mapping[str, float], factor: float = TRIAL_FACTOR) -> list[str]:
    """The routes worth measuring: within ``factor`` of the best prediction, plus the best exact
    (``none``) route. Sorted, so every rank runs them in the same order."""
    best = min(predicted.values())
    keep = {r for r, t in predicted.items() if t <= factor * best}
    exact = [r for r in predicted if r.endswith(" none")]
    if exact:
        keep.add(min(exact, key=lambda r: (predicted[r], r)))
    return sorted(keep)


def choose_route(
    numel: int,
    links: Mapping[str, LinkEstimate],
    costs: Mapping[str, CodecCost],
    *,
    per_node: int,
    hierarchical: bool = True,
    candidates: Sequence[str] = AUTO_CANDIDATES,
    block_size: int = 256,
    min_gain: float = 0.1,
    max_error: float = 0.1,
    measured: Mapping[str, float] | None = None,
    collective: str = "all_reduce",
) -> Decision:
    """Pick the route (layout and codec) for a bucket of ``numel`` elements (pure).

    Routes are ``flat <codec>`` and, with ``hierarchical``, ``hier <codec>`` for every candidate
    codec except :data:`FLAT_ONLY` ones, each passing the quality guard (``max_error``, as in
    :func:`choose_codec`). The times compared are ``measured`` (trial runs, for the routes that
    were run) when given, else the predictions of
    :func:`predict_route_seconds`. The fastest exact route (codec ``none``) wins unless a lossy
    route is at least ``min_gain`` faster than it; of the exact routes, ``hier none`` only where it
    is at least ``min_gain`` faster than ``flat none``. ``collective`` picks the time model
    (:data:`COLLECTIVES`); for ``reduce_scatter`` the :data:`FLAT_ONLY` candidates are excluded.
    """
    if not 0 <= min_gain < 1:
        raise ConfigError(f"min_gain = {min_gain!r} must lie in [0, 1).")
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ConfigError(f"per_node = {per_node!r} must be an int >= 1.")
    if collective not in COLLECTIVES:
        raise ConfigError(f"collective {collective!r}: allowed: {', '.join(COLLECTIVES)}.")
    codecs, excluded = _usable_codecs(candidates, costs, max_error)
    if collective == "reduce_scatter":
        excluded.update({c: "an all-reduce, not a reduce-scatter" for c in codecs if c in FLAT_ONLY})
        codecs = [c for c in codecs if c not in FLAT_ONLY]
    layouts = ("flat", "hier") if hierarchical else ("flat",)
    predicted = {f"{lay} {c}": predict_route_seconds(f"{lay} {c}", numel, links, costs, block_size, per_node,
                                                     collective)
                 for lay in layouts for c in codecs if lay == "flat" or c not in FLAT_ONLY}
    if measured:
        unknown = set(measured) - set(predicted)
        if unknown:
            raise ConfigError(f"measured routes {sorted(unknown)} are not candidates {sorted(predicted)}.")
        times, how = dict(measured), "measured"
    else:
        times, how = predicted, "predicted"
    best = min(times, key=lambda r: (times[r], not r.endswith(" none"), r))
    exact = [r for r in times if r.endswith(" none")]
    pick, reason = best, f"{best} {how} fastest"
    base = min(exact, key=lambda r: (times[r], r)) if exact else None
    if base == "hier none" and "flat none" in times:
        # The hierarchy's three collectives replace one only when clearly faster, as a lossy
        # route must be: within min_gain, the estimates' noise (a latency sample on shared
        # cores) would decide, and the two would swap between launches of one job.
        gain = 1 - times[base] / times["flat none"]
        if gain < min_gain:
            base = "flat none"
            if best == "hier none":
                pick = base
                reason = f"hier none {how} only {gain:.0%} faster than flat none (< min_gain {min_gain:.0%})"
    if not best.endswith(" none") and exact:
        gain = 1 - times[best] / times[base]
        if gain < min_gain:
            pick = base
            reason = f"{best} {how} only {gain:.0%} faster than {base} (< min_gain {min_gain:.0%})"
        else:
            reason = f"{best} {how} {gain:.0%} faster than {base}"
    layout, codec = pick.split()
    return Decision(numel, codec, predicted, reason, excluded, layout=layout,
                    measured_s=dict(measured or {}), collective=collective)


#: The routes a host's own single bucket can send (uncompressed, or DeepSpeed's bf16 scheme): what
#: :func:`step_gain` measures planned buckets against.
HOST_ROUTES = ("flat none", f"flat {BF16_ALLREDUCE}")


def step_gain(decisions: Sequence[Decision], host_routes: Sequence[str] = HOST_ROUTES) -> float:
    """The fraction of the time of the best uniform host wire that ``decisions`` (one per bucket of a
    step, routes chosen) save over the whole step (pure). A uniform host wire is one of
    ``host_routes`` used for every bucket: what the host's own single bucket would send (``flat
    none``: its fp32 all-reduce; ``flat bf16_allreduce``: its bf16 scheme, where that route was a
    candidate for every bucket). Each bucket counts its measured trial time where the route was run,
    else its prediction. 0 when every bucket chose the best uniform wire.

    A host that can reduce the whole step itself (DeepSpeed ZeRO 0's one bucket) hands the step
    back when this is below ``min_gain``: planned buckets cost collectives and book-keeping that no
    bucket's trial sees (BENCHMARKS.md), for a saving a single bucket could mostly have had too.
    """
    def seconds(d: Decision, route: str) -> float | None:
        return d.measured_s.get(route, d.predicted_s.get(route))

    bases = []
    for route in host_routes:
        times = [seconds(d, route) for d in decisions]
        if all(t is not None for t in times):
            bases.append(sum(times))
    if not bases:
        raise ConfigError(f"no decision of {len(decisions)} has a time for every bucket of any host route "
                          f"{list(host_routes)}.")
    base = min(bases)
    if base <= 0:
        return 0.0
    chosen = []
    for d in decisions:
        t = seconds(d, d.route)
        if t is None:
            raise ConfigError(f"decision for {d.numel} elements has no time for its own route {d.route!r}.")
        chosen.append(t)
    return 1 - sum(chosen) / base


def hand_back_reason(routes: Sequence[str | None], decisions: Sequence[Decision | None],
                     min_gain: float) -> str | None:
    """Why a host that can reduce a whole step in its own single bucket should do so instead of
    the step's planned buckets (pure), or None: keep the planned buckets. ``routes`` and
    ``decisions`` are those of the step's buckets, in order (``None`` where a bucket had no route
    plan). Hand back when every bucket went ``flat none``, or when the chosen routes save less than
    ``min_gain`` of the best uniform host wire's time over the step (:func:`step_gain`)."""
    if not routes:
        return None
    if set(routes) == {"flat none"}:
        return "chose the uncompressed flat all-reduce for all %d buckets" % len(routes)
    if None in decisions:
        return None
    gain = step_gain(decisions)
    if gain < min_gain:
        return (f"chose {', '.join(sorted(set(routes)))} for the {len(routes)} buckets, which save "
                f"{gain:.0%} of the time of one wire (fp32 or bf16) for all of them "
                f"(< min_gain {min_gain:.0%}), not worth planned buckets")
    return None


def choose_host_wire(fp32_s: Sequence[float], bf16_s: Sequence[float], rel_error: float, *,
                     min_gain: float, max_error: float) -> tuple[str, str]:
    """What a host's own single-bucket reduction should send once ``auto`` handed the step back
    (pure): ``("bf16", reason)`` when the bf16 all-reduce's median trial time is at least
    ``min_gain`` below fp32's and its relative error (against the fp32 sum) passes ``max_error``,
    else ``("fp32", reason)``. The bf16 wire is DeepSpeed's own ``communication_data_type: bf16``
    scheme, without error feedback: the error feedback of the ``bf16_allreduce`` route costs three
    passes over the bucket, which on a fast link is most of what bf16 saves (BENCHMARKS.md)."""
    if not fp32_s or len(fp32_s) != len(bf16_s):
        raise ConfigError(f"host wire trial: {len(fp32_s)} fp32 and {len(bf16_s)} bf16 samples; need as many "
                          f"of each, at least one.")
    f, b = statistics.median(fp32_s), statistics.median(bf16_s)
    gain = 1 - b / f if f > 0 else 0.0
    said = f"bf16 median {b * 1e3:.1f} ms vs fp32 {f * 1e3:.1f} ms ({gain:+.0%}), rel. error {rel_error:.1e}"
    if rel_error > max_error:
        return "fp32", f"{said}: bf16 fails the quality guard (max_error {max_error:g})"
    if gain < min_gain:
        return "fp32", f"{said}: less than min_gain {min_gain:.0%}"
    return "bf16", said

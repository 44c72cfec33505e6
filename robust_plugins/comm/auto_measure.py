"""The ``auto`` measurer: the facts its planner (:mod:`robust_plugins.comm.auto_model`) decides from.

Link probes (latency and bus bandwidth of a group), codec costs and errors on a sample of a real
bucket, timed trial runs of candidate routes, and the host-wire trial. Every function here that
takes a group is a collective on it and returns numbers agreed over it (the slowest rank's), so
every rank decides alike. Times come from :class:`~robust_plugins.timing.Clock` on the measured
tensor's device (CUDA events on a GPU, where the host returns at launch) after one untimed warm-up
per key where the device needs it (:data:`~robust_plugins.timing.WARMUP`: NCCL's lazy
communicator, Triton's JIT); every tensor a collective here moves is on the group's device
(:func:`~robust_plugins.device.collective_device`).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Mapping, Sequence

import torch

from robust_plugins.comm import _twophase
from robust_plugins.comm.auto_model import CodecCost, LinkEstimate
from robust_plugins.comm.collectives import bf16_all_reduce
from robust_plugins.config import BF16_ALLREDUCE
from robust_plugins.device import collective_device
from robust_plugins.timing import WARMUP, Clock


def timed_runs(tensor: torch.Tensor, names: Sequence[str], run: Callable[[str, torch.Tensor], Any], group,
               rounds: int = 1) -> dict[str, list[float]]:
    """Time ``run(name, copy)`` on a fresh copy of ``tensor`` for every name, ``rounds`` times,
    interleaved (a slow spell of the machine hits them all); each run starts at a barrier (a
    rank's wait for late peers is not the run's cost). A collective on ``group``: the times are
    agreed, the slowest rank's, so every rank decides alike. Returns each name's times, in order.

    Timed by :class:`~robust_plugins.timing.Clock` on the tensor's device (CUDA events around the
    run, whose collectives join the current stream, on a GPU), after one untimed run per group and
    name on a GPU (:data:`~robust_plugins.timing.WARMUP`): the first pays for NCCL's communicator
    and Triton's JIT."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    ranks = ranks_of(group)
    for name in names:
        WARMUP.ensure(("run", ranks, name), lambda: run(name, tensor.detach().clone()), tensor.device)
    out = []
    for _ in range(rounds):
        for name in names:
            copy = tensor.detach().clone()
            if distributed:
                dist.barrier(group=group)
            clock = Clock(copy.device).start()
            run(name, copy)
            out.append(clock.stop())
    agreed = _max_over_group(out, group)
    k = len(names)
    return {name: agreed[i::k] for i, name in enumerate(names)}


def ranks_of(group) -> tuple:
    """The group's global ranks (a warm-up key): ``("world",)`` for the default group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ("none",)
    return tuple(dist.get_process_group_ranks(group)) if group is not None else ("world",)


def _max_over_group(values: list[float], group) -> list[float]:
    """``values`` max-reduced over ``group`` (on the device its backend needs: CUDA for NCCL)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def measure_codec(codec: str, sample: torch.Tensor, group_size: int, block_size: int,
                  bf16_error_feedback: bool = False) -> CodecCost:
    """Time one rank's compute of a two-phase all-reduce of ``sample`` with ``codec``; and its error.

    Runs exactly what a rank computes in :func:`~robust_plugins.comm.compressed_all_reduce`
    (encode the bucket, decode-sum-requantize its own chunk from ``group_size`` rows, decode every
    chunk), with this rank's rows standing in for the others'. The error is that of one quantization
    round trip of ``sample`` (no error feedback), ``||decoded - sample|| / ||sample||``.

    ``bf16_allreduce`` (see :func:`measure_bf16_allreduce`) is timed and judged differently.
    """
    if codec == BF16_ALLREDUCE:
        return measure_bf16_allreduce(sample, group_size, error_feedback=bf16_error_feedback)
    flat = sample.detach().reshape(-1).float().contiguous()
    n = flat.numel()
    layout = _twophase.plan(n, group_size, codec, block_size)

    def compute():
        send = _twophase.encode(flat, layout, None)
        row = _twophase.reduce_chunk(send, layout, 0, None, 1.0)
        _twophase.decode(row.reshape(1, -1).expand(group_size, -1).contiguous(), layout)
        return send

    # On a GPU the first launch of each kernel compiles it (Triton's JIT): once per codec and device.
    WARMUP.ensure(("codec", codec, block_size, str(flat.device)), compute, flat.device)
    elapsed = math.inf
    for _ in range(2):  # the faster of two: the first pays for allocations the steady state reuses
        clock = Clock(flat.device).start()
        send = compute()
        elapsed = min(elapsed, clock.stop())
    roundtrip = _twophase.decode(send, layout)
    norm = float(flat.norm())
    err = float((roundtrip - flat).norm()) / norm if norm > 0 else 0.0
    return CodecCost(elapsed / max(n, 1), err)


#: At most this many elements of the sample go through the simulated bf16 sum of ``group_size``
#: ranks (its cost grows with the group; 4M element-additions take about 20 ms on one core).
_BF16_SUM_ELEMENTS = 1 << 22


def measure_bf16_allreduce(sample: torch.Tensor, group_size: int, error_feedback: bool = False) -> CodecCost:
    """Cost and error of :func:`~robust_plugins.comm.collectives.bf16_all_reduce` on ``sample``.

    The cost is this rank's compute outside the collective: the cast (with ``error_feedback``: add
    the residual, cast, keep the new residual) and the cast back; the bf16 additions happen inside
    the backend's all-reduce, whose time the link estimate holds. The error is the quality
    guard's worst case: ``group_size`` ranks whose gradients are rotations of ``sample`` (as
    unlike each other as the sample's own elements) summed in rank order with every partial sum
    rounded to bf16, as gloo's ring does, against their fp32 sum (no error feedback, which cannot
    reach the backend's roundings anyway).
    """
    flat = sample.detach().reshape(-1).float().contiguous()
    n = flat.numel()
    elapsed = math.inf
    for _ in range(2):  # the faster of two: the first pays for allocations
        residual = torch.zeros_like(flat) if error_feedback else None
        clock = Clock(flat.device).start()
        if residual is not None:
            residual.add_(flat)
            wire = residual.to(torch.bfloat16)
            residual.sub_(wire)
            residual.nan_to_num_(0.0, 0.0, 0.0)
        else:
            wire = flat.to(torch.bfloat16)
        flat.new_empty(n).copy_(wire)
        elapsed = min(elapsed, clock.stop())
    m = min(n, max(1 << 12, _BF16_SUM_ELEMENTS // max(group_size, 1)))
    x = flat[:m]
    exact = x.double().clone()
    acc = x.to(torch.bfloat16)
    for r in range(1, max(group_size, 1)):
        part = torch.roll(x, shifts=(r * 7919) % m)  # a prime stride: another rank's "gradient"
        exact += part.double()
        acc = (acc.float() + part.to(torch.bfloat16).float()).to(torch.bfloat16)
    norm = float(exact.norm())
    err = float((acc.double() - exact).norm()) / norm if norm > 0 else 0.0
    return CodecCost(elapsed / max(n, 1), err)


def measure_link(group, given_gbit: float | None, probe_bytes: int) -> tuple[float, float, int]:
    """(latency s, seconds per bus byte, size) of one all-reduce on ``group``, unagreed (see
    :func:`measure_links`)."""
    return measure_links({"link": group}, {"link": given_gbit}, probe_bytes)["link"]


#: Timed one-element all-reduces per link; the best counts.
LATENCY_ROUNDS = 5


def measure_links(groups: Mapping[str, Any], given_gbit: Mapping[str, float | None],
                  probe_bytes: int) -> dict[str, tuple[float, float, int]]:
    """(latency s, seconds per bus byte, size) of one all-reduce on each of ``groups`` (by kind;
    ``None`` is the default group), unagreed: the best of :data:`LATENCY_ROUNDS` one-element
    all-reduces, then one of ``probe_bytes`` (skipped where ``given_gbit`` gives the rate).

    The latency samples of the kinds are interleaved and each starts at a barrier of its group:
    auto compares routes built from these latencies (the flat all-reduce against the node and
    rail steps), so a slow spell on shared cores must hit every kind alike, not make one kind
    look slower and pick the wrong route.
    """
    import torch.distributed as dist

    out: dict[str, tuple[float, float, int]] = {}
    live = {}
    for kind, group in groups.items():
        w = dist.get_world_size(group)
        if w <= 1:
            out[kind] = (0.0, 0.0, w)
        else:
            live[kind] = (group, w, collective_device(group), ranks_of(group))
    # On the device the group's backend moves (CUDA on NCCL), timed by its clock (CUDA events
    # after the collective joined the current stream), after a warm-up of each size per group
    # on a GPU: NCCL builds its communicator at the first collective.
    tiny = {kind: torch.zeros(1, device=device) for kind, (_, _, device, _) in live.items()}
    for kind, (group, _, device, ranks) in live.items():
        WARMUP.ensure(("link tiny", ranks), lambda t=tiny[kind], g=group: dist.all_reduce(t, group=g), device)
    lat: dict[str, list[float]] = {kind: [] for kind in live}
    for _ in range(LATENCY_ROUNDS):
        for kind, (group, _, device, _) in live.items():
            dist.barrier(group=group)
            clock = Clock(device).start()
            dist.all_reduce(tiny[kind], group=group)
            lat[kind].append(clock.stop())
    for kind, (group, w, device, ranks) in live.items():
        latency = min(lat[kind])
        if given_gbit.get(kind) is not None:
            out[kind] = (latency, 8 / (given_gbit[kind] * 1e9), w)
            continue
        buf = torch.zeros(max(probe_bytes // 4, 1), device=device)
        WARMUP.ensure(("link buf", ranks, buf.numel()), lambda b=buf, g=group: dist.all_reduce(b, group=g), device)
        dist.barrier(group=group)
        clock = Clock(device).start()
        dist.all_reduce(buf, group=group)
        elapsed = max(clock.stop() - latency, 1e-9)
        out[kind] = (latency, elapsed / (2 * (w - 1) / w * buf.numel() * 4), w)
    return out


def probe(sample: torch.Tensor, group, *, codecs: Sequence[str], block_size: int,
          bf16_error_feedback: bool, link_gbit: float | None,
          probe_bytes: int) -> tuple[LinkEstimate, dict[str, CodecCost]]:
    """The link of ``group`` and the cost and error of each of ``codecs`` on ``sample``, agreed
    over ``group`` (a collective on it). ``link_gbit``, when given, is the bus rate (only the
    latency is measured)."""
    import torch.distributed as dist

    w = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    costs = {c: measure_codec(c, sample, w, block_size, bf16_error_feedback) for c in codecs if c != "none"}
    latency, seconds_per_byte = 0.0, 0.0
    if w > 1:
        latency, seconds_per_byte, _ = measure_link(group, link_gbit, probe_bytes)
    names = sorted(costs)
    agreed = _max_over_group(
        [latency, seconds_per_byte] + [costs[c].seconds_per_element for c in names]
        + [costs[c].rel_error for c in names], group)
    latency, seconds_per_byte = agreed[0], agreed[1]
    k = len(names)
    costs = {c: CodecCost(agreed[2 + i], agreed[2 + k + i]) for i, c in enumerate(names)}
    bandwidth = 1 / seconds_per_byte if seconds_per_byte > 0 else math.inf
    return LinkEstimate(bandwidth, latency, w), costs


def probe_routes(sample: torch.Tensor, group, intra, rail, *, codecs: Sequence[str], block_size: int,
                 bf16_error_feedback: bool, link_gbit: float | None,
                 probe_bytes: int) -> tuple[dict[str, LinkEstimate], dict[str, CodecCost]]:
    """The data-parallel (``flat``), node (``intra``) and ``rail`` links and each of ``codecs``'
    cost on ``sample``, agreed over ``group`` (a collective on ``group``; the node and rail probes
    run on all of their disjoint groups at once). ``intra`` and ``rail`` ``None``: no hierarchy (a
    node and a rail of one rank each). ``link_gbit``, when given, is the rate of the flat and rail
    links (both cross nodes); the node link is always measured."""
    import torch.distributed as dist

    w = dist.get_world_size(group)
    costs = {c: measure_codec(c, sample, w, block_size, bf16_error_feedback) for c in codecs if c != "none"}
    kinds = {"flat": group} | {k: g for k, g in (("intra", intra), ("rail", rail)) if g is not None}
    measured = measure_links(kinds, {"flat": link_gbit, "intra": None, "rail": link_gbit}, probe_bytes)
    for kind in ("intra", "rail"):
        measured.setdefault(kind, (0.0, 0.0, 1))
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


#: Trial routes measured within this factor of the fastest are run again, ``CLOSE_RERUNS`` times
#: (the median of their runs counts): one sample on shared cores can be off by 30 %, and only close
#: calls need a second look. Three samples (one plus two reruns) keep a lossy route from winning an
#: equal contest on one fast sample.
CLOSE_FACTOR = 1.25
CLOSE_RERUNS = 2


def rerun_routes(measured: Mapping[str, float], predicted: Mapping[str, float],
                 factor: float = CLOSE_FACTOR) -> list[str]:
    """The trial routes worth a second run (pure): those measured, or predicted, within ``factor``
    of the fastest measured one (sorted, so every rank runs them in the same order).

    A route the model predicted competitive but whose one sample came out far slower gets a second
    look: on shared cores one sample can be several times off, which alone would rule it out.
    """
    best = min(measured.values())
    return sorted(r for r, t in measured.items()
                  if min(t, predicted.get(r, math.inf)) <= factor * best)


def trial_times(tensor: torch.Tensor, routes: Sequence[str], run: Callable[[str, torch.Tensor], Any],
                group, predicted: Mapping[str, float]) -> dict[str, float]:
    """Each route's agreed time on a copy of ``tensor`` (``run(route, copy)`` reduces it, a
    collective on ``group``): one interleaved run each, then the median of ``1 + CLOSE_RERUNS``
    runs for the routes :func:`rerun_routes` names."""
    times = {r: t[0] for r, t in timed_runs(tensor, routes, run, group).items()}
    close = rerun_routes(times, predicted)
    if len(close) > 1:
        again = timed_runs(tensor, close, run, group, rounds=CLOSE_RERUNS)
        for r in close:
            times[r] = statistics.median([times[r], *again[r]])
    return times


#: Interleaved timed runs of each host wire (medians compared): enough that a wire within
#: ``min_gain`` of the other does not win on one launch's noise.
HOST_TRIALS = 7


def host_wire_times(tensor: torch.Tensor, group, rounds: int = HOST_TRIALS) -> dict[str, list[float]]:
    """Interleaved timed runs of the two wires a host's own single bucket can send on a copy of
    ``tensor`` (a collective on ``group``): ``fp32`` (the plain all-reduce) and ``bf16``
    (:func:`~robust_plugins.comm.collectives.bf16_all_reduce`, no error feedback); agreed times."""
    import torch.distributed as dist

    def run(wire: str, copy: torch.Tensor) -> None:
        if wire == "fp32":
            dist.all_reduce(copy, group=group)
        else:
            bf16_all_reduce(copy, group=group, op="sum")

    return timed_runs(tensor, ("fp32", "bf16"), run, group, rounds=rounds)

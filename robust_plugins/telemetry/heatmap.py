"""Rank-to-rank communication heat map: pairwise bandwidth and latency probes, outliers named.

The schedule is a pure planner (:func:`pair_rounds`): a round-robin tournament, so every pair of
ranks meets in exactly one round and each rank is in at most one pair a round; pairs of a round run
at the same time (W-1 rounds for an even world, W for an odd one). Inside a pair the lower rank
first measures latency (``LATENCY_ITERS`` ping-pongs of 4 bytes before the bandwidth runs and as many
after, fastest round trip / 2), then each side in turn sends ``nbytes`` and waits for a 4-byte
ack: bandwidth ``nbytes / time`` (best of ``BW_ITERS``; it includes one small-message latency,
which at 1 MiB is below 1 % of the time on any link slower than 100 Gbit/s). ``bw[a][b]`` is a -> b.

:func:`find_outliers` (pure) compares each link with the links of its class: links inside one
host with each other, links between hosts with each other (a loopback link is not a fair reference
for a network one). The reference is the class's upper quartile of bandwidth (lower quartile of
latency), so one fast link does not make all others look slow, and a minority of slow links does
not hide. A link below ``slow_factor`` x the reference bandwidth, or above ``latency_factor`` x the
reference latency, is an outlier; a host all of whose links to other hosts are outliers (when
some other cross-host link is fine) is named as the suspect.

Run on its own (on demand) under torchrun or the simulator::

    torchrun --nproc-per-node 4 -m robust_plugins.telemetry.heatmap --out runs/heatmap
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

# Minimum round trip and best bandwidth: on shared CPUs scheduling only ever adds time, so the
# fastest trial is the link's; a median kept 2 ms scheduling stalls on a 0.3 ms simulated link.
LATENCY_ITERS = 10
BW_ITERS = 4
#: A link is slow below this fraction of its class's upper-quartile bandwidth, or above this many
#: times its class's lower-quartile latency. Loose on purpose: 4 ranks sharing 2 busy CPU cores
#: measured loopback links between 255 and 3179 MB/s in one probe (best of 2), and a heat map that
#: names healthy links is worse than none. A 25x slower link (the simulator test) stands out.
SLOW_FACTOR = 0.2
LATENCY_FACTOR = 4.0


def pair_rounds(world: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs ``(a, b)`` with ``a < b`` covering every pair exactly once."""
    if world < 2:
        return []
    ranks: list[int | None] = list(range(world)) + ([None] if world % 2 else [])
    n = len(ranks)
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = ranks[i], ranks[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]  # circle method: rotate all but the first
    return rounds


def _class_reference(values: dict[tuple[int, int], float], hosts: Sequence[str], q: float) -> dict[bool, float]:
    """Per class (same host or not), the ``q`` quantile (0..1, linear interpolation) of the values."""
    groups: dict[bool, list[float]] = {}
    for (a, b), v in values.items():
        if v is not None and math.isfinite(v):
            groups.setdefault(hosts[a] == hosts[b], []).append(v)
    out = {}
    for same, vals in groups.items():
        vals.sort()
        pos = q * (len(vals) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(vals) - 1)
        out[same] = vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
    return out


def find_outliers(bw: Sequence[Sequence[float | None]], lat: Sequence[Sequence[float | None]],
                  hosts: Sequence[str], *, slow_factor: float = SLOW_FACTOR,
                  latency_factor: float = LATENCY_FACTOR) -> dict[str, Any]:
    """Slow links and suspect hosts from directed ``bw`` (bytes/s) and ``lat`` (s) matrices."""
    world = len(bw)
    links = {(a, b): bw[a][b] for a in range(world) for b in range(world) if a != b}
    lats = {(a, b): lat[a][b] for a in range(world) for b in range(world) if a != b}
    best_bw = _class_reference(links, hosts, 0.75)
    best_lat = _class_reference(lats, hosts, 0.25)
    slow = []
    for (a, b), v in sorted(links.items()):
        same = hosts[a] == hosts[b]
        reasons = []
        if v is not None and same in best_bw and v < slow_factor * best_bw[same]:
            reasons.append(f"bandwidth {v / 1e6:.1f} MB/s < {slow_factor:g} x {best_bw[same] / 1e6:.1f} MB/s "
                           f"(upper quartile of its class)")
        lv = lats[(a, b)]
        if lv is not None and same in best_lat and lv > latency_factor * best_lat[same]:
            reasons.append(f"latency {lv * 1e6:.0f} us > {latency_factor:g} x {best_lat[same] * 1e6:.0f} us "
                           f"(lower quartile of its class)")
        if reasons:
            slow.append({"src": a, "dst": b, "src_host": hosts[a], "dst_host": hosts[b],
                         "link": f"rank {a} ({hosts[a]}) -> rank {b} ({hosts[b]})", "why": "; ".join(reasons)})
    flagged = {(s["src"], s["dst"]) for s in slow}
    cross = [(a, b) for (a, b) in links if hosts[a] != hosts[b]]
    suspect_hosts = []
    if any(p not in flagged for p in cross):
        for h in sorted(set(hosts)):
            mine = [p for p in cross if h in (hosts[p[0]], hosts[p[1]])]
            if mine and all(p in flagged for p in mine):
                suspect_hosts.append(h)
    parts = [s["link"] for s in slow]
    summary = ("slow links: " + ", ".join(parts) if parts else "no slow links") + (
        "; suspect hosts: " + ", ".join(suspect_hosts) if suspect_hosts else "")
    return {"links": slow, "hosts": suspect_hosts, "summary": summary}


# ------------------------------------------------------------------------------------------------
# the probe (thin: torch.distributed send/recv in the planned schedule)
# ------------------------------------------------------------------------------------------------
def probe(nbytes: int = 1 << 20, group: Any = None, hosts: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure every pair (a collective: every rank of ``group`` calls it). Returns, on every
    rank, ``{"bw": [[...]], "lat": [[...]], "hosts": [...], "nbytes", "outliers", "summary"}``."""
    import torch
    import torch.distributed as dist

    from robust_plugins.device import collective_device, synchronize

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    # Point-to-point goes over the default group (group=None below), so its device; the host
    # timers wait for the device after each exchange (NCCL's send/recv return once queued).
    device = collective_device(None)
    big = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    small = torch.zeros(1, dtype=torch.float32, device=device)
    row_bw = [float("nan")] * world
    row_lat = [float("nan")] * world
    for pairs in pair_rounds(world):
        for a, b in pairs:
            if rank not in (a, b):
                continue
            me_first = rank == a
            peer = to_global(b if me_first else a)

            def ping(initiator: bool) -> float:
                t0 = time.perf_counter()
                if initiator:
                    dist.send(small, peer, group=None)
                    dist.recv(small, peer, group=None)
                else:
                    dist.recv(small, peer, group=None)
                    dist.send(small, peer, group=None)
                synchronize(device)
                return time.perf_counter() - t0

            ping(me_first)  # gloo connects a pair lazily: the first message pays for it
            rtts = [ping(me_first) for _ in range(LATENCY_ITERS)]
            for sender_is_me in (me_first, not me_first):
                best = math.inf
                for _ in range(BW_ITERS):
                    t0 = time.perf_counter()
                    if sender_is_me:
                        dist.send(big, peer)
                        dist.recv(small, peer)
                        synchronize(device)
                        best = min(best, time.perf_counter() - t0)
                    else:
                        dist.recv(big, peer)
                        dist.send(small, peer)
                        synchronize(device)
                if sender_is_me:
                    row_bw[b if me_first else a] = big.numel() * 4 / best
            # A second latency pass after the bandwidth runs: a scheduling stall of a few ms on
            # shared cores covers one pass's round trips, not both.
            rtts += [ping(me_first) for _ in range(LATENCY_ITERS)]
            row_lat[b if me_first else a] = min(rtts) / 2
    mine = torch.tensor([row_bw, row_lat], dtype=torch.float64, device=collective_device(group))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)

    def clean(x: float) -> float | None:
        return x if math.isfinite(x) else None

    bw = [[clean(v) for v in g[0].tolist()] for g in gathered]
    lat_raw = [[clean(v) for v in g[1].tolist()] for g in gathered]
    # Latency was measured once per pair (by the lower rank); mirror it.
    lat = [[lat_raw[min(a, b)][max(a, b)] if a != b else None for b in range(world)] for a in range(world)]
    hosts = list(hosts) if hosts is not None else [f"rank{r}" for r in range(world)]
    outliers = find_outliers(bw, lat, hosts)
    return {"bw": bw, "lat": lat, "hosts": hosts, "nbytes": big.numel() * 4, "outliers": outliers,
            "summary": outliers["summary"], "time": time.time()}


def hosts_of_ranks(group: Any = None) -> list[str]:
    """Host of every rank, from the topology discovery (a collective when it gathers hostnames)."""
    from robust_plugins.topology.discover import discover

    return [r.host for r in discover(group=group).records]


def render_png(result: dict[str, Any], path: str | Path) -> Path | None:
    """Draw the bandwidth heat map (MB/s, rank x rank) with latency in each cell. Returns None,
    with the reason logged, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        from robust_plugins._logging import get_logger, warn_once

        warn_once(get_logger(__name__), "heatmap:mpl",
                  "robust_plugins: matplotlib is not installed (%s); heat map PNG not drawn "
                  "(pip install matplotlib).", exc)
        return None
    bw, lat, hosts = result["bw"], result["lat"], result["hosts"]
    world = len(bw)
    data = [[(v / 1e6 if v is not None else float("nan")) for v in row] for row in bw]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * world, 0.9 + 0.8 * world), dpi=100)
    im = ax.imshow(data, cmap="viridis")
    fig.colorbar(im, ax=ax, label="MB/s (sender row -> receiver column)")
    labels = [f"{r}\n{hosts[r]}" for r in range(world)]
    ax.set_xticks(range(world), labels, fontsize=7)
    ax.set_yticks(range(world), labels, fontsize=7)
    flagged = {(s["src"], s["dst"]) for s in result["outliers"]["links"]}
    for a in range(world):
        for b in range(world):
            if a == b or bw[a][b] is None:
                continue
            text = f"{bw[a][b] / 1e6:.0f}\n{(lat[a][b] or 0) * 1e6:.0f}us"
            ax.text(b, a, text, ha="center", va="center", fontsize=7,
                    color="red" if (a, b) in flagged else "white", fontweight="bold" if (a, b) in flagged else None)
    ax.set_title(f"rank-to-rank bandwidth ({result['nbytes'] / 1e6:.1f} MB messages)", fontsize=9)
    ax.set_xlabel("receiver")
    ax.set_ylabel("sender")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write(result: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path | None]:
    """``heatmap.json`` and ``heatmap.png`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "heatmap.json"
    js.write_text(json.dumps(result, indent=1) + "\n")
    return js, render_png(result, out / "heatmap.png")


def main(argv: list[str] | None = None) -> int:
    """On-demand probe: every rank runs this; rank 0 writes the files and prints the summary."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(description="rank-to-rank bandwidth/latency heat map")
    p.add_argument("--out", required=True, help="directory for heatmap.json / heatmap.png")
    p.add_argument("--nbytes", type=int, default=1 << 20, help="bandwidth message size (default 1 MiB)")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    args = p.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        result = probe(args.nbytes, hosts=hosts_of_ranks())
        if dist.get_rank() == 0:
            js, png = write(result, args.out)
            print(json.dumps({"summary": result["summary"], "json": str(js), "png": str(png) if png else None}),
                  flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Pure detection logic: learned hang timeouts, stack parsing and grouping, hang localization.

Nothing here touches processes or sockets, so unit tests feed it made-up step times and stack
dumps at any scale.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from robust_plugins.config import WatchdogConfig

#: Step times a rank keeps for the p99 (the newest ones; old ones describe an older regime).
STEP_WINDOW = 512

#: Step intervals at the start of each incarnation left out of the learned hang timeout. The
#: first one carries one-off work (most likely the telemetry heat map's link probe): in the demo
#: it took 3.5 s against a 0.1 s median, once per incarnation, and four of them made the p99 and
#: so a 35 s hang timeout instead of the 10 s floor.
WARM_INTERVALS = 1


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (nearest rank) of a non-empty sequence."""
    if not values:
        raise ValueError("p99 of an empty sequence")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass
class RankProgress:
    """What the monitor knows about one rank's steps in the current incarnation."""

    last_step: int | None = None
    last_progress: float = 0.0
    """Monotonic time of the last step end (or of the incarnation's start before any step)."""
    steps_seen: int = 0
    step_times: list[float] = field(default_factory=list)

    def on_step(self, step: int, now: float) -> None:
        """Record a step end at monotonic time ``now``."""
        if self.last_step is not None and self.steps_seen > WARM_INTERVALS:
            self.step_times.append(now - self.last_progress)
            del self.step_times[:-STEP_WINDOW]
        self.last_step = step
        self.last_progress = now
        self.steps_seen += 1


def hang_timeout(cfg: WatchdogConfig, step_times: Iterable[float], steps_seen: int) -> float:
    """The current no-progress timeout: ``initial`` before warm-up, then k x p99 clamped."""
    times = list(step_times)
    if steps_seen < cfg.hang_warmup_steps or not times:
        return cfg.hang_initial_timeout_s
    learned = cfg.hang_factor * p99(times)
    return min(cfg.hang_max_timeout_s, max(cfg.hang_min_timeout_s, learned))


def learned_timeout(cfg: WatchdogConfig, ranks: Mapping[int, RankProgress],
                    history: Sequence[float] = ()) -> float:
    """The job's learned hang timeout: one timeout for the job, from step times pooled over every
    rank (ranks of a data-parallel job step in lockstep; the slowest healthy one sets the pace)
    and over earlier incarnations (``history``), so a restarted job needs no second warm-up."""
    pooled = list(history) + [t for p in ranks.values() for t in p.step_times]
    steps_per_rank = len(pooled) // max(1, len(ranks))
    return hang_timeout(cfg, pooled, steps_per_rank)


def stalled_ranks(cfg: WatchdogConfig, ranks: Mapping[int, RankProgress], now: float,
                  finished: Iterable[int] = (), history: Sequence[float] = (),
                  learned: float | None = None) -> tuple[list[int], float]:
    """Ranks without progress for longer than their timeout, and the learned timeout.

    A rank that has not completed a step in this incarnation gets ``hang_initial_timeout_s``
    (start-up: imports, rendezvous, loading a checkpoint). After its first step the job's
    :func:`learned_timeout` applies (``learned``, when the caller computed it already).
    """
    done = set(finished)
    if learned is None:
        learned = learned_timeout(cfg, ranks, history)
    stalled = []
    for r, p in sorted(ranks.items()):
        timeout = cfg.hang_initial_timeout_s if p.last_step is None else learned
        if r not in done and now - p.last_progress > timeout:
            stalled.append(r)
    return stalled, learned


def restart_delay(cfg: WatchdogConfig, restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (1 = the first): doubling, capped."""
    if restart < 1 or cfg.restart_backoff_s == 0:
        return 0.0
    return min(cfg.restart_backoff_max_s, cfg.restart_backoff_s * 2 ** min(restart - 1, 30))


class RunningMedian:
    """The last ``window`` values of one metric, to judge spikes against their median."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def spike(self, value: float | None, factor: float, warmup: int) -> float | None:
        """The median ``value`` exceeds ``factor`` times, or None; normal values join the window.

        A spike is kept out of the window so that it cannot raise the bar for the next one.
        """
        if value is None or not math.isfinite(value):
            return None
        if factor > 0 and len(self.values) >= warmup:
            median = statistics.median(self.values)
            if median > 0 and value > factor * median:
                return median
        self.values.append(value)
        return None


@dataclass
class Straggler:
    """A rank whose compute time per step stays above ``factor`` x its peers' median."""

    rank: int
    compute_s: float
    """The rank's median compute time over the window (step time minus collective time)."""
    peers_s: float
    """The median of the other ranks' window medians."""
    ratio: float


def stragglers(compute: Mapping[int, Sequence[float]], factor: float, window: int) -> list[Straggler]:
    """Ranks whose median compute time over their last ``window`` steps exceeds ``factor`` times
    the median of the other ranks' medians; ``[]`` until every rank has ``window`` values.

    Compute time, not step time: ranks of a data-parallel job wait for each other in every
    collective, so their step times are equal and only the time *outside* collectives tells the
    slow rank from those waiting for it. Medians (over steps, then over peers) keep one slow step
    (garbage collection, a checkpoint save) or one slow peer from deciding. Needs two ranks.
    """
    if factor <= 0 or len(compute) < 2:
        return []
    if any(len(v) < window for v in compute.values()):
        return []
    medians = {r: statistics.median(list(v)[-window:]) for r, v in compute.items()}
    out = []
    for r, mine in sorted(medians.items()):
        peers = statistics.median(m for q, m in medians.items() if q != r)
        if peers > 0 and mine > factor * peers:
            out.append(Straggler(r, mine, peers, mine / peers))
    return out


def is_bad_number(value: float | None) -> bool:
    """True for NaN and +-Inf; ``None`` (not reported) is fine."""
    return value is not None and not math.isfinite(value)


# ---------------------------------------------------------------------------------------------
# stacks
# ---------------------------------------------------------------------------------------------
Frame = tuple[str, str, int]
"""(function, file, line)."""

_PYSPY_THREAD = re.compile(r'^Thread (\S+) \(([^)]*)\)(?:: "(.*)")?\s*$')
_PYSPY_FRAME = re.compile(r"^\s+(.+?) \((.+):(\d+)\)\s*$")
_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FH_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+?)\s*$')


def parse_pyspy(text: str) -> list[Frame]:
    """The main thread's frames (innermost first) from ``py-spy dump`` output; [] if none."""
    threads: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        m = _PYSPY_THREAD.match(line)
        if m:
            threads.append((m.group(3) or "", []))
            continue
        m = _PYSPY_FRAME.match(line)
        if m and threads:
            threads[-1][1].append((m.group(1), m.group(2), int(m.group(3))))
    for name, frames in threads:
        if name == "MainThread":
            return frames
    return threads[0][1] if threads else []


def parse_faulthandler(text: str) -> list[Frame]:
    """The signalled thread's frames (innermost first) from the last faulthandler dump in ``text``.

    faulthandler writes ``Current thread`` for the thread that handled the signal, which for a
    process-directed SIGUSR1 is the main thread.
    """
    blocks: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        m = _FH_THREAD.match(line)
        if m:
            blocks.append((m.group(1) == "Current thread", []))
            continue
        m = _FH_FRAME.match(line)
        if m and blocks:
            blocks[-1][1].append((m.group(3), m.group(1), int(m.group(2))))
    # Several dumps may be appended to one file; the last "Current thread" block is the newest.
    current = [frames for is_current, frames in blocks if is_current]
    if current:
        return current[-1]
    return blocks[-1][1] if blocks else []


#: Frames that mean "waiting for peers": a rank inside one of these has entered a collective.
#: megatron-core's pipeline p2p waits on its isend/irecv handles inside ``p2p_communication.py``
#: (py-spy shows no torch frame there): a stage blocked on a stalled neighbour is a victim.
_COLLECTIVE_FILES = ("torch/distributed/", "deepspeed/comm/", "megatron/core/parallel_state",
                     "pipeline_parallel/p2p_communication.py")
_COLLECTIVE_FUNCS = frozenset({
    "all_reduce", "allreduce", "barrier", "broadcast", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce",
    "gather", "scatter", "send", "recv", "monitored_barrier",
})


def in_collective(frames: Sequence[Frame]) -> bool:
    """True when any frame is a torch.distributed / DeepSpeed comm call.

    What it cannot tell on NCCL (and why the flight recorder is asked first, see
    :func:`localize_by_sequence`): NCCL's host call returns at launch, so a healthy rank waiting
    for a peer is usually not inside a collective call but blocked where the host next waits for
    the device (``loss.item()``, ``torch.cuda.synchronize``, a handle's ``wait()``), a frame of
    the training script that looks like "stuck itself"; and a rank that never launched the
    collective may sit in the same frame. From stacks alone, on NCCL, "inside a collective" is
    seen only for host-blocking calls (``barrier``, object collectives, a gloo side group).
    """
    for func, path, _ in frames:
        p = path.replace("\\", "/")
        if any(part in p for part in _COLLECTIVE_FILES) or func in _COLLECTIVE_FUNCS:
            return True
    return False


#: Flight-recorder counters per process group (``pg_status`` of torch's
#: ``_dump_fr_trace_json``): collectives this rank issued (enqueued) and whose kernel began.
ENQUEUED, STARTED = "last_enqueued_collective", "last_started_collective"
COMPLETED = "last_completed_collective"


def localize_by_sequence(
        status: Mapping[int, Mapping[str, Mapping[str, Any]] | None]) -> Localization | None:
    """Name the ranks that cause a hang from every rank's flight-recorder sequence numbers (pure).

    ``status[rank]`` maps a process group id to its counters (``pg_status``); None: unreadable.
    Process groups are created in the same order on every rank (``new_group`` is collective over
    the world), so an id names the same group everywhere. On a group, the ranks that issued fewer
    collectives than its others never issued the one the others wait in; of those, the ones with
    no collective of their own unfinished on any group are stuck themselves and are the suspects
    (a rank behind on one group because it waits in another group's collective is a victim; when
    every lagging rank waits somewhere, all of them are named). Failing that, where every rank
    issued as many, ranks whose device has not *started* the latest one (``last_started`` below
    the others'; NCCL tracks it, -1 where not tracked) are stuck before it on their own device. None when the numbers agree (every rank entered every
    collective: the hang is inside one, e.g. a link or a peer's device) or nothing was readable;
    the caller then falls back to stacks (:func:`localize`).
    """
    known = {r: s for r, s in status.items() if s}
    unknown = sorted(r for r in status if not status[r])
    if not known:
        return None
    for key, what in ((ENQUEUED, "issued"), (STARTED, "started on the device")):
        lagging: dict[int, str] = {}
        for pg in sorted({pg for s in known.values() for pg in s}):
            seqs = {r: int(s[pg].get(key, -1)) for r, s in known.items() if pg in s}
            if key == STARTED and min(seqs.values()) < 0:
                continue  # not tracked on this group (gloo; NCCL without timing)
            top = max(seqs.values())
            ahead = sorted(q for q, m in seqs.items() if m == top)
            for r, n in seqs.items():
                if n < top and r not in lagging:
                    lagging[r] = f"{what} collective {n} of group {pg}, ranks {ahead} {top}"
        if lagging:
            waiting = {r for r, s in known.items()
                       if any(int(c.get(ENQUEUED, -1)) > int(c.get(COMPLETED, -1)) for c in s.values())}
            stuck = {r: why for r, why in lagging.items() if r not in waiting} or lagging
            reason = "flight recorder: " + "; ".join(f"rank {r} {why}" for r, why in sorted(stuck.items()))
            victims = sorted(set(lagging) - set(stuck))
            if victims:
                reason += f"; ranks {victims} lag too but wait in a collective they issued"
            return Localization(sorted(set(stuck) | set(unknown)), [], reason)
    return None


def signature(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    """What makes two stacks "identical": every frame's function, file and line."""
    return tuple(frames)


@dataclass
class Localization:
    """Where a hang is: the suspects, the stack groups and the reasoning."""

    suspects: list[int]
    groups: list[list[int]]
    """Ranks with identical stacks, largest group first."""
    reason: str


def localize(stacks: Mapping[int, Sequence[Frame] | None],
             last_steps: Mapping[int, int | None] | None = None) -> Localization:
    """Name the ranks that cause a hang from every rank's main-thread stack.

    1. Ranks inside a collective are waiting for someone; if some ranks are in a collective and
       others are not, the others never entered it: they are the suspects.
    2. Otherwise identical stacks are grouped and the ranks outside a unique largest group are
       suspects.
    3. With no unique largest group, ranks whose last reported step lags the others' are.
    4. Failing all that, every rank is a suspect (the reason says so).
    Ranks whose stack could not be read (``None`` or empty) are never cleared.
    """
    known = {r: list(f) for r, f in stacks.items() if f}
    unknown = sorted(r for r in stacks if not stacks[r])
    by_sig: dict[tuple[Frame, ...], list[int]] = {}
    for r in sorted(known):
        by_sig.setdefault(signature(known[r]), []).append(r)
    groups = sorted(by_sig.values(), key=lambda g: (-len(g), g[0]))
    if not known:
        return Localization(sorted(stacks), groups, "no stack could be read")
    waiting = sorted(r for r, f in known.items() if in_collective(f))
    outside = sorted(set(known) - set(waiting))
    if waiting and outside:
        return Localization(sorted(outside + unknown), groups,
                            f"ranks {waiting} wait in a collective that ranks {outside} never entered")
    if len(groups) > 1 and len(groups[0]) > len(groups[1]):
        suspects = sorted(r for g in groups[1:] for r in g)
        return Localization(sorted(suspects + unknown), groups,
                            f"stacks differ from the dominant group {groups[0]}")
    if last_steps:
        steps = {r: s for r, s in last_steps.items() if s is not None and r in stacks}
        if steps and len(set(steps.values())) > 1:
            lo = min(steps.values())
            lagging = sorted(r for r, s in steps.items() if s == lo)
            return Localization(sorted(set(lagging) | set(unknown)), groups,
                                f"no dominant stack group; ranks {lagging} lag at step {lo}")
    if unknown:
        return Localization(unknown, groups, "the other ranks' stacks agree; these could not be read")
    where = "a collective" if waiting else "the same place"
    return Localization(sorted(stacks), groups, f"every rank is stuck in {where}; no outlier")

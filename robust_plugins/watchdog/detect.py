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


#: Seconds between the watchdog's hang verdict and the process group's timeout, besides the stack
#: dump's bound: the monitor's poll (0.2-5 s), reading every rank's flight recorder (a few seconds
#: for 8 ranks of 2,000 entries) and NCCL's watchdog poll; 60 s covers them with room.
PG_TIMEOUT_MARGIN_S = 60.0

#: torch's default NCCL process-group timeout (10 min): what a script that passes none gets.
NCCL_DEFAULT_PG_TIMEOUT_S = 600.0


def pg_timeout_floor_s(cfg: WatchdogConfig) -> float:
    """The shortest process-group timeout under which a hang is judged (flight recorder, stacks)
    before the backend's timeout aborts every rank, which would be recorded as a SIGABRT crash:
    the longest hang timeout, the stack dump's bound and :data:`PG_TIMEOUT_MARGIN_S` (pure).
    The defaults keep it under :data:`NCCL_DEFAULT_PG_TIMEOUT_S`."""
    return (max(cfg.hang_initial_timeout_s, cfg.hang_max_timeout_s) + cfg.stack_dump_timeout_s
            + PG_TIMEOUT_MARGIN_S)


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


#: Flight-recorder counters per process group (``pg_status`` of torch's dump): collectives this
#: rank issued (enqueued), whose kernel began (NCCL with ``TORCH_NCCL_ENABLE_TIMING``; -1 where not
#: tracked) and that completed.
ENQUEUED, STARTED = "last_enqueued_collective", "last_started_collective"
COMPLETED = "last_completed_collective"


@dataclass
class GroupSeq:
    """One rank's progress on one process group, from its flight recorder (see :func:`group_view`)."""

    members: list[int]
    """Global ranks of the group (``pg_config``), [] where the dump did not say."""
    enqueued: int
    """Sequence number of the newest collective this rank issued on the group (0: none)."""
    completed: int
    """... of the newest one that completed on its device."""
    started: int = -1
    """... of the newest one whose kernel started (-1: not tracked)."""
    pending_p2p: list[tuple[str, int]] = field(default_factory=list)
    """Unfinished point-to-point operations: (``send``/``recv``, the peer's global rank)."""
    pending_unknown_p2p: bool = False
    """An unfinished point-to-point operation whose peer the record does not name (coalesced)."""

    @property
    def waiting(self) -> bool:
        """Whether this rank has work of its own unfinished on the group (it waits for peers)."""
        return self.enqueued > self.completed or bool(self.pending_p2p) or self.pending_unknown_p2p


def _ranks_of(text: Any) -> list[int]:
    # pg_config's "ranks" is a string such as "[0, 1, 2]" (a list in a pickled dump).
    if isinstance(text, (list, tuple)):
        return [int(r) for r in text]
    return [int(x) for x in re.findall(r"-?\d+", str(text or ""))]


def _p2p_peer(profiling_name: str) -> tuple[str, int] | None:
    """(``send``/``recv``, the peer's group rank) from ``nccl:send 0->1`` / ``nccl:recv 1<-0``."""
    name = str(profiling_name).split(":", 1)[-1].strip()
    m = re.fullmatch(r"send (\d+)->(\d+)", name)
    if m:
        return "send", int(m.group(2))
    m = re.fullmatch(r"recv (\d+)<-(\d+)", name)
    if m:
        return "recv", int(m.group(2))
    return None


def group_view(dumps: Mapping[str, Mapping[str, Any]]) -> dict[str, GroupSeq]:
    """One rank's progress per process group, from its flight-recorder dumps (pure).

    ``dumps`` maps a recorder's label (``"nccl"``, ``"gloo"``: a process group with both backends
    counts on each separately) to torch's JSON dump (``includecollectives=true``,
    ``onlyactive=false``). A group is named by its global name (``process_group[0]`` of its
    entries; ``new_group`` names groups alike on every rank), never by the dump's ``pg_id``, a
    per-process counter that differs between ranks outside the group's creation order. Its
    members come from ``pg_config`` (NCCL records them; gloo's recorder does not, torch 2.13:
    then ``members`` is [] and point-to-point peers cannot be named). Sequence
    numbers come from the entries, the newest record of each group in the ring: collectives by
    ``collective_seq_id``, point-to-point operations by their peer (``nccl:send 0->1``); a group
    with no entry left in the ring is left out (nothing comparable to say about it). A batch of
    point-to-point operations (``batch_isend_irecv``: NCCL records each op, sharing one
    ``p2p_seq_id``, without completion events of its own, then a ``nccl:coalesced`` entry that
    carries the batch's state) is read as one: its ops are done when that entry is.
    """
    out: dict[str, GroupSeq] = {}
    for label, dump in sorted(dumps.items()):
        if not isinstance(dump, Mapping):
            continue
        members = {str(name): _ranks_of(info.get("ranks")) for name, info in (dump.get("pg_config") or {}).items()
                   if isinstance(info, Mapping)}
        batches = _p2p_batches(dump.get("entries") or ())
        for e in dump.get("entries") or ():
            pg = e.get("process_group") or [e.get("pg_id"), ""]
            key = f"{label}:{pg[0]}"
            seq = out.get(key)
            if seq is None:
                seq = out[key] = GroupSeq(members=members.get(str(pg[0]), []), enqueued=0, completed=0)
            state = str(e.get("state", ""))
            # Done: its end event completed (NCCL), or retired (the backend saw the work finish;
            # gloo records no events, so its entries stay "scheduled" and only retire).
            done = state == "completed" or bool(e.get("retired"))
            if e.get("is_p2p"):
                batch = batches.get((pg[0], e.get("p2p_seq_id")))
                if batch is not None:
                    if _is_coalesced(e):
                        continue  # the batch's ops name the peers
                    done = done or batch
                if done:
                    continue
                peer = _p2p_peer(e.get("profiling_name", ""))
                if peer is None or not seq.members or peer[1] >= len(seq.members):
                    seq.pending_unknown_p2p = True
                else:
                    seq.pending_p2p.append((peer[0], seq.members[peer[1]]))
                continue
            n = int(e.get("collective_seq_id", 0))
            seq.enqueued = max(seq.enqueued, n)
            if state == "started" or done:
                seq.started = max(seq.started, n)
            if done:
                seq.completed = max(seq.completed, n)
    return out


def _is_coalesced(entry: Mapping[str, Any]) -> bool:
    return str(entry.get("profiling_name", "")).endswith(":coalesced")


def _p2p_batches(entries) -> dict[tuple[Any, Any], bool]:
    """{(group name, p2p_seq_id): done} of each batch of point-to-point ops in ``entries`` whose
    ``coalesced`` entry and at least one op are in the ring (done: that entry completed or retired)."""
    ends, ops = {}, set()
    for e in entries:
        if not e.get("is_p2p"):
            continue
        key = ((e.get("process_group") or [e.get("pg_id")])[0], e.get("p2p_seq_id"))
        if _is_coalesced(e):
            ends[key] = str(e.get("state", "")) == "completed" or bool(e.get("retired"))
        else:
            ops.add(key)
    return {k: v for k, v in ends.items() if k in ops}


def localize_by_sequence(views: Mapping[int, Mapping[str, GroupSeq] | None]) -> Localization | None:
    """Name the ranks that cause a hang from every rank's flight recorder (pure).

    ``views[rank]`` is :func:`group_view` of that rank's dumps (None: unreadable); the ranks may
    come from several nodes (the agents exchange their views, :mod:`.nodes`). What is true on
    NCCL, where a healthy rank waiting for a peer sits in ``.item()`` or a ``synchronize`` and its
    stack says nothing:

    1. On a group, the members that issued fewer collectives than its others never issued the one
       the others wait in (the lowest sequence numbers name them).
    2. A rank with an unfinished send or recv whose peer has no matching operation posted waits for
       that peer (pipeline stages): the peer did not enter.
    3. Of the ranks so named, those with no work of their own unfinished on any group are stuck
       outside every collective (``stuck``): the evidence against them. A named rank that waits in
       another group's collective is a victim; when every named rank waits somewhere (a cycle: the
       collectives were issued in different orders), all are suspects and none is ``stuck``.
    4. Where every rank issued as many, ranks whose device did not *start* the latest one
       (``started`` tracked) are stuck before it on their own device.

    Returns None when the numbers agree (every rank entered every collective: the hang is inside
    one, a link or a device) or nothing was readable; ranks whose view is None are never cleared
    (suspects, never ``stuck``).
    """
    known = {r: v for r, v in views.items() if v}
    unknown = sorted(r for r in views if not views[r])
    if not known:
        return None
    waiting = {r for r, v in known.items() if any(g.waiting for g in v.values())}
    for what in ("issued", "started on the device"):
        lagging: dict[int, str] = {}
        for key in sorted({k for v in known.values() for k in v}):
            seqs = {r: (v[key].enqueued if what == "issued" else v[key].started)
                    for r, v in known.items() if key in v}
            if len(seqs) < 2 or (what != "issued" and min(seqs.values()) < 0):
                continue  # one rank read, or not tracked on this group (gloo; NCCL without timing)
            top = max(seqs.values())
            ahead = sorted(q for q, m in seqs.items() if m == top)
            for r, n in sorted(seqs.items()):
                if n < top and r not in lagging:
                    lagging[r] = f"{what} collective {n} of group {key}, ranks {ahead} {top}"
        if what == "issued":
            for r, v in sorted(known.items()):
                for key, g in sorted(v.items()):
                    for op, peer in g.pending_p2p:
                        mate = "recv" if op == "send" else "send"
                        pv = known.get(peer)
                        if pv is None or peer in lagging:
                            continue
                        peer_g = pv.get(key)
                        if peer_g is not None and peer_g.pending_unknown_p2p:
                            continue  # a batch whose peers the record does not name: may match
                        if peer_g is None or (mate, r) not in peer_g.pending_p2p:
                            lagging[peer] = f"posted no {mate} for rank {r}'s pending {op} on group {key}"
        if lagging:
            stuck = {r: why for r, why in lagging.items() if r not in waiting}
            named = stuck or lagging
            reason = "flight recorder: " + "; ".join(f"rank {r} {why}" for r, why in sorted(named.items()))
            victims = sorted(set(lagging) - set(named))
            if victims:
                reason += f"; ranks {victims} lag too but wait in work of their own"
            if not stuck:
                reason += "; every rank named waits in work of its own (collectives issued in different orders?)"
            return Localization(sorted(set(named) | set(unknown)), [], reason, by="flight_recorder",
                                stuck=sorted(stuck))
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
    by: str = "stacks"
    """The evidence: ``flight_recorder`` (sequence numbers, true on every backend) or ``stacks``."""
    stuck: list[int] = field(default_factory=list)
    """Suspects the flight recorder shows stuck outside every collective (the evidence that blames
    a node); [] for a verdict from stacks."""


def collectives_block_host(device_types: Iterable[str | None]) -> bool | None:
    """Whether the ranks' collectives block their host until done (pure): True when every rank's
    default group moves CPU tensors (gloo), False when one moves device tensors (NCCL: the host
    call returns at launch), None when a rank did not say (no step yet)."""
    kinds = list(device_types)
    if not kinds or any(k is None for k in kinds):
        return None
    return all(k == "cpu" for k in kinds)


def hang_verdict(where: Localization | None, block_host: bool | None, why: str | None = None) -> dict[str, Any]:
    """What a hang's evidence supports (pure; ``faults.jsonl``'s ``detail.verdict``).

    ``by``: ``flight_recorder``, ``stacks`` or ``none``; ``stuck``: ranks the evidence shows stuck
    outside every collective; ``blame``: whether the evidence may count against a node
    (:func:`~robust_plugins.launcher.nodes.blame_reason` then checks which node's ranks):

    - flight recorder: when it names stuck ranks (a cycle of waiting ranks names none);
    - stacks: only where collectives block the host (gloo), so that "inside a collective call"
      means "waiting for a peer"; on NCCL a waiting rank sits in ``.item()`` or a
      ``synchronize`` and its stack looks like a stuck one's: no blame;
    - nothing that names a rank (``where`` None, every stack alike): no blame, said in ``why``.
    """
    if where is None:
        return {"by": "none", "blame": False, "stuck": [],
                "why": why or "no evidence names a rank: no node is blamed"}
    if where.by == "flight_recorder":
        if where.stuck:
            return {"by": where.by, "blame": True, "stuck": list(where.stuck),
                    "why": f"the flight recorder shows ranks {where.stuck} stuck outside every collective"}
        return {"by": where.by, "blame": False, "stuck": [],
                "why": "every rank the flight recorder names waits in work of its own: no node is blamed"}
    if block_host:
        return {"by": "stacks", "blame": True, "stuck": [],
                "why": "collectives block the host (gloo): a rank inside one waits for a peer"}
    return {"by": "stacks", "blame": False, "stuck": [],
            "why": ("no flight recorder could be read, and stacks cannot tell a rank waiting for a peer "
                    "from a stuck one where collectives return at launch (NCCL): no node is blamed"
                    if block_host is False else
                    "no flight recorder could be read and the ranks' backend is unknown: no node is blamed")}


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

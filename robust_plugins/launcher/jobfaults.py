"""The job-wide fault view of a multi-node ``robust run`` job: each fault once, on the node that caused it.

Each node's monitor sees only its own ranks and writes what it saw to its own ``faults.jsonl``
(rollback bounds and blame counts depend on exactly that). One fault is seen by several nodes:
when a rank of node 1 is killed, the ranks of node 0 fail in their next collective ("connection
closed by peer", exit 1) and node 0 records a crash of its own ranks; when a rank of node 1 hangs,
node 0's ranks wait for it inside a collective and node 0 may record a hang of its ranks
(``in_collective: true``). Listing every node's lines would count one fault two or three times.

This module is the pure part: given every node's records of one rendezvous round, which records
are faults and which are side effects of them (:func:`merge_round`), and when a round's records
are complete (:class:`ViewBook`). The rule for "caused it" is the node-blame rule of
:mod:`.nodes`, applied to each record with the ranks of the node that wrote it:

- a record with evidence against its node (an injected crash or a death by a foreign signal, an
  SDC minority on its ranks, a hang of its ranks outside any collective): ``source: "evidence"``;
- NaN, spike and straggler records name the ranks that reported the bad number themselves:
  ``source: "ranks"`` (the same NaN at the same step seen on two nodes is one fault, its ranks
  the union);
- every other record of the round (a plain non-zero exit, the agent's SIGTERM, a hang inside a
  collective, an SDC verdict about another node's ranks) is an *echo*: folded into the round's
  first fault (``echoes``), or, when no node has evidence, the first one detected stands for the
  fault (``source: "first"``) and the rest are its echoes.

The transport (the rendezvous store) is :mod:`.jobfaults_sync`; the file format is in ``watchdog/FORMAT.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from robust_plugins.launcher.nodes import blame_reason

#: Kinds whose suspects reported the bad number themselves (their own loss, norm, step time).
_REPORTED = ("nan", "spike", "straggler")

#: Keys a job record adds to a ``faults.jsonl`` line (``watchdog/FORMAT.md``).
VIEW_KEYS = ("node", "round", "source", "echoes", "silent_nodes")


def _evidence(rec: dict[str, Any]) -> str | None:
    mine = set(rec.get("suspect_ranks") or []) & set(rec.get("node_ranks") or [])
    return blame_reason(rec.get("kind", ""), rec.get("step"), mine, rec.get("detail") or {})


def _source(rec: dict[str, Any]) -> str | None:
    """``"evidence"`` or ``"ranks"`` for a record that is a fault itself, None for a possible echo."""
    if _evidence(rec) is not None:
        return "evidence"
    if rec.get("kind") in _REPORTED and set(rec.get("suspect_ranks") or []) <= set(rec.get("node_ranks") or []):
        return "ranks"
    return None


def _same_fault_key(rec: dict[str, Any]) -> tuple:
    # A NaN of the global gradient norm is reported by every rank: one fault whatever the ranks.
    if rec.get("kind") in ("nan", "spike"):
        return rec.get("kind"), rec.get("step"), rec.get("action")
    return rec.get("kind"), rec.get("step"), rec.get("action"), tuple(sorted(rec.get("suspect_ranks") or []))


def _echo(rec: dict[str, Any], why: str) -> dict[str, Any]:
    return {"node": rec.get("node"), "kind": rec.get("kind"), "step": rec.get("step"),
            "suspect_ranks": rec.get("suspect_ranks"), "why": why}


def _job_record(rec: dict[str, Any], source: str, silent: list[str]) -> dict[str, Any]:
    out = {k: v for k, v in rec.items() if k != "node_ranks"}
    out.update(source=source, echoes=[], silent_nodes=list(silent))
    return out


def merge_round(records: list[dict[str, Any]], silent: list[str] = ()) -> list[dict[str, Any]]:
    """The job's faults of one rendezvous round from every node's records of it.

    Each input is a ``faults.jsonl`` line plus ``node`` (the node that wrote it), ``round`` and
    ``node_ranks`` (that node's global ranks in the round). ``silent``: nodes of the round that
    sent nothing for it (lost, or still running when the view had to be written). Returns the job
    records in order of detection time, each with ``source``, ``echoes`` and ``silent_nodes``.
    """
    ordered = sorted(records, key=lambda r: (str(r.get("time", "")), str(r.get("node", ""))))
    faults: list[dict[str, Any]] = []
    by_key: dict[tuple, dict[str, Any]] = {}
    echoes: list[dict[str, Any]] = []
    for rec in ordered:
        source = _source(rec)
        if source is None:
            echoes.append(rec)
            continue
        key = _same_fault_key(rec)
        if key in by_key:
            kept = by_key[key]
            kept["suspect_ranks"] = sorted({*kept["suspect_ranks"], *rec.get("suspect_ranks", [])})
            kept["suspect_hosts"] = sorted({*kept["suspect_hosts"], *rec.get("suspect_hosts", [])})
            kept["echoes"].append(_echo(rec, f"the same {rec.get('kind')} seen by node {rec.get('node')}"))
            continue
        by_key[key] = _job_record(rec, source, silent)
        faults.append(by_key[key])
    stopping = [f for f in faults if f.get("kind") != "straggler"]
    if not stopping and echoes:
        # No node has evidence (a plain exception, a lost node, a deadlock): the first detection
        # stands for the fault, said by its source; the others were the same event seen elsewhere.
        first, echoes = echoes[0], echoes[1:]
        stopping = [_job_record(first, "first", silent)]
        faults.append(stopping[0])
    for rec in echoes:
        stopping[0]["echoes"].append(_echo(rec, (
            f"a side effect on node {rec.get('node')}: no evidence against it (nodes.py), and the "
            f"{stopping[0]['kind']} of rank(s) {stopping[0]['suspect_ranks']} stopped the job")))
    return sorted(faults, key=lambda f: str(f.get("time", "")))


@dataclass
class _Round:
    nodes: int = 0
    """Nodes in the round (from the rendezvous), 0 until a node said."""
    joined: set[str] = field(default_factory=set)
    closed: set[str] = field(default_factory=set)
    records: list[dict[str, Any]] = field(default_factory=list)
    first_closed: float | None = None


class ViewBook:
    """The view's bookkeeping, fed the store's messages in order (no I/O).

    Messages (one JSON object each, see :mod:`.jobfaults_sync`): ``join`` (``round``, ``node``,
    ``nodes``: the round's node count), ``fault`` (``round``, ``node``, ``record``: a
    ``faults.jsonl`` line plus ``node_ranks``), ``closed`` (``round``, ``node``: every record of
    that node for that round was sent). A round is written once every node of it closed it, or
    ``settle_s`` after the first node did (a lost node never closes), in round order.
    """

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self.rounds: dict[int, _Round] = {}
        self.written: set[int] = set()
        self.late: list[dict[str, Any]] = []
        self.members: dict[int, set[str]] = {}
        """Nodes that joined each round (kept after the round is written)."""

    def ingest(self, msg: dict[str, Any], now: float) -> None:
        """One message from the store, at monotonic time ``now``."""
        rnd = int(msg["round"])
        if rnd in self.written:
            if msg.get("type") == "fault":  # a node that was silent past settle_s spoke after all
                self.late.append({**msg["record"], "node": msg["node"], "round": rnd})
            return
        r = self.rounds.setdefault(rnd, _Round())
        node = str(msg["node"])
        if msg["type"] == "join":
            r.joined.add(node)
            self.members.setdefault(rnd, set()).add(node)
            r.nodes = max(r.nodes, int(msg.get("nodes") or 0))
        elif msg["type"] == "fault":
            r.records.append({**msg["record"], "node": node, "round": rnd})
        elif msg["type"] == "closed":
            r.closed.add(node)
            if r.first_closed is None:
                r.first_closed = now

    def complete(self, rnd: int) -> bool:
        """Every node of round ``rnd`` closed it."""
        r = self.rounds[rnd]
        return len(r.joined) >= r.nodes and r.joined <= r.closed

    def settle(self, now: float, final: bool = False) -> list[dict[str, Any]]:
        """Job records of the rounds that can be written now (``final``: every round), in order."""
        # A node silent past settle_s sent its records after the round was written: they go out
        # as they are, marked, and may repeat a fault above (FORMAT.md).
        out = [_job_record(rec, "late", []) for rec in self.late]
        self.late = []
        for rnd in sorted(self.rounds):
            r = self.rounds[rnd]
            timed_out = r.first_closed is not None and now - r.first_closed >= self.settle_s
            if not (final or timed_out or self.complete(rnd)):
                break  # in round order: a later round waits for this one
            silent = sorted(r.joined - r.closed) + (["?"] * max(0, r.nodes - len(r.joined)))
            out.extend(merge_round(r.records, silent))
            del self.rounds[rnd]
            self.written.add(rnd)
        return out

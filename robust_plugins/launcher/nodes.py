"""Nodes of a multi-node ``robust run`` job: which node a fault blames, blame counts, exclusion.

Where the counts live, and why: in the **rendezvous store** (the c10d TCPStore every agent of the
job already connects to for ``--rdzv-backend c10d``), under job-wide keys outside the per-round
prefixes. Every agent reaches it with no shared filesystem, ``add`` is atomic, so two agents that
blame at the same moment cannot lose a count, and it lives exactly as long as the job's rendezvous.
A node's run directory is private to it (its ``monitor.sock``, its ``faults.jsonl``), so counts kept
there would not be seen by the other nodes; the store is the one place they all read. Each agent
also writes ``excluded_nodes.json`` into its own run directory (for the scheduler, and so a
relaunch of that node with the same ``--run-dir`` is refused even with a new rendezvous). The
store dies with the agent that hosts it: the node hosting the c10d endpoint cannot be excluded
without ending the job (as with torchrun's c10d rendezvous).

Which node a fault blames, and why so narrowly: when one rank of a multi-node gloo (or NCCL) job
dies, its peers on the *other* nodes fail too, usually with exit code 1 ("connection closed by
peer"), and their agents each see a crash. Only evidence that points at the local node counts:

- a crash whose first cause is an announced injected fault or death by a signal other than the
  agent's own SIGTERM (SIGKILL by the OOM killer, SIGSEGV, SIGBUS...). SIGABRT counts only when
  it is the first death and the rank's log (torch's ``stderr.log``, written with ``--redirects`` /
  ``--tee``) is readable and shows no NCCL collective failure: under
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (torch's agent sets it) NCCL's watchdog aborts every rank
  whose collective failed because a peer died or timed out, so a SIGABRT after a peer's death,
  one whose log names NCCL's failure, or one with no log to read is no evidence
  (:func:`death_causes`);
- a silent-data-corruption verdict whose minority ranks run on this node (every replica computes
  the same verdict from the all-gathered hashes);
- a hang whose suspects on this node the flight recorder shows stuck outside every collective:
  every peer of theirs issued the collective (or posted the send/recv) they never did, and they
  wait in no work of their own (``detail.verdict``,
  :func:`~robust_plugins.watchdog.detect.hang_verdict`). The agents of a multi-node job exchange
  their ranks' flight-recorder views through the store first (:func:`exchange_hang_views`), so a
  group is judged over all its members, not one node's. On
  NCCL a rank waiting for a peer sits in ``.item()`` or a ``synchronize``, outside any collective
  call, so stacks are no evidence there; where collectives block the host (gloo) they are: a
  suspect stuck outside any collective while its peers wait inside one. A suspect whose stack
  shows its interpreter exiting (no frame of the program left, only an exception hook, atexit or
  finalizers: ``exiting_ranks``) was failing when its stack was read, not stuck: when two nodes'
  hang timeouts run out together and the node of the stuck rank restarts first, the other node
  reads the stacks of ranks that are just dying of the lost peer.

A plain non-zero exit code, a hang whose evidence names no stuck rank (``verdict.blame`` false:
every rank entered every collective, waiting ranks in a cycle, NCCL without a readable flight
recorder), NaN and spikes (data, not hardware) blame no node. So a real Python exception on a
faulty node is not counted: an honest gap, preferred to evicting healthy nodes whose ranks
merely lost a peer.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from robust_plugins._logging import get_logger
from robust_plugins.errors import RobustPluginsError
from robust_plugins.watchdog.detect import parse_faulthandler, parse_pyspy

log = get_logger(__name__)

#: Exit status of a ``robust run`` agent whose node is excluded from the job.
EXIT_EXCLUDED = 3

#: Written into every agent's run directory when a node is excluded (format in ``watchdog/FORMAT.md``).
EXCLUDED_FILE = "excluded_nodes.json"

#: Rendezvous-store keys shared by every agent of the job (not per round).
_BLAMES = "robust_run/node_blames/{node}"
_EXCLUDED = "robust_run/excluded_node/{node}"
_EXCLUDED_COUNT = "robust_run/excluded_count"
_EXCLUDED_ENTRY = "robust_run/excluded/{index}"

#: Signals an agent (or torch's elastic agent) sends to ranks itself: no evidence against a node.
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")

#: Frames at the bottom of a main thread that still runs the program (a script, ``-m`` module, or
#: a standby running either); a stack with none of them belongs to an interpreter that is exiting.
_PROGRAM_FRAMES = ("<module>", "_run_module_as_main", "_run_code")


#: What torch's ProcessGroupNCCL and NCCL print when a collective failed because of a peer (its
#: death, a network error) or timed out: a rank that printed one was aborted by NCCL's watchdog.
NCCL_COLLECTIVE_FAILURE = re.compile(
    r"Watchdog caught collective operation timeout|watchdog thread terminated with exception|"
    r"ncclRemoteError|ncclSystemError|remote process exited|NCCL communicator was aborted|"
    r"NCCL error|ProcessGroupNCCL.{0,80}(?:timed out|aborted|abort)", re.IGNORECASE)

#: Causes of a rank's death, first cause first (:func:`death_causes`); the last three are no
#: evidence against the rank's node.
CAUSES = ("injected", "failed", "aborted", "peer_loss", "aborted_unexplained", "stopped")
NOT_EVIDENCE = frozenset({"peer_loss", "aborted_unexplained", "stopped"})


@dataclasses.dataclass(frozen=True)
class Death:
    """One rank's exit as a launcher sees it."""

    rank: int
    exitcode: int | None
    """Negative: killed by that signal (``-6`` SIGABRT)."""
    t: float
    """When it died (seconds, one clock for every rank; equal times are one poll's deaths)."""
    injected: bool = False
    """An announced injected fault."""
    log: str | None = None
    """The tail of the rank's stderr, or None when it was not written to a file."""


def death_causes(deaths: list[Death]) -> dict[int, str]:
    """The cause of each death (one of :data:`CAUSES`), decided from the order of deaths and the
    ranks' logs, never from SIGABRT alone (pure).

    ``injected``: announced. ``stopped``: the agent's SIGTERM/SIGINT/SIGHUP. ``failed``: any other
    non-zero exit or signal. A SIGABRT is ``peer_loss`` when another rank's ``injected`` or
    ``failed`` death came at the same time or earlier, or its log shows NCCL's collective
    failure (:data:`NCCL_COLLECTIVE_FAILURE`: it was aborted because a peer died or hung, maybe
    on another node); otherwise ``aborted`` when its log was read and is clean (the rank aborted
    on its own), ``aborted_unexplained`` when there is no log to read.
    """
    abort = -int(signal.SIGABRT)
    agent = {-int(getattr(signal, name)) for name in _AGENT_SIGNALS}
    causes: dict[int, str] = {}
    for d in deaths:
        if d.injected:
            causes[d.rank] = "injected"
        elif d.exitcode in agent:
            causes[d.rank] = "stopped"
        elif d.exitcode != abort:
            causes[d.rank] = "failed"
    first_own = min((d.t for d in deaths if causes.get(d.rank) in ("injected", "failed")), default=None)
    for d in deaths:
        if d.rank in causes:
            continue
        if (first_own is not None and first_own <= d.t) or (d.log and NCCL_COLLECTIVE_FAILURE.search(d.log)):
            causes[d.rank] = "peer_loss"
        else:
            causes[d.rank] = "aborted" if d.log is not None else "aborted_unexplained"
    return causes


def first_causes(deaths: list[Death]) -> tuple[list[int], dict[int, str]]:
    """Ranks ordered first cause first (by :data:`CAUSES`, then time, then rank) and each one's
    cause (pure): the fault's suspects are the leading ranks that share the first's cause."""
    causes = death_causes(deaths)
    order = sorted(deaths, key=lambda d: (CAUSES.index(causes[d.rank]), d.t, d.rank))
    return [d.rank for d in order], causes


class NodeExcluded(RobustPluginsError):
    """This node was blamed too often: its agent must not join the job again."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        super().__init__(
            f"node {record['node']} is excluded from this job: blamed for {record['blames']} faults "
            f"(last: {record.get('reason', '?')}). Replace or repair it; it will be refused at every "
            f"rendezvous of this job (exit code {EXIT_EXCLUDED})."
        )


def node_blame(fault: Any, local_ranks: set[int]) -> str | None:
    """Why ``fault`` (a :class:`~robust_plugins.watchdog.faults.Fault` seen by this node's monitor)
    is evidence against this node, or None when it is not (see the module docstring)."""
    suspects = set(fault.suspect_ranks) & set(local_ranks)
    return blame_reason(fault.kind, fault.step, suspects, fault.detail or {})


def blame_reason(kind: str, step: int | None, suspects: set[int], detail: dict[str, Any]) -> str | None:
    """The evidence rule of :func:`node_blame` on a fault's fields (a ``faults.jsonl`` line works
    too): ``suspects`` are the fault's suspect ranks that run on the node judged."""
    if not suspects:
        return None
    if kind == "crash":
        sig = detail.get("signal")
        if detail.get("onset") == "injected":
            return f"injected crash of rank(s) {sorted(suspects)} at step {step}"
        if detail.get("cause") in NOT_EVIDENCE:
            return None  # aborted by NCCL after a peer's death or hang, or nothing says otherwise
        if sig and f"SIG{str(sig).removeprefix('SIG')}" == "SIGABRT" and detail.get("cause") != "aborted":
            return None  # a record judged on the signal alone: SIGABRT is no evidence by itself
        if sig and f"SIG{str(sig).removeprefix('SIG')}" not in _AGENT_SIGNALS:
            return f"rank(s) {sorted(suspects)} died by {sig} at step {step}"
        return None
    if kind == "sdc":
        return f"silent data corruption on rank(s) {sorted(suspects)} at step {step}"
    if kind == "hang":
        exiting = set(detail.get("exiting") or [])
        verdict = detail.get("verdict")
        if verdict is not None and not verdict.get("blame"):
            return None  # the evidence names no rank it may count against (its "why" says so)
        if verdict is not None and verdict.get("by") == "flight_recorder":
            stuck = sorted((set(verdict.get("stuck") or []) & suspects) - exiting)
            if stuck:
                return (f"rank(s) {stuck} hung outside every collective at step {step} (flight "
                        f"recorder: every peer issued what they wait in)")
            return None
        # Stacks (only where collectives block the host, gloo; a record without a verdict too):
        # each node sees only its own ranks' stacks. A rank waiting inside a collective waits for
        # a peer (perhaps on another node); one stuck outside any collective is the evidence.
        where = detail.get("in_collective") or {}
        if all(where.get(str(r)) is False and r not in exiting for r in suspects):
            return f"rank(s) {sorted(suspects)} hung outside any collective at step {step}"
        return None
    return None


def exiting_ranks(suspects: list[int], evidence: list[str]) -> list[int]:
    """The ``suspects`` of a hang whose stack dump (a path in ``evidence``, named ``...-rank<R>.``)
    shows their main thread exiting: no frame of the program left (see the module docstring)."""
    out = []
    for rank in suspects:
        path = next((p for p in evidence if f"-rank{rank}." in os.path.basename(p) and p.endswith(".txt")), None)
        try:
            text = Path(path).read_text(errors="replace") if path else ""
        except OSError:
            continue  # no dump to read: no claim either way
        frames = (parse_pyspy if path.endswith(".pyspy.txt") else parse_faulthandler)(text) if text else []
        if frames and not any(func in _PROGRAM_FRAMES for func, _, _ in frames):
            out.append(rank)
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


class NodeRegistry:
    """Blame counts and the exclusion list of one job, in its rendezvous store."""

    def __init__(self, store: Any, node: str, run_dir: str | os.PathLike, exclude_after: int) -> None:
        self.store = store
        self.node = node
        self.path = Path(run_dir) / EXCLUDED_FILE
        self.exclude_after = exclude_after
        self._known: dict[str, dict[str, Any]] = {}
        if self.path.exists():  # a relaunch with the same --run-dir keeps what it knew
            for rec in json.loads(self.path.read_text()).get("nodes", []):
                self._known[rec["node"]] = rec

    def blame(self, fault: Any, reason: str) -> dict[str, Any] | None:
        """Count one blame against this node; returns the exclusion record when it reaches the limit."""
        count = int(self.store.add(_BLAMES.format(node=self.node), 1))
        log.warning("robust run: node %s blamed (%d of %d before exclusion): %s", self.node, count,
                    self.exclude_after, reason)
        if self.exclude_after <= 0 or count < self.exclude_after:
            return None
        record = {"node": self.node, "blames": count, "time": _now(), "reason": reason,
                  "fault": {"kind": fault.kind, "step": fault.step,
                            "suspect_ranks": list(fault.suspect_ranks)}}
        key = _EXCLUDED.format(node=self.node)
        if not self.store.check([key]):
            self.store.set(key, json.dumps(record))
            index = int(self.store.add(_EXCLUDED_COUNT, 1))
            self.store.set(_EXCLUDED_ENTRY.format(index=index), json.dumps(record))
        self.refresh()
        return record

    def refresh(self) -> list[dict[str, Any]]:
        """Read the job's exclusion list; write ``excluded_nodes.json``; return the new entries."""
        count = int(self.store.add(_EXCLUDED_COUNT, 0))
        new = []
        for index in range(1, count + 1):
            rec = json.loads(self.store.get(_EXCLUDED_ENTRY.format(index=index)))
            if rec["node"] not in self._known:
                self._known[rec["node"]] = rec
                new.append(rec)
        if new:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"nodes": list(self._known.values())}, indent=1) + "\n")
            os.replace(tmp, self.path)
        return new

    def excluded(self) -> dict[str, Any] | None:
        """This node's exclusion record, or None when it may join."""
        try:
            self.refresh()
        except Exception as exc:
            # The store is unreachable (its host is gone): the rendezvous that follows fails with
            # torch's own error; until then only what this node knew (its file) can refuse it.
            log.warning("robust run: could not read the job's excluded nodes from the rendezvous "
                        "store (%r); using %s", exc, self.path)
        return self._known.get(self.node)


#: Rendezvous-store keys of the hang views of one round (the per-round store of the rendezvous;
#: the static rendezvous reuses its store, so the agent's round count is part of the key).
_HANG_COUNT = "robust_run/hang_views/{round}/count"
_HANG_ENTRY = "robust_run/hang_views/{round}/{index}"


def exchange_hang_views(store: Any, round_key: str, node: str, payload: dict[str, Any], nodes: int,
                        timeout_s: float, poll_s: float = 0.1) -> list[dict[str, Any]]:
    """Publish this node's hang evidence and read every node's of the same round (this node's first).

    ``payload``: ``{"ranks": [...], "views": {rank: view}}`` (the flight-recorder views of
    :func:`~robust_plugins.watchdog.flight.views`). Every node's monitor sees the hang within about
    one learned timeout of the others (their ranks stop in the same step), so the wait for the
    ``nodes - 1`` others is short; a lost node's never comes, hence ``timeout_s``. Store errors
    end the exchange with what was read (the verdict then rests on fewer nodes, never on none).
    """
    count_key = _HANG_COUNT.format(round=round_key)
    mine = {"node": node, **payload}
    seen: dict[int, dict[str, Any]] = {}
    try:
        index = int(store.add(count_key, 1))
        store.set(_HANG_ENTRY.format(round=round_key, index=index), json.dumps(mine))
        seen[index] = mine
        deadline = time.monotonic() + timeout_s
        while len({e.get("node") for e in seen.values()}) < nodes and time.monotonic() < deadline:
            count = int(store.add(count_key, 0))
            for i in range(1, count + 1):
                key = _HANG_ENTRY.format(round=round_key, index=i)
                if i not in seen and store.check([key]):
                    seen[i] = json.loads(store.get(key))
            if len({e.get("node") for e in seen.values()}) < nodes:
                time.sleep(poll_s)
    except Exception as exc:  # the store's host is gone: judge on what came
        log.warning("robust run: the hang views of round %s could not be exchanged (%r); judging on "
                    "%d node(s)", round_key, exc, len(seen))
    others = [e for i, e in sorted(seen.items()) if e is not mine]
    return [mine] + others

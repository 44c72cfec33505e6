"""The job-wide fault view's transport: every agent sends its node's fault records to the job's
rendezvous store and mirrors every node's into its own ``job_faults.jsonl`` (merged by
:mod:`.jobfaults`).

Why the store: the same reason as the blame counts (:mod:`.nodes`): the c10d rendezvous store is
the one place every agent of the job reaches without a shared filesystem, its ``add`` is atomic,
and it lives as long as the job's rendezvous.

Why every node mirrors, not only the node hosting rank 0: torch's c10d rendezvous gives group
rank 0 to the node whose descriptor sorts first, anew each round, so global rank 0 (whose
telemetry recorder reads the view) can move to another node when a node is lost or a spare
joins; with every node holding the same view, rank 0 reads it wherever it runs, and a reader (the
demo, a person) finds it in any node's run directory. The cost is one store round trip every
``poll_s`` (0.5 s) a node, plus one ``get`` per message (a few per fault).

Why a thread of its own: a store call blocks up to its timeout when the store's host is slow or
gone. On the agent's thread that would hold up fault detection and the ranks' restart; here it
holds up only the view. This thread is the only user of its store client (timeout
``STORE_TIMEOUT_S``); the agent thread hands it rounds through a queue and waits for its last
flush at most ``FINAL_BOUND_S``.

Keys, outside the per-round prefixes (like nodes.py's): ``robust_run/fault_view/count`` (atomic
``add``: the next message's index) and ``robust_run/fault_view/<i>`` (one JSON message: ``join``,
``fault``, ``closed`` or ``done``). A writer takes an index, then sets the entry; a reader stops at
the first entry not set yet (``check`` does not block) and skips it only if it stays unset for
``GAP_S`` (its writer died between the two calls). A node's own messages go into its view
directly (and wait in an outbox while the store is unreachable), so a node whose store is gone
still writes its own faults to its view.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from robust_plugins._logging import get_logger
from robust_plugins.launcher.jobfaults import ViewBook
from robust_plugins.watchdog.faults import JOB_FAULTS

log = get_logger(__name__)

_COUNT = "robust_run/fault_view/count"
_ENTRY = "robust_run/fault_view/{index}"

#: Bound of every store call of the view (connect, add, get). A healthy store answers in
#: milliseconds; 5 s rides out a loaded host without holding the view up for long.
STORE_TIMEOUT_S = 5.0
#: The whole last flush at the agent's exit (records, closes, waiting for the other nodes).
FINAL_BOUND_S = 20.0
#: At the end of a completed job: how long to wait for the other nodes' last records. Their
#: ranks finished with this node's (the last step is collective), so they arrive within a poll.
_FINAL_WAIT_S = 10.0
#: How long an index may stay without its entry before readers skip it.
GAP_S = 10.0


class JobFaultView:
    """One agent's side of the job-wide fault view (see the module docstring).

    Args:
        connect: returns a client of the job's rendezvous store, bounded by ``STORE_TIMEOUT_S``.
        node: this node's name (as in blames and ``suspect_hosts``).
        monitor: the node's :class:`~robust_plugins.launcher.monitor.Monitor` (its run directory,
            ``faults.jsonl`` and :meth:`fault_state`).
        settle_s: how long a round waits for a node that does not close it (lost) after another
            node did, before it is written without that node's records.
        poll_s: seconds between two polls of the store.
    """

    def __init__(self, connect: Callable[[], Any], node: str, monitor: Any, settle_s: float = 30.0,
                 poll_s: float = 0.5) -> None:
        self._connect = connect
        self.node = node
        self.monitor = monitor
        self.poll_s = poll_s
        run_dir = Path(monitor.run_dir)
        self.path = run_dir / JOB_FAULTS
        self.path.touch()  # readers choose the job view from the start (watchdog.faults.fault_view_path)
        self._faults = run_dir / "faults.jsonl"
        # Lines already there are an earlier launch's with this --run-dir: not this job's rounds.
        self._offset = self._faults.stat().st_size if self._faults.exists() else 0
        self._book = ViewBook(settle_s)
        self._inbox: queue.Queue = queue.Queue()
        self._rounds: dict[int, tuple[int, list[int]]] = {}
        """incarnation -> (job round, this node's global ranks in it)."""
        self._closed: set[int] = set()
        self._done: dict[int, set[str]] = {}
        self._read = 0
        self._outbox: list[dict[str, Any]] = []
        self._gap_since: float | None = None
        self._store = None
        self._broken: str | None = None
        self._stop = threading.Event()
        self._wait_at_end = False
        self._thread = threading.Thread(target=self._loop, name="robust-fault-view", daemon=True)

    def start(self) -> None:
        """Start polling (from the agent, before the first rendezvous)."""
        self._thread.start()

    def join_round(self, job_round: int, incarnation: int, nodes: int, ranks: list[int]) -> None:
        """The agent formed rendezvous round ``job_round`` (``nodes`` nodes) whose ranks on this
        node, ``ranks``, will be the monitor's ``incarnation``."""
        self._inbox.put((job_round, incarnation, nodes, sorted(ranks)))

    def close(self, completed: bool) -> None:
        """Send what is left and write the last rounds (after the monitor wrote its held faults).

        ``completed``: the job ended normally, so the other nodes end now too: wait (bounded) for
        their last records. Otherwise (excluded, failed, stopped) only this node's are sent."""
        self._wait_at_end = completed
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(FINAL_BOUND_S)
        elif self._thread.ident is None:
            self._guarded(self._final)
        if self._thread.is_alive():
            self._warn(f"its last flush did not finish within {FINAL_BOUND_S:g} s")

    # -- the view's thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        def poll() -> None:
            while not self._stop.wait(self.poll_s):
                self._tick(close_all=False)
            self._final()

        self._guarded(poll)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # a bug of the view must not end the job; it is said, not hidden
            log.exception("robust run: the job-wide fault view failed")
            self._warn(f"it stopped on an error ({exc!r}; traceback in monitor.log)")

    def _final(self) -> None:
        self._tick(close_all=True)
        last = max((r for r, _ in self._rounds.values()), default=None)
        deadline = time.monotonic() + (_FINAL_WAIT_S if self._wait_at_end else 0.0)
        while (last is not None and self._store is not None and last in self._book.rounds
               and not self._book.complete(last) and time.monotonic() < deadline):
            time.sleep(0.2)
            self._tick(close_all=True, reconnect=False)
        nodes = self._book.members.get(last, set())
        self._write(self._book.settle(time.monotonic(), final=True))
        if last is None or self._store is None:
            return
        # Every node of the last round says it read everything; the node hosting the store waits
        # for that before its process (and the store) ends, so no node loses the last records.
        self._send({"type": "done", "round": last, "node": self.node})
        self._done.setdefault(last, set()).add(self.node)
        # Out now: when the others' "done" is already here the wait below does not tick, and an
        # unsent "done" would hold every other node for the whole _FINAL_WAIT_S.
        self._tick(close_all=True, reconnect=False)
        while self._wait_at_end and not nodes <= self._done.get(last, set()) and time.monotonic() < deadline:
            time.sleep(0.2)
            self._tick(close_all=True, reconnect=False)

    def _tick(self, close_all: bool, reconnect: bool = True) -> None:
        self._take_rounds()
        incarnation, unwritten = self.monitor.fault_state()
        self._send_records()
        for inc, (rnd, _) in sorted(self._rounds.items()):
            # Closed: the incarnation is over and every fault of it is in faults.jsonl (read
            # above, after fault_state: a fault leaves `unwritten` only once written).
            if rnd not in self._closed and (close_all or (inc < incarnation and inc not in unwritten)):
                self._send({"type": "closed", "round": rnd, "node": self.node})
                self._closed.add(rnd)
        try:
            if self._store is None:
                if not reconnect:
                    return
                self._store = self._connect()
            self._flush_outbox()
            self._receive()
            if self._broken is not None:
                log.warning("robust run: the job-wide fault view reaches the rendezvous store again")
                self._broken = None
        except Exception as exc:  # any store error: the view waits, training goes on
            self._store = None
            if self._broken is None:
                self._warn(f"the rendezvous store is unreachable ({exc!r})")
                self._broken = repr(exc)
        self._write(self._book.settle(time.monotonic()))

    def _take_rounds(self) -> None:
        while True:
            try:
                rnd, inc, nodes, ranks = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._rounds[inc] = (rnd, ranks)
            self._send({"type": "join", "round": rnd, "node": self.node, "nodes": nodes})

    def _send_records(self) -> None:
        if not self._faults.exists() or not self._rounds:
            return  # a spare that has not joined yet has no records
        with open(self._faults, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]  # a line being written is read on the next poll
        for line in whole.decode().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            # Every record's incarnation was announced by join_round before its ranks started.
            rnd, ranks = self._rounds.get(rec.get("incarnation"), self._rounds[max(self._rounds)])
            self._send({"type": "fault", "round": rnd, "node": self.node,
                        "record": {**rec, "node_ranks": ranks}})
            self._offset += len(line.encode()) + 1

    def _send(self, msg: dict[str, Any]) -> None:
        if msg["type"] != "done":
            self._book.ingest(msg, time.monotonic())
        self._outbox.append(msg)

    def _flush_outbox(self) -> None:
        while self._outbox:
            index = int(self._store.add(_COUNT, 1))
            self._store.set(_ENTRY.format(index=index), json.dumps(self._outbox[0]))
            self._outbox.pop(0)

    def _receive(self) -> None:
        count = int(self._store.add(_COUNT, 0))
        now = time.monotonic()
        while self._read < count:
            key = _ENTRY.format(index=self._read + 1)
            if not self._store.check([key]):
                self._gap_since = self._gap_since or now
                if now - self._gap_since < GAP_S:
                    return
                log.warning("robust run: fault view message %d was never written (its sender died "
                            "between two store calls); skipped", self._read + 1)
            else:
                msg = json.loads(self._store.get(key))
                if msg["node"] == self.node:
                    pass  # in the view since it was sent
                elif msg["type"] == "done":
                    self._done.setdefault(int(msg["round"]), set()).add(str(msg["node"]))
                else:
                    self._book.ingest(msg, now)
            self._read += 1
            self._gap_since = None

    def _write(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        text = "".join(json.dumps(r) + "\n" for r in records)
        with open(self.path, "a") as f:  # one write: a reader sees whole lines
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def _warn(self, why: str) -> None:
        msg = (f"robust run: the job-wide fault view {self.path} may miss other nodes' faults: {why}. "
               f"This node's own faults are complete in {self._faults}; each node's run directory has its own.")
        log.warning("%s", msg)
        print(msg, file=sys.stderr, flush=True)

"""The node monitor: one per node, in the agent process of ``robust run``; it judges the node's ranks.

The agent thread calls :meth:`Monitor.worker_env` and :meth:`Monitor.begin_incarnation` around
each start of the ranks, :meth:`Monitor.check` every monitor interval, :meth:`Monitor.on_crash`
when a rank exits badly, and :meth:`Monitor.close` at the end. ``check`` returns a fault when the
ranks must be stopped; the monitor itself never starts or stops a process. What the ranks send
arrives through a :class:`~.transport.Transport` (its own receiver thread) and is handled here,
under one lock; the parts are named at the top of the class.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from robust_plugins._logging import get_logger
from robust_plugins.config import WatchdogConfig
from robust_plugins.launcher import nodes as _nodes
from robust_plugins.launcher.monitor.detectors import Detectors
from robust_plugins.launcher.monitor.emergency import EmergencySaves
from robust_plugins.launcher.monitor.faultlog import FaultBook, Injections
from robust_plugins.launcher.monitor.state import _RankState
from robust_plugins.launcher.monitor.transport import Transport
from robust_plugins.watchdog import flight as _flight
from robust_plugins.watchdog import inject as _inject
from robust_plugins.watchdog import protocol as _protocol
from robust_plugins.watchdog import ring as _ring
from robust_plugins.watchdog import detect as _detect
from robust_plugins.watchdog.detect import STEP_WINDOW
from robust_plugins.watchdog.faults import Fault
from robust_plugins.watchdog.protocol import (
    MSG_BAD,
    MSG_COMM,
    MSG_EMERGENCY,
    MSG_END,
    MSG_EXIT,
    MSG_GROUP,
    MSG_HASH,
    MSG_HELLO,
    MSG_HISTORY,
    MSG_INJECT,
    MSG_QUERY,
    MSG_REFUSED,
    MSG_VERDICT,
)

log = get_logger(__name__)


class Monitor:
    """Fault detection for the ranks of one node.

    Parts: :attr:`transport` (socket, step rings, receiver thread), :attr:`detectors` (the
    evidence of each step and the detectors that judge it), :attr:`book` (recorded faults and when
    each is written), :attr:`injections` (``--inject`` faults still to fire) and :attr:`emergency`
    (the bounded wait for emergency saves). The monitor holds the per-rank state of the current
    incarnation (:attr:`ranks`) and hands it to them."""

    transport: Transport
    detectors: Detectors
    book: FaultBook
    injections: Injections
    emergency: EmergencySaves

    def __init__(self, cfg: WatchdogConfig, run_dir: str | os.PathLike,
                 injections: list[_inject.Injection] | None = None, host: str | None = None,
                 ring_entries: int = _ring.DEFAULT_ENTRIES) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.host = host or socket.gethostname()
        self.injections = Injections(injections)
        self.incarnation = -1
        self.ranks: dict[int, _RankState] = {}
        self._history: list[float] = []
        """Step times of earlier incarnations (the learned hang timeout survives restarts)."""
        self._seeded: set[int] = set()
        """Ranks whose checkpointed step times seeded ``_history`` (a fresh launcher only)."""
        self._incarnation_started = 0.0
        self._uses_api = False
        self._warned_receiver = False
        self._queries: list[tuple[int, Any]] = []
        """(step, reply address) of ``ok_to_save`` questions not answered yet."""
        self._stopping = -1
        """The incarnation whose fault ``check`` returned: its ranks are being stopped."""
        self._lock = threading.Lock()
        """Guards the state above and the book's; taken inside ``transport.lock`` when both are held."""
        floor = _detect.pg_timeout_floor_s(cfg)
        if floor > _detect.NCCL_DEFAULT_PG_TIMEOUT_S:
            log.warning("robust watchdog: hang timeouts up to %.0f s need a process-group timeout of at least "
                        "%.0f s, above NCCL's default %.0f s: pass timeout=robust_plugins.watchdog.pg_timeout(...) "
                        "to init_process_group (robust run exports %s=%d), or NCCL aborts a hung job before "
                        "its hang is judged.", max(cfg.hang_initial_timeout_s, cfg.hang_max_timeout_s), floor,
                        _detect.NCCL_DEFAULT_PG_TIMEOUT_S, _protocol.ENV_PG_TIMEOUT, math.ceil(floor))
        self.book = FaultBook(self.run_dir, self._lock, self.injections)
        self.emergency = EmergencySaves(cfg.emergency_save_timeout_s, self._savers, self._typical_step_s,
                                        lambda addr, message: self.transport.send(addr, message))
        self.transport = Transport(self.run_dir, self._handle, self._on_records, ring_entries)
        self.detectors = Detectors(cfg, self.run_dir, self.host, self._lock, self.book, self._record,
                                   self.transport.drain)

    # -- lifecycle -----------------------------------------------------------------------------
    def worker_env(self, ranks: Iterable[int] | None = None) -> dict[str, str]:
        """Variables the next incarnation's ranks need (set by the agent before starting them).

        With ``ranks`` (the global ranks about to start on this node) it also creates their step
        rings and writes their spike windows (:meth:`_write_spike_windows`); without, the ranks
        send a datagram a step and start their spike windows empty."""
        ranks = None if ranks is None else [int(r) for r in ranks]
        return {
            _protocol.ENV_SOCKET: self.transport.address,
            _protocol.ENV_RING: self.transport.create_rings(ranks) if ranks is not None else "",
            _protocol.ENV_RUN_DIR: str(self.run_dir),
            _protocol.ENV_INJECT: self.injections.to_env(),
            _protocol.ENV_INCARNATION: str(self.incarnation + 1),
            _protocol.ENV_SDC_EVERY: str(self.cfg.sdc_every_steps),
            _protocol.ENV_STRAGGLER: "1" if self.cfg.straggler_factor > 0 else "0",
            _protocol.ENV_SKIP: _protocol.format_skip_steps(self.detectors.skip_steps),
            _protocol.ENV_EMERGENCY_TIMEOUT: str(self.cfg.emergency_save_timeout_s),
            _protocol.ENV_ROLLBACK_MAX_STEP: self.book.rollback_max_step(),
            _protocol.ENV_PG_TIMEOUT: str(math.ceil(_detect.pg_timeout_floor_s(self.cfg))),
            _protocol.ENV_SPIKE: (f"{self.cfg.spike_factor:g},{self.cfg.spike_window},"
                                  f"{self.cfg.spike_warmup_steps}"),
            _protocol.ENV_SPIKE_WINDOWS: self._write_spike_windows(ranks) if ranks is not None else "",
            # The flight recorder records nothing by default; the hang verdict on NCCL needs it.
            **_flight.recorder_env(os.environ),
        }

    def _write_spike_windows(self, ranks: list[int]) -> str:
        """Write the spike windows of ``ranks`` (about to start) to the run directory; returns the
        file's path, or "" (said in a warning) when it cannot be written.

        Why: a rank holds at a spike by the monitor's rule applied to its own values (hold.py).
        Started with an empty window, a restarted rank would not judge its first
        ``spike_warmup_steps`` values, although the monitor (whose windows live across
        incarnations) does: a spike there let the ranks train on, or finish the job, and take
        newer snapshots until the step before the spike was evicted from memory, so that the
        rollback fell back to disk or to step 0. Seeded with the monitor's windows, the rank holds
        wherever the monitor judges a spike."""
        if self.cfg.spike_factor <= 0:
            return ""
        # The stopped ranks' last records (those since the last poll) join the windows first.
        self.transport.drain()
        with self._lock:
            record = _protocol.spike_windows_record(self.incarnation + 1, self.detectors.spike_windows(ranks))
        path = self.run_dir / _protocol.SPIKE_WINDOWS_FILE
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(record) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("robust watchdog: cannot write %s (%r); the ranks start their spike windows empty and "
                        "do not hold at a spike in their first %d steps.", path, exc, self.cfg.spike_warmup_steps)
            return ""
        return str(path)

    def begin_incarnation(self, pids: dict[int, int]) -> None:
        """New ranks ``{global_rank: pid}`` started; forget the previous incarnation's state."""
        self.detectors.end_straggler_episodes(self.ranks, self.incarnation, "restart")
        # The previous ranks are stopped by now: whatever they wrote since the last poll (steps
        # past a fault extend a rollback's bad range) is read under their incarnation.
        with self.transport.held():
            now = time.monotonic()
            with self._lock:
                for st in self.ranks.values():
                    self._history.extend(st.progress.step_times)
                del self._history[:-STEP_WINDOW * max(1, len(pids))]
                self.incarnation += 1
                self._incarnation_started = now
                self.detectors.relearn()
                # A script that reported steps before will again: watch the new ranks from their start
                # (a restarted rank can hang before its first step, e.g. in init_process_group).
                self.ranks = {r: _RankState(pid=p, registered=self._uses_api) for r, p in pids.items()}
                for st in self.ranks.values():
                    st.progress.last_progress = now
            self.transport.attach_rings(pids)
        with open(self.run_dir / "workers.jsonl", "a") as f:
            f.write(json.dumps({"incarnation": self.incarnation, "host": self.host,
                                "pids": {str(r): p for r, p in sorted(pids.items())}}) + "\n")
        log.info("robust watchdog: incarnation %d started, ranks %s", self.incarnation,
                 {r: p for r, p in sorted(pids.items())})

    def close(self) -> None:
        """Stop the receiver, remove the socket and the step rings, write a fault still waiting
        for its resume step."""
        self.transport.close()
        self.detectors.end_straggler_episodes(self.ranks, self.incarnation, "job end")
        self.book.flush(self.incarnation)

    def on_crash(self, failures: dict[int, Any], will_restart: bool,
                 seen: tuple[float, float] | None = None) -> Fault:
        """Ranks exited badly: ``{global_rank: ProcessFailure}`` from the elastic agent.

        ``seen``: (wall, monotonic) time when the agent's poll that found the exit began. torch
        stops the other ranks inside that poll, before it returns, so detection is timed to its
        start and the stop counts in the restart (``detail.stop_s``: how long the stop took)."""
        self.transport.drain()
        now_wall = time.time() if seen is None else seen[0]
        with self._lock:
            states = {r: self.ranks.get(r, _RankState()) for r in failures}
        # When one rank fails, the elastic agent stops its peers with SIGTERM and NCCL aborts
        # those whose collective lost the peer (SIGABRT): they appear in `failures` too. The
        # first cause is decided from the order of deaths and the ranks' logs (nodes.death_causes).
        ranks, causes = _nodes.first_causes([
            _nodes.Death(rank=r, exitcode=getattr(f, "exitcode", None), t=getattr(f, "timestamp", 0) or 0,
                         injected=bool(states[r].injected), log=_stderr_tail(f))
            for r, f in failures.items()])

        emergency = self.emergency.await_saves()
        first = ranks[0]
        st, failure = states[first], failures[first]
        exitcode = getattr(failure, "exitcode", None)
        sig = None
        if exitcode is not None and exitcode < 0:
            try:
                sig = signal.Signals(-exitcode).name
            except ValueError:
                sig = str(-exitcode)
        onset = st.injected["t"] if st.injected else st.last_msg_wall
        last = st.progress.last_step
        step = st.injected["s"] if st.injected else (last + 1 if last is not None else None)
        suspects = sorted(r for r in ranks if causes[r] == causes[first])
        fault = Fault(
            kind="crash", step=step, suspect_ranks=suspects, suspect_hosts=[self.host],
            detected_after_s=None if onset is None else round(max(0.0, now_wall - onset), 3),
            action="restart" if will_restart else "report",
            detail={"exitcodes": {str(r): getattr(failures[r], "exitcode", None) for r in ranks},
                    "signal": sig, "onset": "injected" if st.injected else "last signal",
                    "cause": causes[first], "causes": {str(r): causes[r] for r in ranks},
                    "reason": f"rank {first} exited with {sig or exitcode}",
                    "emergency_save": emergency},
        )
        if seen is not None:
            fault.detail["stop_s"] = round(time.monotonic() - seen[1], 3)
        held = self.emergency.take_hold_s()
        if held is not None:  # part of stop_s: the stop waited for the saves
            fault.detail["emergency_hold_s"] = held
        refusing = sorted(r for r in failures if states[r].refused)
        if refusing:
            # A refusal (a config or host-version problem) before the first step: a restart
            # would meet it again, so the job ends with its message (the agent stops restarts).
            why = states[refusing[0]].refused
            fault.action, fault.suspect_ranks = "report", refusing
            fault.detail.update(refused=why, reason=f"rank {refusing[0]} refused to run before its first step, "
                                f"which a restart would not change: {why}")
            return self._record(fault, detected_at=None if seen is None else seen[1])
        if self.transport.alive():
            # A NaN, SDC or spike the ranks reported before they exited is the fault to recover
            # from: restarting from the newest snapshot would restore its bad step.
            numeric = self.detectors.check_numbers(
                self.ranks, self.incarnation, will_restart,
                crash={"step": step, "suspect_ranks": suspects, **fault.detail})
            if numeric is not None:
                log.warning("robust watchdog: ranks %s also exited (%s); the %s fault at step %s "
                            "bounds the rollback", suspects, fault.detail["reason"], numeric.kind, numeric.step)
                return numeric
        return self._record(fault, detected_at=None if seen is None else seen[1])

    def check(self, will_restart: bool) -> Fault | None:
        """Look for faults (SDC, NaN/Inf, spike, hang); returns the fault if the ranks must be
        stopped. Then answers the ranks' ``ok_to_save`` questions."""
        fault = self._check(will_restart)
        if fault is not None:
            with self._lock:
                self._stopping = self.incarnation  # later questions: answered at once (_handle)
        self._answer_queries(fault)
        return fault

    def _check(self, will_restart: bool) -> Fault | None:
        """Read what the ranks sent, then :meth:`Detectors.check`; None once the receiver stopped."""
        if not self.transport.alive():
            if not self._warned_receiver:
                self._warned_receiver = True
                log.warning("robust watchdog: the signal receiver stopped; hang, NaN, spike and "
                            "SDC detection are off for the rest of the job (crashes are still detected).")
            return None
        self.transport.drain()
        now = time.monotonic()
        self.transport.heartbeat(now)
        return self.detectors.check(self.ranks, self.incarnation, self._history, self._incarnation_started,
                                    will_restart, now)

    @property
    def reports(self) -> list[Fault]:
        """Faults reported without stopping anything (stragglers)."""
        return self.detectors.reports

    def rejudge_hang(self, fault: Fault, nodes: list[dict]) -> None:
        """A recorded hang judged again on every node's views: :meth:`Detectors.rejudge_hang`."""
        self.detectors.rejudge_hang(fault, nodes, self.ranks)

    @property
    def all_faults(self) -> list[Fault]:
        """Faults that stopped the ranks (restart, rollback, or the job's end)."""
        return self.book.all

    def note_restart(self, standby_ranks: list[int], ranks: int) -> None:
        """The agent started the ranks after the pending fault: :meth:`FaultBook.note_restart`."""
        self.book.note_restart(standby_ranks, ranks)

    def flush_faults(self) -> None:
        """Write the faults still held for their resume step or an SDC verdict, and the straggler
        episodes still open (the job ends)."""
        self.detectors.end_straggler_episodes(self.ranks, self.incarnation, "job end")
        self.book.flush(self.incarnation)

    def fault_state(self) -> tuple[int, set[int]]:
        """(the current incarnation, incarnations with a recorded fault not yet in ``faults.jsonl``),
        read together: an incarnation below the first and not in the second has all its faults in
        the file (the job-wide view then closes its round, ``jobfaults_sync``)."""
        with self._lock:
            return self.incarnation, self.book.held()

    def _max_step(self) -> int | None:
        steps = [st.progress.last_step for st in self.ranks.values() if st.progress.last_step is not None]
        return max(steps) if steps else None

    def _record(self, fault: Fault, detected_at: float | None = None) -> Fault:
        """Record ``fault`` in the book, detected at ``detected_at`` (monotonic; now if None)."""
        self.book.flush(self.incarnation)
        with self._lock:
            self.book.record(fault, self.incarnation, self._max_step(), detected_at)
        log.warning("robust watchdog: %s fault at step %s, suspect ranks %s (%s); action: %s",
                    fault.kind, fault.step, fault.suspect_ranks, fault.detail.get("reason", ""),
                    fault.action)
        return fault

    @property
    def address(self) -> str:
        """The socket the ranks send to (``ROBUST_WATCHDOG_SOCKET`` in :meth:`worker_env`)."""
        return self.transport.address

    def hold_for_emergency_saves(self) -> None:
        """Before torch's agent stops the ranks after a crash: :meth:`EmergencySaves.hold`."""
        self.emergency.hold()

    def _savers(self) -> dict[int, tuple[dict[str, Any], int | None, str | None]]:
        """What the ranks with an emergency saver said (:data:`.emergency.Savers`), drained first."""
        self.transport.drain()
        with self._lock:
            return {r: (st.emergency, st.pid, st.device_type) for r, st in self.ranks.items() if st.emergency}

    def _typical_step_s(self) -> float:
        """The median step time of the job so far, earlier incarnations too (0 when unknown)."""
        with self._lock:
            times = sorted([*self._history, *(t for st in self.ranks.values() for t in st.progress.step_times)])
        return times[len(times) // 2] if times else 0.0

    # -- what the ranks send (called by the transport, under its lock) ---------------------------
    def _on_step(self, st: _RankState, rank: int, step: int, loss: float | None, grad_norm: float | None,
                 wall_s: float | None, comm_s: float | None, t_wall: float, now: float) -> None:
        """A rank finished ``step``: :meth:`Detectors.on_step`; under ``_lock``."""
        st.registered = self._uses_api = True  # also if its hello came too early
        self.detectors.on_step(st, rank, step, loss, grad_norm, wall_s, comm_s, t_wall, now, self.incarnation)

    def _on_records(self, rank: int, records: list, wall_offset: float) -> None:
        """Step records of ``rank`` from its ring."""
        with self._lock:
            st = self.ranks.get(rank)
            if st is None:
                return
            for rec in records:
                try:
                    self._on_step(st, rank, rec.step, rec.loss, rec.grad_norm, rec.wall_s,
                                  rec.comm_s, rec.t_mono + wall_offset, rec.t_mono)
                except Exception as exc:  # one bad record must not end the receiver
                    log.warning("robust watchdog: dropped a step record of rank %d: %r", rank, exc)

    def _handle(self, msg: dict[str, Any], now: float, addr: Any = None) -> None:
        with self._lock:
            if msg.get("i") != self.incarnation:
                return  # a dying rank of an earlier incarnation
            st = self.ranks.get(msg.get("r"))
            if st is None:
                return
            st.last_msg_wall = msg.get("t")
            kind = msg.get("k")
            if kind == MSG_HELLO:
                st.registered = self._uses_api = True
                st.pid = msg.get("pid", st.pid)
                st.fh_path = msg.get("fh")
                if msg.get("ring"):
                    self.transport.unlink_ring(msg.get("r"))
            elif kind == MSG_BAD:
                # A NaN/Inf step, also in the ring: flagged at once, and never lost to a lapped ring.
                st.registered = self._uses_api = True
                self.detectors.note_bad_number(st, int(msg["s"]), msg.get("l"), msg.get("g"), msg["t"])
            elif kind == MSG_INJECT:
                st.injected = msg
                self.injections.fired(msg.get("spec"), int(msg["s"]), self.incarnation)
            elif kind == MSG_EMERGENCY:
                before = st.emergency or {}
                st.emergency = {k: msg.get(k) for k in ("phase", "s", "ok", "sec", "error")}
                # Where the monitor asks the rank's listener to save (emergency.py), and how
                # it may save: from the registration, kept through the later phases.
                st.emergency["addr"] = addr if msg.get("phase") == "registered" else before.get("addr")
                st.emergency["via"] = msg.get("via") or before.get("via")
            elif kind == MSG_EXIT:
                st.finished = True
            elif kind == MSG_REFUSED:
                if st.refused is None and st.progress.last_step is None:
                    st.refused = str(msg.get("why"))
            elif kind == MSG_COMM:
                st.device_type = msg.get("dev")
            elif kind == MSG_GROUP:
                st.straggler_group = str(msg.get("g"))
            elif kind == MSG_HISTORY:
                # Step times a rank loaded from its checkpoint: only a launcher that has learned
                # nothing yet uses them (its own measurements are newer), once per rank.
                rank = msg["r"]
                if self.incarnation == 0 and rank not in self._seeded and not any(
                        s.progress.step_times for s in self.ranks.values()):
                    self._seeded.add(rank)
                    self._history.extend(float(t) for t in msg.get("times", [])[-STEP_WINDOW:])
                    self.detectors.relearn()
                    log.info("robust watchdog: rank %s restored %d step times from its checkpoint "
                             "(learned hang timeout without a new warm-up)", rank,
                             len(msg.get("times", [])))
            elif kind == MSG_QUERY:
                if addr and self._stopping == self.incarnation:
                    # The fault was found (its check has returned): the ranks are being stopped,
                    # and a rank that asks now (a NaN's rank, hold.py) must not wait for a check
                    # that will not come before the stop.
                    self._send_verdict(int(msg["s"]), addr, False)
                elif addr:
                    self._queries.append((int(msg["s"]), addr))
            elif kind == MSG_HASH:
                key = (self.incarnation, int(msg["s"]))
                seen = self.book.hash_log.setdefault(key, {})
                for r, h in (msg.get("all") or {}).items():
                    seen.setdefault(int(r), str(h))  # a peer's copy; its own report replaces it
                seen[int(msg["r"])] = str(msg.get("h"))
                for old in sorted(self.book.hash_log)[:-16]:
                    del self.book.hash_log[old]
                rp = self.book.sdc_replay
                if (rp is not None and self.incarnation > rp["incarnation"] and int(msg["s"]) == rp["step"]
                        and not msg.get("why")):
                    # The replayed check agrees (every rank judges the same all-gathered hashes):
                    # the corruption did not come back, a transient fault. The verdict is written
                    # once every rank's hash is in (evidence), or when the job ends.
                    rp["agreed"] = True
                    if len(self.book.hash_log[key]) >= len(self.ranks):
                        self.book.replay_verdict("transient", [], self.incarnation)
                elif msg.get("why") and st.sdc is None:
                    every = msg.get("every")
                    st.sdc = (int(msg["s"]), [int(r) for r in msg["bad"]], str(msg["why"]), msg["t"],
                              int(every) if isinstance(every, int) and every > 0 else None)
            elif kind == MSG_END:
                # A step as a datagram: from a rank without a ring.
                self._on_step(st, msg["r"], int(msg["s"]), msg.get("l"), msg.get("g"), msg.get("w"),
                              msg.get("c"), msg["t"], now)

    def _answer_queries(self, fault: Fault | None) -> None:
        # "May I save step s?" Yes once every watched rank has reported step s and nothing
        # tripped (SDC, NaN, spike reports for s are in by then); no once a fault was found.
        with self._lock:
            if not self._queries:
                return
            watched = [st for st in self.ranks.values() if st.registered and not st.finished]
            reached = min((st.progress.last_step or 0 for st in watched), default=0)
            ready = [(s, a) for s, a in self._queries if fault is not None or s <= reached]
            self._queries = [(s, a) for s, a in self._queries if (s, a) not in ready]
        for step, addr in ready:
            self._send_verdict(step, addr, fault is None)

    def _send_verdict(self, step: int, addr: Any, ok: bool) -> None:
        try:
            self.transport.send(addr, {"k": MSG_VERDICT, "s": step, "ok": ok}, block=False)
        except OSError as exc:  # the rank is gone or its buffer is full: it will time out
            log.warning("robust watchdog: could not answer a save question of step %d: %r", step, exc)


#: Bytes of a rank's stderr read for NCCL's failure text (its last lines: NCCL prints just before
#: the abort; 64 KiB holds a few hundred lines of traceback and warnings).
_LOG_TAIL_BYTES = 1 << 16


def _stderr_tail(failure: Any) -> str | None:
    """The tail of the rank's ``stderr.log``, which torch's elastic launcher writes beside its
    ``error.json`` under ``--redirects``/``--tee``; None when it wrote none."""
    error_file = getattr(failure, "error_file", None)
    if not error_file or error_file == os.devnull:
        return None
    path = Path(error_file).with_name("stderr.log")
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - _LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return None

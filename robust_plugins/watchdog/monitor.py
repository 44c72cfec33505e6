"""The node monitor: receives step signals from local ranks, detects faults, writes ``faults.jsonl``.

It lives in the ``robust run`` launcher process (the elastic agent), which calls
:meth:`Monitor.check` every monitor interval and :meth:`Monitor.on_crash` when a rank exits
badly. Steps arrive in one shared-memory ring per rank (:mod:`.ring`), created here before the
ranks start and read at every poll; rare events arrive as datagrams. A receiver thread reads the
datagrams as they come and polls the rings at least every ``_RECV_POLL_S``; the agent thread
drains both before it decides. Only the agent thread starts or stops ranks.
"""

from __future__ import annotations

import json
from collections import deque
import os
import select
import signal
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from robust_plugins._logging import get_logger
from robust_plugins.config import WatchdogConfig
from robust_plugins.watchdog import flight as _flight
from robust_plugins.watchdog import inject as _inject
from robust_plugins.watchdog import ring as _ring
from robust_plugins.watchdog import stacks as _stacks
from robust_plugins.watchdog.detect import (
    STEP_WINDOW,
    RankProgress,
    RunningMedian,
    in_collective,
    is_bad_number,
    learned_timeout,
    localize,
    localize_by_sequence,
    stalled_ranks,
    stragglers,
)
from robust_plugins.watchdog.faults import Fault, FaultLog

log = get_logger(__name__)

#: Receiver thread's poll period: the longest the rings go unread while the agent thread is busy
#: (e.g. collecting stacks), and the bound on how long close() waits for the thread.
_RECV_POLL_S = 0.2


@dataclass
class _RankState:
    pid: int | None = None
    fh_path: str | None = None
    progress: RankProgress = field(default_factory=RankProgress)
    last_msg_wall: float | None = None
    injected: dict[str, Any] | None = None
    registered: bool = False
    """The rank reported through ``step_end`` at least once (only such ranks are watched for hangs)."""
    finished: bool = False
    """The rank's interpreter is exiting (it sent ``exit``): no more steps are expected."""
    sdc: tuple[int, list[int], str, float] | None = None
    """(step, minority ranks, reason, wall time) of the first parameter-hash mismatch seen."""
    spike: tuple[int, str, float, float, float] | None = None
    """(step, what, value, median, wall time) of the first spike reported in this incarnation."""
    bad_number: tuple[int, str, float | None, float] | None = None
    """(step, what, value, wall time) of the first NaN/Inf reported in this incarnation."""
    compute: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    """(step, compute seconds, wall time) of the latest steps: step time minus collective time."""
    straggling: bool = False
    """Reported as a straggler in this incarnation (once, until it recovers)."""
    emergency: dict[str, Any] | None = None
    """Its emergency saver (``watchdog.on_emergency``): ``{"phase": registered|start|done, ...}``."""


#: How often the learned hang timeout is recomputed. It is a p99 over up to 512 steps a rank (a
#: sort of ~2,000 numbers, 70 us of the 116 us a check of 4 ranks took when done every 0.1 s)
#: and moves slowly; a value up to 1 s old delays a hang's detection by at most that second.
_LEARN_EVERY_S = 1.0

#: Set for the ranks of an incarnation started by a rollback: the newest step they may restore.
ENV_ROLLBACK_MAX_STEP = "ROBUST_ROLLBACK_MAX_STEP"


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class Monitor:
    """Fault detection for the ranks of one node."""

    def __init__(self, cfg: WatchdogConfig, run_dir: str | os.PathLike,
                 injections: list[_inject.Injection] | None = None, host: str | None = None,
                 ring_entries: int = _ring.DEFAULT_ENTRIES) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.faults = FaultLog(self.run_dir / "faults.jsonl")
        self.host = host or socket.gethostname()
        self.pending_injections = list(injections or [])
        self.incarnation = -1
        self.ranks: dict[int, _RankState] = {}
        self.all_faults: list[Fault] = []
        """Faults that stopped the ranks (restart, rollback, or the job's end)."""
        self.reports: list[Fault] = []
        """Faults reported without stopping anything (stragglers)."""
        self._spiked: dict[int, int] = {}
        """Spike faults per step, over every incarnation."""
        self.skip_path = self.run_dir / "skip_steps.json"
        self.skip_steps: set[int] = set()
        """Steps whose batch the ranks skip (spiked twice); kept in the run directory, so a
        relaunch with the same ``--run-dir`` skips them too."""
        if self.skip_path.exists():
            self.skip_steps = {int(x) for x in json.loads(self.skip_path.read_text())["steps"]}
        self._pending_resume: Fault | None = None
        self._sdc_replay: dict[str, Any] | None = None
        """An SDC rollback whose replay is awaited (``sdc_replay``): ``fault`` (its record, held
        until the verdict), ``step``, ``ranks`` (the minority), ``incarnation``, ``agreed``."""
        self._hash_log: dict[tuple[int, int], dict[int, str]] = {}
        """{(incarnation, step): {rank: hex}} of the latest parameter-hash checks (SDC evidence)."""
        self._rollback_limit: list[int] | None = None
        """After a rollback: [newest step the ranks may restore, incarnation of the fault, newest
        step its ranks reported]; kept until a later incarnation runs past that step."""
        self._max_step_before_fault: int | None = None
        self._detected_at: float | None = None
        self._history: list[float] = []
        """Step times of earlier incarnations (the learned hang timeout survives restarts)."""
        self._seeded: set[int] = set()
        """Ranks whose checkpointed step times seeded ``_history`` (a fresh launcher only)."""
        self._incarnation_started = 0.0
        self._warned_unregistered = False
        self._uses_api = False
        self._warned_receiver = False
        self._learned: tuple[float, float] | None = None
        """(monotonic time, value) of the latest learned hang timeout; None: compute anew."""
        self._medians: dict[tuple[int, str], RunningMedian] = {}
        self._queries: list[tuple[int, Any]] = []
        """(step, reply address) of ``ok_to_save`` questions not answered yet."""
        self._fired: list[tuple[int, int, _inject.Injection]] = []
        """(incarnation, step, injection) of every injected fault the ranks announced."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # In the run directory when the path fits AF_UNIX's 107 bytes (then even a SIGKILLed
        # launcher leaves nothing outside it), else in a short temporary directory.
        in_run_dir = str((self.run_dir / "monitor.sock").resolve())
        self._sock_dir = None if len(in_run_dir) < 100 else tempfile.mkdtemp(prefix="robust-wd-")
        self.address = in_run_dir if self._sock_dir is None else os.path.join(self._sock_dir, "monitor.sock")
        if os.path.exists(self.address):
            os.unlink(self.address)  # left by a launcher that was killed; nobody listens there
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.address)
        self._recv_lock = threading.Lock()
        self.ring_entries = ring_entries
        self._ring_dir = _ring.ring_dir(self.run_dir)
        stale = _ring.sweep_stale(self._ring_dir)
        if stale:
            log.info("robust watchdog: removed %d step rings left in %s by launchers that are gone",
                     len(stale), self._ring_dir)
        self._ring_seq = 0
        self._rings: dict[int, _ring.RingReader] = {}
        """This incarnation's step rings by global rank (read under ``_recv_lock``)."""
        self._pending_rings: dict[int, _ring.RingReader] = {}
        """Rings created for the next incarnation, attached by ``begin_incarnation``."""
        self.ring_missed: dict[int, int] = {}
        """Step records per rank overwritten before the monitor read them, over the job."""
        self._thread = threading.Thread(target=self._receive, name="robust-watchdog-recv", daemon=True)
        self._thread.start()

    # -- lifecycle -----------------------------------------------------------------------------
    def worker_env(self, ranks: Iterable[int] | None = None) -> dict[str, str]:
        """Variables the next incarnation's ranks need (set by the agent before starting them).

        With ``ranks`` (the global ranks about to start on this node) it also creates their step
        rings; without, the ranks send a datagram a step."""
        from robust_plugins.watchdog import client

        return {
            client.ENV_SOCKET: self.address,
            client.ENV_RING: self._create_rings(ranks) if ranks is not None else "",
            client.ENV_RUN_DIR: str(self.run_dir),
            client.ENV_INJECT: _inject.to_env(self.pending_injections),
            client.ENV_INCARNATION: str(self.incarnation + 1),
            client.ENV_SDC_EVERY: str(self.cfg.sdc_every_steps),
            client.ENV_STRAGGLER: "1" if self.cfg.straggler_factor > 0 else "0",
            client.ENV_SKIP: ",".join(str(s) for s in sorted(self.skip_steps)),
            client.ENV_EMERGENCY_TIMEOUT: str(self.cfg.emergency_save_timeout_s),
            ENV_ROLLBACK_MAX_STEP: self._rollback_max_step(),
        }

    def _rollback_max_step(self) -> str:
        # For in-memory snapshots (robust_plugins.checkpoint.restore.rollback_bound): a snapshot
        # taken every step holds the bad state of a rollback; the restarted ranks must not restore
        # anything newer than the last good step. The fault's record is written only later, and
        # the pending fault is replaced by the next one (a crash of the restarted ranks before
        # their first step), so the limit is kept on its own until the job ran past the bad steps.
        with self._lock:
            limit = self._rollback_limit
        return "" if limit is None else str(limit[0])

    def _create_rings(self, ranks: Iterable[int]) -> str:
        """Create the next incarnation's rings (replacing rings made for a start that did not
        happen); returns their path prefix, or "" (said in a warning) when they cannot be made."""
        with self._recv_lock:
            self._close_rings(self._pending_rings)
            self._pending_rings = {}
            self._ring_seq += 1
            prefix = _ring.ring_prefix(self._ring_dir, self._ring_seq)
            try:
                for r in ranks:
                    self._pending_rings[int(r)] = _ring.RingReader.create(f"{prefix}{r}", self.ring_entries)
            except (OSError, ValueError) as exc:
                self._close_rings(self._pending_rings)
                self._pending_rings = {}
                log.warning("robust watchdog: cannot create step rings under %s (%r); the ranks send "
                            "a datagram a step instead, which costs more per step on busy cores.",
                            self._ring_dir, exc)
                return ""
        return prefix

    @staticmethod
    def _close_rings(rings: dict[int, _ring.RingReader]) -> None:
        for ring in rings.values():
            ring.close()

    def begin_incarnation(self, pids: dict[int, int]) -> None:
        """New ranks ``{global_rank: pid}`` started; forget the previous incarnation's state."""
        with self._recv_lock:
            # The previous ranks are stopped by now: whatever they wrote since the last poll
            # (steps past a fault extend a rollback's bad range) is read under their incarnation.
            self._drain_locked()
            now = time.monotonic()
            with self._lock:
                for st in self.ranks.values():
                    self._history.extend(st.progress.step_times)
                del self._history[:-STEP_WINDOW * max(1, len(pids))]
                self.incarnation += 1
                self._incarnation_started = now
                self._learned = None
                # A script that reported steps before will again: watch the new ranks from their start
                # (a restarted rank can hang before its first step, e.g. in init_process_group).
                self.ranks = {r: _RankState(pid=p, registered=self._uses_api) for r, p in pids.items()}
                for st in self.ranks.values():
                    st.progress.last_progress = now
            old, self._rings = self._rings, {r: g for r, g in self._pending_rings.items() if r in pids}
            self._close_rings(old)
            self._close_rings({r: g for r, g in self._pending_rings.items() if r not in pids})
            self._pending_rings = {}
        with open(self.run_dir / "workers.jsonl", "a") as f:
            f.write(json.dumps({"incarnation": self.incarnation, "host": self.host,
                                "pids": {str(r): p for r, p in sorted(pids.items())}}) + "\n")
        log.info("robust watchdog: incarnation %d started, ranks %s", self.incarnation,
                 {r: p for r, p in sorted(pids.items())})

    def close(self) -> None:
        """Stop the receiver, write a fault still waiting for its resume step, remove the socket
        and the step rings."""
        self._stop.set()
        self._thread.join(timeout=2 * _RECV_POLL_S + 1.0)
        with self._recv_lock:
            self._close_rings(self._rings)
            self._close_rings(self._pending_rings)
            self._rings, self._pending_rings = {}, {}
        self._sock.close()
        self._flush_pending()
        try:
            os.unlink(self.address)
            if self._sock_dir is not None:
                os.rmdir(self._sock_dir)
        except OSError:
            pass

    # -- receiving -----------------------------------------------------------------------------
    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                select.select([self._sock], [], [], _RECV_POLL_S)
            except (OSError, ValueError):
                return  # socket closed
            # On a datagram, or every _RECV_POLL_S: the rings are read even while the agent
            # thread is busy, so they cannot be lapped unless a rank outruns this poll.
            self._drain()

    def _drain(self) -> None:
        """Handle every datagram already queued and every step record in the rings. Receiving
        and handling happen under one lock, so when the agent thread calls this, nothing is
        half-way (read but not yet handled): a rank's last words (an injected fault's
        announcement, its last steps) are known before its exit is judged, however late the
        receiver thread got scheduled."""
        with self._recv_lock:
            self._drain_locked()

    def _drain_locked(self) -> None:
        while True:
            try:
                data, addr = self._sock.recvfrom(65536, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            try:
                self._handle(json.loads(data), time.monotonic(), addr)
            except Exception as exc:  # one bad datagram must not end the receiver
                log.warning("robust watchdog: dropped a malformed signal (%d bytes): %r",
                            len(data), exc)
        self._poll_rings()

    def _poll_rings(self) -> None:
        """Handle the step records written since the last poll (under ``_recv_lock``)."""
        if not self._rings:
            return
        # A record carries the rank's monotonic step-end time; its wall time is derived here.
        wall_offset = time.time() - time.monotonic()
        for rank, ring in self._rings.items():
            records, missed = ring.poll()
            if missed:
                self.ring_missed[rank] = self.ring_missed.get(rank, 0) + missed
                log.warning("robust watchdog: rank %d wrote %d step records that were overwritten "
                            "before the monitor read them (ring of %d entries; %d lost in this job): "
                            "their loss, gradient norm and step time are not judged. NaN/Inf steps "
                            "also arrive as datagrams and are never lost this way.", rank, missed,
                            ring.capacity, self.ring_missed[rank])
            if not records:
                continue
            with self._lock:
                st = self.ranks.get(rank)
                if st is None:
                    continue
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
            if kind == "hello":
                st.registered = self._uses_api = True
                st.pid = msg.get("pid", st.pid)
                st.fh_path = msg.get("fh")
                ring = self._rings.get(msg.get("r"))
                if msg.get("ring") and ring is not None:
                    # Both sides have it mapped: the name can go now, so nothing is left in
                    # /dev/shm whatever happens to either process later.
                    ring.unlink()
            elif kind == "bad":
                # A NaN/Inf step, also in the ring: flagged at once, and never lost to a lapped ring.
                st.registered = self._uses_api = True
                self._note_bad_number(st, int(msg["s"]), msg.get("l"), msg.get("g"), msg["t"])
            elif kind == "inject":
                st.injected = msg
                spec = msg.get("spec")
                fired = [i for i in self.pending_injections if i.spec() == spec]
                if not any(i.kind in _inject.RECURRING_KINDS for i in fired):
                    # A bad batch stays armed: every replay of its step fires it again.
                    self.pending_injections = [i for i in self.pending_injections if i.spec() != spec]
                    self._fired += [(self.incarnation, int(msg["s"]), i) for i in fired]
            elif kind == "emerg":
                st.emergency = {k: msg.get(k) for k in ("phase", "s", "ok", "sec", "error")}
            elif kind == "exit":
                st.finished = True
            elif kind == "history":
                # Step times a rank loaded from its checkpoint: only a launcher that has learned
                # nothing yet uses them (its own measurements are newer), once per rank.
                rank = msg["r"]
                if self.incarnation == 0 and rank not in self._seeded and not any(
                        s.progress.step_times for s in self.ranks.values()):
                    self._seeded.add(rank)
                    self._history.extend(float(t) for t in msg.get("times", [])[-STEP_WINDOW:])
                    self._learned = None
                    log.info("robust watchdog: rank %s restored %d step times from its checkpoint "
                             "(learned hang timeout without a new warm-up)", rank,
                             len(msg.get("times", [])))
            elif kind == "query":
                if addr:
                    self._queries.append((int(msg["s"]), addr))
            elif kind == "hash":
                key = (self.incarnation, int(msg["s"]))
                seen = self._hash_log.setdefault(key, {})
                for r, h in (msg.get("all") or {}).items():
                    seen.setdefault(int(r), str(h))  # a peer's copy; its own report replaces it
                seen[int(msg["r"])] = str(msg.get("h"))
                for old in sorted(self._hash_log)[:-16]:
                    del self._hash_log[old]
                rp = self._sdc_replay
                if (rp is not None and self.incarnation > rp["incarnation"] and int(msg["s"]) == rp["step"]
                        and not msg.get("why")):
                    # The replayed check agrees (every rank judges the same all-gathered hashes):
                    # the corruption did not come back, a transient fault. The verdict is written
                    # once every rank's hash is in (evidence), or when the job ends.
                    rp["agreed"] = True
                    if len(self._hash_log[key]) >= len(self.ranks):
                        self._replay_verdict("transient", [])
                elif msg.get("why") and st.sdc is None:
                    st.sdc = (int(msg["s"]), [int(r) for r in msg["bad"]], str(msg["why"]), msg["t"])
            elif kind == "end":
                # A step as a datagram: from a rank without a ring.
                self._on_step(st, msg["r"], int(msg["s"]), msg.get("l"), msg.get("g"), msg.get("w"),
                              msg.get("c"), msg["t"], now)

    def _on_step(self, st: _RankState, rank: int, step: int, loss: float | None,
                 grad_norm: float | None, wall_s: float | None, comm_s: float | None,
                 t_wall: float, now: float) -> None:
        """A rank finished ``step`` at monotonic time ``now`` (wall time ``t_wall``); under ``_lock``."""
        st.registered = self._uses_api = True  # also if its hello came too early
        st.last_msg_wall = t_wall
        self._note_resume(step, now)
        limit = self._rollback_limit
        if limit is not None and self.incarnation > limit[1]:
            # The ranks that were stopped may have snapshotted one step past the last
            # they reported. Beyond that, every snapshot the bad steps left was replaced.
            if step > limit[2] + 1:
                self._rollback_limit = None
        elif limit is not None:
            limit[2] = max(limit[2], step)  # the faulty ranks run on until they are stopped
        st.progress.on_step(step, now)
        if wall_s is not None and comm_s is not None:
            st.compute.append((step, max(0.0, float(wall_s) - float(comm_s)), t_wall))
        self._note_bad_number(st, step, loss, grad_norm, t_wall)
        for what, value in (("loss", loss), ("grad_norm", grad_norm)):
            # Medians live across incarnations: a restarted job needs no new warm-up.
            med = self._medians.setdefault((rank, what), RunningMedian(self.cfg.spike_window))
            median = med.spike(value, self.cfg.spike_factor, self.cfg.spike_warmup_steps)
            if median is not None and st.spike is None:
                st.spike = (step, what, float(value), median, t_wall)

    def _note_bad_number(self, st: _RankState, step: int, loss: float | None,
                         grad_norm: float | None, t_wall: float) -> None:
        if not self.cfg.nan_check or st.bad_number is not None:
            return
        for what, value in (("loss", loss), ("grad_norm", grad_norm)):
            if is_bad_number(value):
                st.bad_number = (step, what, value, t_wall)
                return

    def _note_resume(self, step: int, now: float) -> None:
        fault = self._pending_resume
        # The faulty incarnation's ranks may report a step or two more before they are stopped.
        if fault is None or self.incarnation <= fault.incarnation:
            return
        fault.resumed_at_step = step
        if self._detected_at is not None:
            fault.detail["recovered_after_s"] = round(max(0.0, now - self._detected_at), 3)
        if self._max_step_before_fault is not None:
            fault.lost_steps = max(0, self._max_step_before_fault - (step - 1))
        self._pending_resume = None
        rp = self._sdc_replay
        if rp is not None and rp["fault"] is fault:
            return  # written with the replay's verdict
        self.faults.write(fault)

    def note_restart(self, standby_ranks: list[int], ranks: int) -> None:
        """The agent started the ranks after the pending fault (before ``begin_incarnation``):
        ``detail.restart_s`` (detection to the ranks running the script again) and whether
        standbys served it (``detail.standby``: every one of this node's ``ranks``)."""
        with self._lock:
            fault = self._pending_resume
            if fault is None or self._detected_at is None:
                return
            fault.detail["restart_s"] = round(time.monotonic() - self._detected_at, 3)
            fault.detail["standby"] = bool(ranks) and len(standby_ranks) == ranks
            fault.detail["standby_ranks"] = sorted(standby_ranks)

    def _replay_verdict(self, verdict: str, minority: list[int]) -> Fault:
        """Close the awaited SDC replay (under ``self._lock``): record the verdict and its evidence
        in the held fault, and write the fault unless it still waits for its resume step."""
        rp, self._sdc_replay = self._sdc_replay, None
        fault = rp["fault"]
        detected = self._hash_log.get((rp["incarnation"], rp["step"]), {})
        replayed = ({} if verdict == "not replayed"
                    else self._hash_log.get((self.incarnation, rp["step"]), {}))
        why = {"transient": "the replicas agree after the replay from the checkpoint: a transient "
                            "fault; the ranks stay",
               "persistent": f"the replay from the checkpoint corrupted ranks {minority} again: a "
                             f"persistent fault; evicted",
               "different": f"the replay disagreed again but on ranks {minority}, not {rp['ranks']}",
               "not replayed": "the job stopped, or another fault came, before the replayed check"}[verdict]
        evidence = {"step": rp["step"], "minority": rp["ranks"], "verdict": verdict, "why": why,
                    "hashes_at_detection": {str(r): h for r, h in sorted(detected.items())},
                    "detected_in_incarnation": rp["incarnation"],
                    "hashes_at_replay": {str(r): h for r, h in sorted(replayed.items())},
                    "replayed_in_incarnation": self.incarnation if verdict != "not replayed" else None}
        path = self.run_dir / "sdc" / f"replay-step{rp['step']}-inc{rp['incarnation']}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(evidence, indent=1) + "\n")
            fault.evidence.append(str(path))
        except OSError as exc:  # the verdict still goes into faults.jsonl
            log.warning("robust watchdog: could not write the SDC replay evidence %s: %r", path, exc)
        fault.detail["replay"] = {"verdict": verdict, "why": why, "replayed_in_incarnation":
                                  evidence["replayed_in_incarnation"]}
        log.warning("robust watchdog: SDC at step %d on ranks %s: %s", rp["step"], rp["ranks"], why)
        if fault is not self._pending_resume:
            self.faults.write(fault)
        return fault

    def _flush_pending(self) -> None:
        with self._lock:
            if self._sdc_replay is not None:
                held = self._sdc_replay["fault"]
                self._replay_verdict("transient" if self._sdc_replay.get("agreed") else "not replayed", [])
                if held is self._pending_resume:
                    self._pending_resume = None
                    self.faults.write(held)
            fault, self._pending_resume = self._pending_resume, None
        if fault is not None:
            self.faults.write(fault)

    # -- detection (called from the agent thread) -------------------------------------------------
    def _max_step(self) -> int | None:
        steps = [st.progress.last_step for st in self.ranks.values() if st.progress.last_step is not None]
        return max(steps) if steps else None

    def _record(self, fault: Fault) -> Fault:
        self._flush_pending()
        with self._lock:
            self._max_step_before_fault = self._max_step()
            self._detected_at = time.monotonic()
            fault.incarnation = self.incarnation
            self.all_faults.append(fault)
            # Ranks run on for a few steps between a fault and their stop; injections they fired
            # after the fault's step are replayed by the restarted job: arm them again.
            if fault.step is not None:
                rearm = [i for inc, step, i in self._fired
                         if inc == self.incarnation and step > fault.step]
                self._fired = [f for f in self._fired if f[2] not in rearm]
                self.pending_injections += rearm
            if fault.action == "rollback" and fault.step is not None:
                back = int(fault.detail.get("check_every", 1)) if fault.kind == "sdc" else 1
                newest = fault.step - back
                # Snapshots up to the newest step any rank reached hold the bad state until the
                # job has run past it again (each of those steps was then snapshotted anew).
                reached = max(fault.step, self._max_step_before_fault or fault.step)
                if self._rollback_limit is not None:
                    newest = min(newest, self._rollback_limit[0])
                    reached = max(reached, self._rollback_limit[2])
                self._rollback_limit = [newest, self.incarnation, reached]
            if fault.action in ("restart", "rollback"):
                self._pending_resume = fault  # written when the restarted job reports a step
            else:
                self.faults.write(fault)
        log.warning("robust watchdog: %s fault at step %s, suspect ranks %s (%s); action: %s",
                    fault.kind, fault.step, fault.suspect_ranks, fault.detail.get("reason", ""),
                    fault.action)
        return fault

    def on_crash(self, failures: dict[int, Any], will_restart: bool) -> Fault:
        """Ranks exited badly: ``{global_rank: ProcessFailure}`` from the elastic agent."""
        self._drain()
        now_wall = time.time()
        with self._lock:
            states = {r: self.ranks.get(r, _RankState()) for r in failures}
        # When one rank fails, the elastic agent stops its peers with SIGTERM, and they appear in
        # `failures` too: rank the causes as announced injection < any other failure < SIGTERM.
        def cause_order(r: int) -> tuple[int, float]:
            st, code = states[r], getattr(failures[r], "exitcode", None)
            klass = 0 if st.injected else 2 if code == -int(signal.SIGTERM) else 1
            return klass, getattr(failures[r], "timestamp", 0) or 0

        emergency = self._await_emergency_saves()
        ranks = sorted(failures, key=cause_order)
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
        suspects = sorted(r for r in ranks if cause_order(r)[0] == cause_order(first)[0])
        fault = Fault(
            kind="crash", step=step, suspect_ranks=suspects, suspect_hosts=[self.host],
            detected_after_s=None if onset is None else round(max(0.0, now_wall - onset), 3),
            action="restart" if will_restart else "report",
            detail={"exitcodes": {str(r): getattr(failures[r], "exitcode", None) for r in ranks},
                    "signal": sig, "onset": "injected" if st.injected else "last signal",
                    "reason": f"rank {first} exited with {sig or exitcode}",
                    "emergency_save": emergency},
        )
        return self._record(fault)

    def _await_emergency_saves(self) -> dict[str, Any] | None:
        """Give the live ranks that registered an emergency saver a bounded chance to finish it
        (they start when their collective fails, a moment after the peer died); return what each
        reported, or None when no rank registered one. Called before the agent stops the ranks."""
        timeout = self.cfg.emergency_save_timeout_s
        if timeout <= 0:
            return None
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            with self._lock:
                savers = {r: (st.emergency, st.pid) for r, st in self.ranks.items() if st.emergency}
            if not savers:
                return None
            # Waiting for: a save under way, or a live rank that may still hit the failed collective.
            pending = [r for r, (e, pid) in savers.items()
                       if e["phase"] == "start" or (e["phase"] == "registered" and _pid_alive(pid))]
            if not pending or timeout <= 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        out: dict[str, Any] = {}
        for r, (e, _) in sorted(savers.items()):
            if e["phase"] == "done":
                out[str(r)] = {"step": e["s"], "ok": bool(e["ok"]), "seconds": e["sec"],
                               **({"error": e["error"]} if e.get("error") else {})}
            elif e["phase"] == "start":
                out[str(r)] = {"step": e["s"], "ok": False,
                               "error": f"not finished within emergency_save_timeout_s = {timeout:g} s"}
            else:
                out[str(r)] = {"step": None, "ok": False, "error": "not started (no failed collective on this rank)"}
        return out

    def check(self, will_restart: bool) -> Fault | None:
        """Look for faults (SDC, NaN/Inf, spike, hang); returns the fault if the ranks must be
        stopped. Then answers the ranks' ``ok_to_save`` questions."""
        fault = self._check(will_restart)
        self._answer_queries(fault)
        return fault

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
            verdict = {"k": "verdict", "s": step, "ok": fault is None}
            try:
                self._sock.sendto(json.dumps(verdict).encode(), socket.MSG_DONTWAIT, addr)
            except OSError as exc:  # the rank is gone or its buffer is full: it will time out
                log.warning("robust watchdog: could not answer a save question of step %d: %r",
                            step, exc)

    def _check(self, will_restart: bool) -> Fault | None:
        if not self._thread.is_alive():
            if not self._warned_receiver:
                self._warned_receiver = True
                log.warning("robust watchdog: the signal receiver stopped; hang, NaN, spike and "
                            "SDC detection are off for the rest of the job (crashes are still detected).")
            return None
        self._drain()
        now, now_wall = time.monotonic(), time.time()
        with self._recv_lock:
            for ring in self._rings.values():
                ring.heartbeat(now)  # detection is live: the ranks warn when this goes stale
        with self._lock:
            bad = {r: st.bad_number for r, st in self.ranks.items() if st.bad_number}
            progress = {r: st.progress for r, st in self.ranks.items() if st.registered}
            finished = [r for r, st in self.ranks.items() if st.finished]
            silent = sorted(r for r, st in self.ranks.items() if not st.registered)
            history = list(self._history)
        if (silent and not self._warned_unregistered
                and now - self._incarnation_started > self.cfg.hang_initial_timeout_s):
            self._warned_unregistered = True
            log.warning("robust watchdog: ranks %s sent no step signal within %.0f s, so they are "
                        "not watched for hangs. Call robust_plugins.watchdog.step_end(step, ...) "
                        "after each optimizer step.", silent, self.cfg.hang_initial_timeout_s)
        if bad:
            step = min(b[0] for b in bad.values())
            suspects = sorted(r for r, b in bad.items() if b[0] == step)
            first = bad[suspects[0]]
            return self._record(Fault(
                kind="nan", step=step, suspect_ranks=suspects, suspect_hosts=[self.host],
                detected_after_s=round(max(0.0, now_wall - first[3]), 3),
                action="rollback" if will_restart else "report",
                detail={"what": first[1], "value": str(first[2]),
                        "reason": f"{first[1]} = {first[2]} at step {step}"},
            ))
        with self._lock:
            sdc = sorted((st.sdc for st in self.ranks.values() if st.sdc), key=lambda x: x[0])
        if sdc:
            # Every rank computed the same verdict from the same all-gathered hashes.
            step, minority, reason, t = sdc[0]
            with self._lock:
                rp = self._sdc_replay
                replay = rp is not None and self.incarnation > rp["incarnation"] and step == rp["step"]
            if replay:
                # Every rank sends its hash right after the same all-gather: wait (bounded) for
                # all of them, so the evidence holds every replica's.
                deadline = time.monotonic() + 1.0
                while (len(self._hash_log.get((self.incarnation, step), {})) < len(self.ranks)
                       and time.monotonic() < deadline):
                    time.sleep(0.02)
                    self._drain()
            with self._lock:
                persistent = replay and minority == rp["ranks"]
                if replay:
                    first = self._replay_verdict("persistent" if persistent else "different", minority)
            if persistent:
                # The same ranks corrupted the same step twice, from a verified checkpoint: their
                # hardware, not a cosmic ray. Restarting on it would loop; the job stops (a
                # multi-node job excludes the node instead: each detection counted as a blame).
                return self._record(Fault(
                    kind="sdc", step=step, suspect_ranks=minority, suspect_hosts=[self.host],
                    detected_after_s=round(max(0.0, now_wall - t), 3), action="evict",
                    evidence=list(first.evidence),
                    detail={"reason": f"{reason}; the replay of step {step} from the checkpoint "
                                      f"corrupted the same ranks again: persistent",
                            "check_every": self.cfg.sdc_every_steps, "replay": first.detail["replay"]},
                ))
            action = "rollback" if will_restart else "report"
            fault = Fault(
                kind="sdc", step=step, suspect_ranks=minority, suspect_hosts=[self.host],
                detected_after_s=round(max(0.0, now_wall - t), 3), action=action,
                detail={"reason": reason, "check_every": self.cfg.sdc_every_steps},
            )
            if action == "rollback" and self.cfg.sdc_replay:
                fault.detail["replay"] = {"verdict": "pending"}
            fault = self._record(fault)
            if action == "rollback" and self.cfg.sdc_replay:
                with self._lock:
                    # The rollback replays the steps up to `step` on every rank (a data-parallel
                    # step needs its peers' gradients); the replayed check there is the verdict.
                    self._sdc_replay = {"fault": fault, "step": step, "ranks": minority,
                                        "incarnation": self.incarnation, "agreed": False}
            return fault
        with self._lock:
            spikes = {r: st.spike for r, st in self.ranks.items() if st.spike}
        if spikes:
            step = min(sp[0] for sp in spikes.values())
            suspects = sorted(r for r, sp in spikes.items() if sp[0] == step)
            _, what, value, median, t = spikes[suspects[0]]
            skip = self._note_spike(step)
            return self._record(Fault(
                kind="spike", step=step, suspect_ranks=suspects, suspect_hosts=[self.host],
                detected_after_s=round(max(0.0, now_wall - t), 3),
                action="rollback" if will_restart else "report",
                detail={"what": what, "value": value, "median": median,
                        "factor": self.cfg.spike_factor, "skip_batch": skip,
                        "reason": f"{what} = {value:.4g} is {value / median:.1f} x its running "
                                  f"median {median:.4g} at step {step}"
                                  + ("; it spiked before the rollback too: the restarted ranks skip "
                                     "its batch" if skip else "")},
            ))
        self._check_stragglers(now_wall)
        if self._learned is None or now - self._learned[0] >= _LEARN_EVERY_S:
            self._learned = (now, learned_timeout(self.cfg, progress, history))
        stalled, timeout = stalled_ranks(self.cfg, progress, now, finished, history,
                                         learned=self._learned[1])
        if not stalled:
            return None
        return self._hang(stalled, timeout, will_restart, now)

    def _note_spike(self, step: int) -> bool:
        """Count a spike at ``step``; True when its batch is to be skipped from now on."""
        self._spiked[step] = self._spiked.get(step, 0) + 1
        if not self.cfg.spike_skip_batch or self._spiked[step] < 2 or step in self.skip_steps:
            return False
        self.skip_steps.add(step)
        tmp = self.skip_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"steps": sorted(self.skip_steps),
                                   "why": "each step spiked again after a rollback"}) + "\n")
        os.replace(tmp, self.skip_path)
        return True

    def _check_stragglers(self, now_wall: float) -> None:
        """Report (never restart for) ranks whose compute time stays above its peers'."""
        window = self.cfg.straggler_window
        with self._lock:
            # The detector judges the last `window` steps: copy only those (the deque keeps 512,
            # and copying all of them every check was most of a check's CPU).
            compute = {r: [st.compute[i][1] for i in range(-min(window, len(st.compute)), 0)]
                       for r, st in self.ranks.items() if st.registered and not st.finished}
            found = stragglers(compute, self.cfg.straggler_factor, window)
            slow = {s.rank for s in found}
            for r, st in self.ranks.items():
                if r not in slow:
                    st.straggling = False  # recovered (or never slow): may be reported again
            new = [s for s in found if not self.ranks[s.rank].straggling]
            for s in new:
                self.ranks[s.rank].straggling = True
            recent = {s.rank: list(self.ranks[s.rank].compute) for s in new}
            last_step = self._max_step()
        for s in new:
            # Onset: the first step of the latest run of steps above factor x the peers' median.
            onset, step = recent[s.rank][-1][2], recent[s.rank][-1][0]
            slow_run: list[float] = []
            for st_step, c, t in reversed(recent[s.rank]):
                if c <= self.cfg.straggler_factor * s.peers_s:
                    break
                onset, step = t, st_step
                slow_run.append(c)
            # The window's median crosses the bar when about half the window is slow, so it sits
            # between the fast and the slow time; the user is told the slow steps' own median.
            slow_s = statistics.median(slow_run) if slow_run else s.compute_s
            fault = Fault(
                kind="straggler", step=step, suspect_ranks=[s.rank], suspect_hosts=[self.host],
                detected_after_s=round(max(0.0, now_wall - onset), 3), action="report",
                incarnation=self.incarnation,
                detail={"compute_s": round(slow_s, 4), "peers_compute_s": round(s.peers_s, 4),
                        "ratio": round(slow_s / s.peers_s, 2), "factor": self.cfg.straggler_factor,
                        "window": window, "window_median_s": round(s.compute_s, 4),
                        "slow_steps": len(slow_run), "reported_at_step": last_step,
                        "reason": f"rank {s.rank} computes {slow_s * 1e3:.0f} ms a step over its "
                                  f"last {len(slow_run)} steps, {slow_s / s.peers_s:.1f} x its peers' "
                                  f"median {s.peers_s * 1e3:.0f} ms (time in collectives excluded)"},
            )
            with self._lock:
                self.reports.append(fault)
            self.faults.write(fault)
            log.warning("robust watchdog: straggler rank %d on %s: %s", s.rank, self.host,
                        fault.detail["reason"])

    def _hang(self, stalled: list[int], timeout: float, will_restart: bool, now: float) -> Fault:
        with self._lock:
            targets = {r: (st.pid, st.fh_path) for r, st in self.ranks.items() if st.pid}
            last_steps = {r: st.progress.last_step for r, st in self.ranks.items()}
            injected = {r: st.injected for r, st in self.ranks.items() if st.injected}
            oldest = min(self.ranks[r].progress.last_progress for r in stalled)
        t0 = time.monotonic()
        tag = f"hang-inc{self.incarnation}"
        # Sequence numbers first: on NCCL a healthy rank's stack does not show that it waits for a
        # peer (detect.in_collective); they tell who never issued the collective the others wait in.
        served = _flight.served_paths(self.run_dir, {r: pid for r, (pid, _) in targets.items()})
        sequences = _flight.collect({r: served.get(r) for r in targets}) if served else {}
        dumps = _stacks.collect(targets, self.run_dir / "stacks", tag, self.cfg.stack_dump_timeout_s)
        dump_s = time.monotonic() - t0
        where = (localize_by_sequence(sequences) if sequences else None) or localize(
            {r: dumps[r].frames if r in dumps else None for r in targets}, last_steps)
        suspects = where.suspects
        # The fault began when the first suspect stopped making progress.
        started = [self.ranks[r].progress.last_progress for r in suspects if r in self.ranks] or [oldest]
        detected_after = (now - min(started)) + dump_s
        sus_steps = [last_steps[r] for r in suspects if last_steps.get(r) is not None]
        step = min(sus_steps) + 1 if sus_steps else None
        if len(injected) == 1:
            (inj,) = injected.values()
            detected_after = time.time() - inj["t"]
        fault = Fault(
            kind="hang", step=step, suspect_ranks=suspects, suspect_hosts=[self.host],
            detected_after_s=round(detected_after, 3),
            action="restart" if will_restart else "report",
            evidence=sorted(d.path for d in dumps.values() if d.path),
            detail={"timeout_s": round(timeout, 3), "stalled_ranks": stalled, "reason": where.reason,
                    "groups": where.groups, "stack_tools": {str(r): d.tool for r, d in dumps.items()},
                    "stack_dump_s": round(dump_s, 3),
                    # Per rank with a readable stack: waiting in a collective (for a peer, maybe on
                    # another node) or not (stuck itself). Node blame uses it (watchdog/nodes.py).
                    "in_collective": {str(r): in_collective(d.frames) for r, d in dumps.items()
                                      if d.frames},
                    # Per rank, per process group: collectives issued / started (None: unreadable).
                    "flight_recorder": {str(r): s for r, s in sequences.items()}},
        )
        return self._record(fault)


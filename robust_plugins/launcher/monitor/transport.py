"""The node monitor's transport: step rings and datagrams from the ranks, read by a receiver thread."""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Any, Iterable

from robust_plugins._logging import get_logger
from robust_plugins.watchdog import inject as _inject
from robust_plugins.watchdog import ring as _ring
from robust_plugins.watchdog.detect import STEP_WINDOW
from robust_plugins.watchdog.faults import Fault
from robust_plugins.watchdog.protocol import (
    MSG_BAD,
    MSG_COMM,
    MSG_EMERGENCY,
    MSG_END,
    MSG_EXIT,
    MSG_HASH,
    MSG_HELLO,
    MSG_HISTORY,
    MSG_INJECT,
    MSG_QUERY,
    MSG_VERDICT,
    ring_path,
)

# The monitor's logger: every line of the node monitor carries one name in monitor.log.
log = get_logger("robust_plugins.launcher.monitor")


#: Receiver thread's poll period: the longest the rings go unread while the agent thread is busy
#: (e.g. collecting stacks), and the bound on how long close() waits for the thread.
_RECV_POLL_S = 0.2


class _MonitorIPC:
    """Part of :class:`~robust_plugins.launcher.monitor.Monitor`: its transport, the step rings and
    the datagram socket, the receiver thread that reads them, the handling of each message, and
    the answers to ``ok_to_save`` questions. The state it uses is set up in ``Monitor.__init__``."""

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
                    self._pending_rings[int(r)] = _ring.RingReader.create(ring_path(prefix, r), self.ring_entries)
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
            if kind == MSG_HELLO:
                st.registered = self._uses_api = True
                st.pid = msg.get("pid", st.pid)
                st.fh_path = msg.get("fh")
                ring = self._rings.get(msg.get("r"))
                if msg.get("ring") and ring is not None:
                    # Both sides have it mapped: the name can go now, so nothing is left in
                    # /dev/shm whatever happens to either process later.
                    ring.unlink()
            elif kind == MSG_BAD:
                # A NaN/Inf step, also in the ring: flagged at once, and never lost to a lapped ring.
                st.registered = self._uses_api = True
                self._note_bad_number(st, int(msg["s"]), msg.get("l"), msg.get("g"), msg["t"])
            elif kind == MSG_INJECT:
                st.injected = msg
                spec = msg.get("spec")
                fired = [i for i in self.pending_injections if i.spec() == spec]
                if not any(i.kind in _inject.RECURRING_KINDS for i in fired):
                    # A bad batch stays armed: every replay of its step fires it again.
                    self.pending_injections = [i for i in self.pending_injections if i.spec() != spec]
                    self._fired += [(self.incarnation, int(msg["s"]), i) for i in fired]
            elif kind == MSG_EMERGENCY:
                before = st.emergency or {}
                st.emergency = {k: msg.get(k) for k in ("phase", "s", "ok", "sec", "error")}
                # Where the monitor asks the rank's listener to save (emergency.py), and how
                # it may save: from the registration, kept through the later phases.
                st.emergency["addr"] = addr if msg.get("phase") == "registered" else before.get("addr")
                st.emergency["via"] = msg.get("via") or before.get("via")
            elif kind == MSG_EXIT:
                st.finished = True
            elif kind == MSG_COMM:
                st.device_type = msg.get("dev")
            elif kind == MSG_HISTORY:
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
            self._sock.sendto(json.dumps({"k": MSG_VERDICT, "s": step, "ok": ok}).encode(), socket.MSG_DONTWAIT, addr)
        except OSError as exc:  # the rank is gone or its buffer is full: it will time out
            log.warning("robust watchdog: could not answer a save question of step %d: %r", step, exc)

"""The node monitor's end of the wire: the datagram socket, one step ring per rank, a receiver thread.

A :class:`Transport` knows the wire and nothing of faults. It promises that every datagram and
every ring record reaches its owner's handlers once, in arrival order, under :attr:`lock` (one
lock for receiving and handling, so a reader holding it knows nothing is half-way: read but not
yet handled), whether the receiver thread or a caller of :meth:`drain` read it. A malformed
datagram or a record whose handler raises is logged and dropped; it never ends the receiver.
The wire itself (names, record layout) is ``robust_plugins.watchdog.protocol`` and ``.ring``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from robust_plugins._logging import get_logger
from robust_plugins.watchdog import ring as _ring
from robust_plugins.watchdog.protocol import ring_path

log = get_logger(__name__)

#: Receiver thread's poll period: the longest the rings go unread while the agent thread is busy
#: (e.g. collecting stacks), and the bound on how long close() waits for the thread.
_RECV_POLL_S = 0.2

#: ``on_datagram(message, monotonic time, sender address)``.
OnDatagram = Callable[[dict[str, Any], float, Any], None]
#: ``on_records(global rank, records, wall-clock offset to add to a record's monotonic time)``.
OnRecords = Callable[[int, list[_ring.StepRecord], float], None]


class Transport:
    """The socket the ranks send to (:attr:`address`), the step rings they write, and the thread
    that reads both into ``on_datagram`` / ``on_records``."""

    def __init__(self, run_dir: Path, on_datagram: OnDatagram, on_records: OnRecords,
                 ring_entries: int = _ring.DEFAULT_ENTRIES) -> None:
        self._on_datagram = on_datagram
        self._on_records = on_records
        self.lock = threading.Lock()
        """Held while a datagram or record is read and handled (see the module's contract)."""
        self.ring_entries = ring_entries
        self.ring_missed: dict[int, int] = {}
        """Step records per rank overwritten before the monitor read them, over the job."""
        # In the run directory when the path fits AF_UNIX's 107 bytes (then even a SIGKILLed
        # launcher leaves nothing outside it), else in a short temporary directory.
        in_run_dir = str((run_dir / "monitor.sock").resolve())
        self._sock_dir = None if len(in_run_dir) < 100 else tempfile.mkdtemp(prefix="robust-wd-")
        self.address = in_run_dir if self._sock_dir is None else os.path.join(self._sock_dir, "monitor.sock")
        if os.path.exists(self.address):
            os.unlink(self.address)  # left by a launcher that was killed; nobody listens there
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.address)
        self._ring_dir = _ring.ring_dir(run_dir)
        stale = _ring.sweep_stale(self._ring_dir)
        if stale:
            log.info("robust watchdog: removed %d step rings left in %s by launchers that are gone",
                     len(stale), self._ring_dir)
        self._ring_seq = 0
        self._rings: dict[int, _ring.RingReader] = {}
        """This incarnation's step rings by global rank (read under :attr:`lock`)."""
        self._pending_rings: dict[int, _ring.RingReader] = {}
        """Rings created for the next incarnation, attached by :meth:`attach_rings`."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="robust-watchdog-recv", daemon=True)
        self._thread.start()

    # -- rings -----------------------------------------------------------------------------------
    def create_rings(self, ranks: Iterable[int]) -> str:
        """Create the next incarnation's rings (replacing rings made for a start that did not
        happen); returns their path prefix, or "" (said in a warning) when they cannot be made."""
        with self.lock:
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

    def attach_rings(self, ranks: Iterable[int]) -> None:
        """The new incarnation's ``ranks`` started: read their pending rings from now on, and close
        the previous incarnation's rings and those made for ranks that did not start. Under
        :attr:`lock` (see :meth:`held`)."""
        ranks = set(ranks)
        old, self._rings = self._rings, {r: g for r, g in self._pending_rings.items() if r in ranks}
        self._close_rings(old)
        self._close_rings({r: g for r, g in self._pending_rings.items() if r not in ranks})
        self._pending_rings = {}

    def unlink_ring(self, rank: int) -> None:
        """Remove ``rank``'s ring from the file system (both sides have it mapped), so nothing is
        left in /dev/shm whatever happens to either process later."""
        ring = self._rings.get(rank)
        if ring is not None:
            ring.unlink()

    def heartbeat(self, now: float) -> None:
        """Tell every rank that detection is live (the ranks warn when this goes stale)."""
        with self.lock:
            for ring in self._rings.values():
                ring.heartbeat(now)

    @staticmethod
    def _close_rings(rings: dict[int, _ring.RingReader]) -> None:
        for ring in rings.values():
            ring.close()

    # -- receiving -------------------------------------------------------------------------------
    def alive(self) -> bool:
        """Whether the receiver thread still runs (it ends only at :meth:`close`)."""
        return self._thread.is_alive()

    def drain(self) -> None:
        """Hand over every datagram already queued and every record in the rings, now: a rank's
        last words (an injected fault's announcement, its last steps) are known before its exit
        is judged, however late the receiver thread got scheduled."""
        with self.lock:
            self._drain_locked()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Drain, then keep :attr:`lock` for the block: nothing arrives while the caller changes
        what the handlers see (a new incarnation)."""
        with self.lock:
            self._drain_locked()
            yield

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                select.select([self._sock], [], [], _RECV_POLL_S)
            except (OSError, ValueError):
                return  # socket closed
            # On a datagram, or every _RECV_POLL_S: the rings are read even while the agent
            # thread is busy, so they cannot be lapped unless a rank outruns this poll.
            self.drain()

    def _drain_locked(self) -> None:
        while True:
            try:
                data, addr = self._sock.recvfrom(65536, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            try:
                self._on_datagram(json.loads(data), time.monotonic(), addr)
            except Exception as exc:  # one bad datagram must not end the receiver
                log.warning("robust watchdog: dropped a malformed signal (%d bytes): %r",
                            len(data), exc)
        self._poll_rings()

    def _poll_rings(self) -> None:
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
            if records:
                self._on_records(rank, records, wall_offset)

    # -- sending and closing -----------------------------------------------------------------------
    def send(self, addr: Any, message: dict[str, Any], block: bool = True) -> None:
        """One datagram to a rank's listener; raises OSError when the rank is gone (or, with
        ``block=False``, when its buffer is full)."""
        self._sock.sendto(json.dumps(message).encode(), 0 if block else socket.MSG_DONTWAIT, addr)

    def close(self) -> None:
        """Stop the receiver, remove the socket and the step rings."""
        self._stop.set()
        self._thread.join(timeout=2 * _RECV_POLL_S + 1.0)
        with self.lock:
            self._close_rings(self._rings)
            self._close_rings(self._pending_rings)
            self._rings, self._pending_rings = {}, {}
        self._sock.close()
        try:
            os.unlink(self.address)
            if self._sock_dir is not None:
                os.rmdir(self._sock_dir)
        except OSError:
            pass

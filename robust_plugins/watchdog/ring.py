"""Shared-memory step rings: how a rank reports every step to the node monitor without a system call.

Why not a datagram a step: on a node whose cores are all busy training, a rank's ``sendto`` wakes
the monitor's receiver thread on the sender's core while the rank waits (BENCHMARKS.md has the
cost), and a Unix datagram queue holds only ``net.unix.max_dgram_qlen`` (10) datagrams, so a
monitor that drains on a timer would lose signals.

Here each rank writes its steps into a ring of fixed-size records in a shared-memory file, and
the monitor reads every rank's ring when it polls (every ~0.1-0.2 s): no wake-up and no system
call a step on the rank, and nothing is dropped unless a rank laps its ring between two polls, in
which case the reader knows exactly how many records it lost.

One ring per rank and incarnation, created by the monitor (:meth:`RingReader.create`), mapped by
the rank (:class:`RingWriter`). Layout, little-endian:

- header, 64 bytes: magic ``RWDR``, version, capacity, record size (uint32 each); the monitor's
  heartbeat, the monotonic time of its latest poll (float64), and a CRC-32 of it (uint32);
- ``capacity`` records of 64 bytes: entry index, step (int64 each); loss, gradient norm, seconds
  since the previous step's end, of which inside collectives, the monotonic time of the step's
  end (float64 each); flags saying which of the four optional values are present (uint32); a
  CRC-32 of the 60 bytes before it (uint32).

Entry ``n`` goes to slot ``n % capacity``. The writer never reads and never waits. The reader keeps
a cursor, the index of the next entry it expects, and consumes slots while they hold exactly
that entry. Torn records: neither side has memory fences (Python offers none, and ``struct``
may store byte by byte), so a record caught half-written, or one whose stores became visible out
of order on a weakly ordered CPU, is recognised by its CRC, which covers the entry index (a 1 in
2**32 chance of passing), and the reader stops there and retries at the next poll. A slot
holding a *later* entry ``m`` (``m = n + k * capacity``) means the writer lapped the reader:
entries ``n .. m - capacity`` were overwritten, so the reader counts them as missed and moves its
cursor to ``m - capacity + 1``, the oldest entry that may still be there. Every entry is thus
either read or counted missed, never silently lost. ``CLOCK_MONOTONIC`` is one clock for every
process of a host, so the monitor judges progress by the rank's own step-end times rather than
by when it happened to poll.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import struct
import time
import zlib
from pathlib import Path
from typing import NamedTuple

from robust_plugins.errors import RobustPluginsError

MAGIC = b"RWDR"
VERSION = 1
HEADER_SIZE = 64
RECORD_SIZE = 64

#: Entries a ring holds. 8192 x 64 bytes = 512 KiB a rank. The monitor polls every 0.2 s at the
#: latest (its receiver thread) and every monitor interval (0.1 s by default) from the agent, so a
#: ring overflows only if a rank completes 8192 steps between two polls: 100 us steps would need
#: the monitor to stall for 0.8 s. If it happens, the monitor logs how many entries it missed.
DEFAULT_ENTRIES = 8192

_HEAD = struct.Struct("<4sIII")
_BEAT = struct.Struct("<dI")
_BEAT_AT = _HEAD.size
_BODY = struct.Struct("<qqdddddI")
_CRC = struct.Struct("<I")
assert _BODY.size + _CRC.size == RECORD_SIZE and _BEAT_AT + _BEAT.size <= HEADER_SIZE

_HAS_LOSS, _HAS_GRAD, _HAS_WALL, _HAS_COMM = 1, 2, 4, 8

#: File names: ``robust-wd-<launcher pid>-<random>-<sequence>-rank<R>``; the pid lets a later
#: launcher remove what a SIGKILLed one left in /dev/shm (:func:`sweep_stale`).
_NAME = re.compile(r"^robust-wd-(\d+)-[0-9a-f]+-\d+-rank\d+$")


class RingError(RobustPluginsError):
    """A ring file that is not what this version of robust_plugins writes."""


class StepRecord(NamedTuple):
    """One step as a rank wrote it; ``None`` for a value it did not report."""

    index: int
    step: int
    loss: float | None
    grad_norm: float | None
    wall_s: float | None
    """Seconds since the rank's previous step end (None at its first step)."""
    comm_s: float | None
    """Of ``wall_s``, seconds inside torch.distributed collectives (None unless timed)."""
    t_mono: float
    """``time.monotonic()`` on the rank when the step ended."""


def ring_dir(run_dir: str | os.PathLike) -> Path:
    """Where rings go: ``/dev/shm`` (memory; nothing is ever written back to a disk) when it is
    a writable directory, else ``<run_dir>/rings``."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    path = Path(run_dir) / "rings"
    path.mkdir(parents=True, exist_ok=True)
    return path


def ring_prefix(directory: Path, sequence: int) -> str:
    """A unique path prefix for one incarnation's rings; rank ``r``'s ring is ``prefix + str(r)``."""
    return str(directory / f"robust-wd-{os.getpid()}-{secrets.token_hex(4)}-{sequence}-rank")


def sweep_stale(directory: Path) -> list[str]:
    """Remove ring files whose launcher (the pid in the name) is gone: what a SIGKILLed
    ``robust run`` left behind. Returns the removed names. Files of live launchers are kept."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m is None or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        try:
            os.unlink(directory / name)
            removed.append(name)
        except OSError:
            pass
    return removed


def _beat(t: float) -> bytes:
    raw = struct.pack("<d", t)
    return raw + _CRC.pack(zlib.crc32(raw))


def _map(path: str, writable_size: int | None = None) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if writable_size is not None else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if writable_size is not None:
            os.ftruncate(fd, writable_size)
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE:
            raise RingError(f"step ring {path} has {size} bytes, less than its {HEADER_SIZE}-byte "
                            f"header: not a robust_plugins ring")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class RingWriter:
    """The rank's end of a ring: :meth:`write` one record a step (about a microsecond, no system
    call). Raises :class:`RingError` for a file of another format or version, ``OSError`` when
    the file cannot be opened."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mm = _map(path)
        magic, version, capacity, record = _HEAD.unpack_from(self._mm, 0)
        if (magic, version, record) != (MAGIC, VERSION, RECORD_SIZE) or capacity < 1 or \
                len(self._mm) < HEADER_SIZE + capacity * RECORD_SIZE:
            self._mm.close()
            raise RingError(f"step ring {path}: header {magic!r} version {version}, {capacity} records "
                            f"of {record} bytes; expected {MAGIC!r} version {VERSION}, {RECORD_SIZE}-byte "
                            f"records (the launcher and the ranks must run the same robust_plugins)")
        self.capacity = capacity
        self.written = 0
        """Entries written so far (the next entry's index)."""

    def write(self, step: int, loss: float | None, grad_norm: float | None,
              wall_s: float | None, comm_s: float | None, t_mono: float) -> None:
        """Append one step's record."""
        flags = ((loss is not None) * _HAS_LOSS | (grad_norm is not None) * _HAS_GRAD
                 | (wall_s is not None) * _HAS_WALL | (comm_s is not None) * _HAS_COMM)
        body = _BODY.pack(self.written, step, loss or 0.0, grad_norm or 0.0, wall_s or 0.0,
                          comm_s or 0.0, t_mono, flags)
        off = HEADER_SIZE + (self.written % self.capacity) * RECORD_SIZE
        # One copy of the whole record; the CRC lets the reader reject it if it sees it half-done.
        self._mm[off:off + RECORD_SIZE] = body + _CRC.pack(zlib.crc32(body))
        self.written += 1

    def monitor_heartbeat(self) -> float | None:
        """The monotonic time of the monitor's latest poll, or None if caught half-written."""
        t, crc = _BEAT.unpack_from(self._mm, _BEAT_AT)
        return t if zlib.crc32(struct.pack("<d", t)) == crc else None

    def close(self) -> None:
        """Unmap (the file itself is the monitor's to remove)."""
        self._mm.close()


class RingReader:
    """The monitor's end of a ring: :meth:`poll` returns the records written since the last poll
    and how many were overwritten before it could read them."""

    def __init__(self, path: str, mm: mmap.mmap, capacity: int) -> None:
        self.path = path
        self._mm = mm
        self.capacity = capacity
        self.cursor = 0
        """Index of the next entry expected: every entry below it was read or counted missed."""
        self.missed = 0
        """Entries overwritten before they were read, over the ring's life."""

    @classmethod
    def create(cls, path: str, capacity: int = DEFAULT_ENTRIES) -> "RingReader":
        """Create the ring file (mode 0600; refuses an existing path) and map it."""
        if not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"ring capacity = {capacity!r} must be an integer >= 2")
        mm = _map(path, HEADER_SIZE + capacity * RECORD_SIZE)
        _HEAD.pack_into(mm, 0, MAGIC, VERSION, capacity, RECORD_SIZE)
        mm[_BEAT_AT:_BEAT_AT + _BEAT.size] = _beat(time.monotonic())
        return cls(path, mm, capacity)

    def heartbeat(self, t_mono: float) -> None:
        """Tell the rank the monitor is reading (it warns when this goes stale)."""
        self._mm[_BEAT_AT:_BEAT_AT + _BEAT.size] = _beat(t_mono)

    def poll(self) -> tuple[list[StepRecord], int]:
        """``(records, missed)``: the new records in order, and entries lost since the last poll."""
        out: list[StepRecord] = []
        missed = 0
        mm, cap = self._mm, self.capacity
        # Bounded: a writer that keeps writing while we read cannot hold the monitor here.
        for _ in range(2 * cap):
            off = HEADER_SIZE + (self.cursor % cap) * RECORD_SIZE
            raw = mm[off:off + RECORD_SIZE]
            body = raw[:-_CRC.size]
            if zlib.crc32(body) != _CRC.unpack_from(raw, len(body))[0]:
                break  # never written yet, or being written right now: next poll
            index, step, loss, grad, wall, comm, t_mono, flags = _BODY.unpack(body)
            if index < self.cursor or index % cap != self.cursor % cap:
                break  # the previous lap's entry: the expected one is not written yet
            if index > self.cursor:
                # Lapped: entries up to index - cap were overwritten; index - cap + 1 may remain.
                oldest = index - cap + 1
                missed += oldest - self.cursor
                self.cursor = oldest
                continue
            out.append(StepRecord(
                index, step,
                loss if flags & _HAS_LOSS else None, grad if flags & _HAS_GRAD else None,
                wall if flags & _HAS_WALL else None, comm if flags & _HAS_COMM else None, t_mono))
            self.cursor += 1
        self.missed += missed
        return out, missed

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid); a no-op when it is already gone."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap and remove the file."""
        self.unlink()
        if not self._mm.closed:
            self._mm.close()


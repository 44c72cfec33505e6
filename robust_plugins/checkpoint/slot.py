"""The slot file of an in-memory snapshot: one file in ``/dev/shm``, mapped read-write.

A slot file is a 4 KiB header, the JSON schema of :mod:`~robust_plugins.checkpoint.flat` and the
tensor bytes, each tensor 64-byte aligned::

    0   magic "RPSNAP1\\0"   8  committed (u32)    12 format (u32)      16 step (i64)
    24  rank (i32)          28 world size (i32)  32 schema length     40 data offset
    48  data length         56 crc32 of schema + data                 64 job key (32 bytes)

:mod:`~robust_plugins.checkpoint.memory` writes and commits slots (the double buffer, the
snapshot thread); :mod:`~robust_plugins.checkpoint.peer` keeps copies of a peer's.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from robust_plugins.checkpoint import flat
from robust_plugins.errors import CheckpointError

MAGIC = b"RPSNAP1\0"
FORMAT = 1
HEADER_SIZE = 4096
_FIELDS = struct.Struct("<8sIIqiiQQQI")  # up to and including crc32 (60 bytes)
_JOB_OFF, _JOB_LEN = 64, 32
_COMMITTED_OFF = 8
_ALIGN = 64
#: crc32 in 64 MiB pieces: zlib releases the GIL for each call, so training threads keep running.
_CRC_CHUNK = 64 << 20


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a



@dataclass(frozen=True)
class Header:
    """The fixed fields of a slot file."""

    committed: bool
    step: int
    rank: int
    world_size: int
    schema_len: int
    data_off: int
    data_len: int
    crc: int
    job: str

    @property
    def total(self) -> int:
        """Bytes of the file that hold the snapshot."""
        return self.data_off + self.data_len


def read_header(buf: Any) -> Header | None:
    """The header of a mapped slot, or None if it is not a snapshot (wrong magic, too short)."""
    if len(buf) < HEADER_SIZE:
        return None
    magic, committed, fmt, step, rank, world, slen, doff, dlen, crc = _FIELDS.unpack_from(buf, 0)
    if magic != MAGIC or fmt != FORMAT:
        return None
    job = bytes(buf[_JOB_OFF:_JOB_OFF + _JOB_LEN]).rstrip(b"\0").decode("ascii", "replace")
    return Header(bool(committed), step, rank, world, slen, doff, dlen, crc, job)


def _crc(buf: Any, start: int, end: int) -> int:
    view = memoryview(buf)
    crc = 0
    for off in range(start, end, _CRC_CHUNK):
        crc = zlib.crc32(view[off:min(end, off + _CRC_CHUNK)], crc)
    view.release()
    return crc


class Slot:
    """One shared-memory file, mapped read-write; grown (never shrunk) when a snapshot needs it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self.busy = threading.Event()
        """Set while the background thread owns this slot (checksum, commit, peer send)."""
        self.unpin: Callable[[], Any] | None = None
        """Unregisters the mapping from CUDA (set by :mod:`~robust_plugins.checkpoint.devcopy`)."""

    def open_existing(self) -> bool:
        """Map the file if it exists (a previous incarnation's snapshot); False if absent."""
        if not os.path.exists(self.path):
            return False
        self._remap(None)
        return True

    def ensure(self, size: int) -> None:
        """Create or grow the file to at least ``size`` bytes and map it."""
        if self._map is not None and len(self._map) >= size:
            return
        self._remap(size)

    def _remap(self, size: int | None) -> None:
        self.unmap()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            have = os.fstat(fd).st_size
            if size is not None and have < size:
                try:
                    os.posix_fallocate(fd, 0, size)  # fail now (ENOSPC) rather than SIGBUS mid-copy
                except OSError as exc:
                    raise CheckpointError(
                        f"Cannot reserve {size / 2**20:.1f} MiB for an in-memory snapshot in {self.path} "
                        f"({exc}). /dev/shm is full or too small: enlarge it (docker --shm-size, or "
                        f"`mount -o remount,size=... /dev/shm`) or turn memory_every off."
                    ) from exc
                have = size
            if have == 0:
                os.close(fd)
                return
            self._fd, self._map = fd, mmap.mmap(fd, have)
        except BaseException:
            if self._fd is None:
                os.close(fd)
            raise
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    @property
    def buf(self) -> mmap.mmap:
        """The mapping (raises if the slot is not mapped)."""
        if self._map is None:
            raise CheckpointError(f"snapshot slot {self.path} is not mapped")
        return self._map

    def bytes(self) -> torch.Tensor:
        """The mapping as a uint8 tensor (shares memory with the file)."""
        if self._bytes is None:
            raise CheckpointError(f"snapshot slot {self.path} is not mapped")
        return self._bytes

    def header(self) -> Header | None:
        """The slot's header, or None when unmapped or not a snapshot."""
        return read_header(self._map) if self._map is not None else None

    def set_committed(self, value: bool) -> None:
        """Write the committed word (a single aligned 4-byte store)."""
        struct.pack_into("<I", self.buf, _COMMITTED_OFF, int(value))

    def write_header(self, h: Header) -> None:
        """Write every field but ``committed`` (left as it is: 0 during a save)."""
        committed = struct.unpack_from("<I", self.buf, _COMMITTED_OFF)[0]
        _FIELDS.pack_into(self.buf, 0, MAGIC, committed, FORMAT, h.step, h.rank, h.world_size,
                          h.schema_len, h.data_off, h.data_len, h.crc)
        job = h.job.encode("ascii")[:_JOB_LEN]
        self.buf[_JOB_OFF:_JOB_OFF + _JOB_LEN] = job.ljust(_JOB_LEN, b"\0")

    def problem(self, job: str, world_size: int, rank: int | None = None) -> str | None:
        """Why this slot must not be restored by ``rank`` of a ``world_size`` job, or None."""
        h = self.header()
        if h is None:
            return "not a snapshot (empty or wrong magic)"
        if not h.committed:
            return f"step {h.step} was never committed (the process died while writing it)"
        if h.job != job:
            return f"belongs to job {h.job}, not {job}"
        if h.world_size != world_size:
            return f"taken at world size {h.world_size}, this job has {world_size}"
        if rank is not None and h.rank != rank:
            return f"holds rank {h.rank}'s state, not rank {rank}'s"
        if h.total > len(self.buf):
            return f"truncated ({len(self.buf)} bytes, header says {h.total})"
        crc = _crc(self.buf, HEADER_SIZE, h.total)
        if crc != h.crc:
            return f"step {h.step}: crc32 {crc:08x} != {h.crc:08x} (corrupted)"
        return None

    def read(self, allowed: Mapping[str, type] | None = None) -> tuple[int, Any]:
        """(step, state) with every tensor cloned out of the mapping."""
        h = self.header()
        raw = bytes(self.buf[HEADER_SIZE:HEADER_SIZE + h.schema_len])
        try:
            schema = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"snapshot {self.path}: schema is not JSON ({exc})") from None
        specs = flat.tensor_specs(schema)
        offsets = schema.get("offsets")
        if not isinstance(offsets, list) or len(offsets) != len(specs):
            raise CheckpointError(f"snapshot {self.path}: schema has no offset for every tensor")
        data = self.bytes()
        tensors = []
        for (dtype, shape), off in zip(specs, offsets):
            n = _nbytes(dtype, shape)
            start = h.data_off + off
            if not isinstance(off, int) or off < 0 or start + n > h.total:
                raise CheckpointError(f"snapshot {self.path}: tensor at {off!r} lies outside the data")
            tensors.append(data[start:start + n].view(dtype).view(shape).clone())
        return h.step, flat.unflatten(schema, tensors, allowed)

    def unmap(self) -> None:
        """Drop the mapping (the file stays)."""
        if self.unpin is not None:
            self.unpin()
            self.unpin = None
        self._bytes = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()

"""GPU tensors into a snapshot slot: asynchronous copies on a side stream into pinned host memory.

A snapshot of CUDA state copied with a plain ``copy_`` into the slot's mapping (pageable
``/dev/shm`` memory) is synchronous: the training thread stalls for the whole copy, and the
order against the next optimizer step rests on everything running on the default stream. Here,
for a snapshot holding CUDA tensors (:func:`for_tensors`):

* the slot's mapping is registered with CUDA (``cudaHostRegister``: pinned), so device-to-host
  copies into it are asynchronous DMA at full PCIe bandwidth;
* the copies run on a side stream that first waits for an event the caller recorded on its
  current stream at ``save`` (the state as the caller's kernels left it, whatever stream the
  training loop uses);
* the caller's stream waits (on the device, not the host) for the copies made inside ``save``
  (residuals, RNG, registered state: what may change before the next step), so nothing it
  queues afterwards overwrites them before they are copied;
* the snapshot thread sets the device first, queues the deferred copies (parameters, optimizer
  state) on the same stream and waits for an event after the last copy before the version check,
  the crc32 and the commit flag: a committed snapshot's bytes have all landed.

CPU tensors are copied as before, with ``copy_`` on the calling thread. Nothing here runs on a
machine without CUDA: :func:`for_tensors` returns None there, and the selection is unit-tested.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from robust_plugins._logging import get_logger, warn_once
from robust_plugins.device import current_stream, record_event, set_thread_device, side_stream

log = get_logger(__name__)


def snapshot_device(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The CUDA device whose tensors a snapshot copies asynchronously, or None (pure): the first
    CUDA tensor's device; None when every tensor is on the host (or on another device type)."""
    return next((t.device for t in tensors if t.device.type == "cuda"), None)


def for_tensors(tensors: Sequence[torch.Tensor], slot: Any) -> "DeviceCopier | None":
    """A :class:`DeviceCopier` for this snapshot of ``tensors`` into ``slot``, or None (host only)."""
    device = snapshot_device(tensors)
    return None if device is None else DeviceCopier(device, slot)


def copy_into(dst: torch.Tensor, src: torch.Tensor, copier: "DeviceCopier | None") -> None:
    """``dst.copy_(src)``; asynchronous on the copier's stream when ``src`` is a CUDA tensor."""
    if copier is None or src.device.type != "cuda":
        dst.copy_(src)
    else:
        copier.copy(dst, src)


def _pin(slot: Any) -> None:
    """Register ``slot``'s whole mapping with CUDA once; :meth:`Slot.unmap` unregisters it."""
    if slot.unpin is not None:
        return
    data = slot.bytes()
    cudart = torch.cuda.cudart()
    ptr, size = data.data_ptr(), data.numel()
    rc = cudart.cudaHostRegister(ptr, size, 0)
    if int(rc) != 0:
        # Still correct, only synchronous: the copies then stall the training thread as before.
        warn_once(log, "snapshot-pin", "robust_plugins: cannot pin the %.0f MiB snapshot slot %s (cudaHostRegister "
                  "error %s; check `ulimit -l`): GPU snapshots copy synchronously into pageable memory",
                  size / 2**20, slot.path, int(rc))
        return
    slot.unpin = lambda: cudart.cudaHostUnregister(ptr)


class DeviceCopier:
    """The copies of one snapshot from ``device`` into ``slot`` (see the module docstring)."""

    def __init__(self, device: torch.device, slot: Any) -> None:
        self.device = device
        _pin(slot)
        self.stream = side_stream(device)
        # The state as of this save: the copies start after what the caller has queued so far.
        self.stream.wait_event(record_event(current_stream(device)))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on the side stream; ``src``'s memory is kept until it ran."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)

    def fence_inline(self) -> None:
        """After ``save``'s own copies: the caller's stream waits for them (a device-side wait)."""
        current_stream(self.device).wait_event(record_event(self.stream))

    def on_thread(self) -> None:
        """First call on the snapshot thread: that thread's current device is this one."""
        set_thread_device(self.device)

    def finish(self) -> None:
        """Block until every copy queued so far has landed in host memory (before crc and commit)."""
        record_event(self.stream).synchronize()

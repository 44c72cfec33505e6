"""The device a process group's collectives need: CUDA tensors on NCCL, CPU tensors on gloo.

Every collective the package issues on its own (flags, probes, coordination, trials) allocates its
tensors through :func:`collective_device`, so a job on NCCL never hands NCCL a CPU tensor ("No
backend type associated with device type cpu") and a job on gloo never touches a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from robust_plugins._logging import get_logger

log = get_logger(__name__)

# Backends that only move device memory, and the torch device type each one needs.
_DEVICE_ONLY_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}


def device_type_for_backend(backend: str) -> str:
    """Device type ("cuda", "cpu", ...) whose tensors the backend named ``backend`` can move.

    ``backend`` is what ``dist.get_backend`` returns: a plain name ("nccl", "gloo") or a
    per-device list ("cpu:gloo,cuda:nccl"). A list that includes a device-only backend answers
    that backend's device, so probes and trials time the path gradients take.
    """
    name = str(backend).lower()
    for part in name.split(","):
        leaf = part.split(":")[-1].strip()
        if leaf in _DEVICE_ONLY_BACKENDS:
            return _DEVICE_ONLY_BACKENDS[leaf]
    return "cpu"


def collective_device(group=None) -> torch.device:
    """The device for tensors passed to collectives on ``group`` (the default group if None)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    kind = device_type_for_backend(dist.get_backend(group))
    if kind == "cuda":
        # The rank's own GPU: set by the host (torch.cuda.set_device / LOCAL_RANK) before it
        # built the NCCL group; index 0 here would aim at another rank's device.
        return torch.device("cuda", torch.cuda.current_device())
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    return torch.device(kind, module.current_device())


def set_thread_device(device: torch.device | str | None) -> None:
    """Make ``device`` the current device of the calling thread (a no-op for CPU and None).

    The first call of every background thread that launches device work: the current device is
    per thread, and a new thread starts on GPU 0. Triton launches on the thread's current device
    and stream, and NCCL builds a communicator's first connection on it, so a thread of a rank
    whose GPU is not 0 would otherwise run its kernels on another rank's GPU.
    """
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cpu":
        return
    getattr(torch, device.type).set_device(device)


def side_stream(device: torch.device | str | None):
    """A new stream on ``device`` for work beside the training thread's stream; None on CPU.

    CPU work has no streams: callers keep their CPU path as it is whenever this returns None.
    """
    if device is None or torch.device(device).type == "cpu":
        return None
    device = torch.device(device)
    return getattr(torch, device.type).Stream(device=device)


def current_stream(device: torch.device | str | None):
    """The calling thread's current stream on ``device``; None on CPU."""
    if device is None or torch.device(device).type == "cpu":
        return None
    device = torch.device(device)
    return getattr(torch, device.type).current_stream(device)


def on_stream(stream):
    """``stream`` as the calling thread's current stream inside a ``with`` block (nothing for None:
    CPU work has no streams)."""
    if stream is None:
        return contextlib.nullcontext()
    return getattr(torch, stream.device.type).stream(stream)


def record_event(stream):
    """An event recorded on ``stream`` now (work queued there before it); None for no stream."""
    if stream is None:
        return None
    event = getattr(torch, stream.device.type).Event()
    event.record(stream)
    return event


# Sizes that trade launch count against overlap, by device type. On CPU over gloo the codec's
# time is host time, so buckets and pieces are small enough to keep encoding behind the link
# (BENCHMARKS.md: 4 MB buckets, 2**19-element pieces). On a GPU over NCCL the codec runs at HBM
# speed and each collective costs a launch plus NCCL's protocol start (tens of microseconds), so
# thousands of small calls would be the cost: buckets of 25 MB, PyTorch DDP's bucket_cap_mb, and
# pieces of 2**22 elements (a 25 MB bucket's chunk is one piece over two or more ranks). The GPU
# values are chosen by that reasoning, not measured (no GPU has run them).
BUCKET_MB = {"cpu": 4.0, "cuda": 25.0}
PIECE_NUMEL = {"cpu": 1 << 19, "cuda": 1 << 22}


def default_bucket_mb(device_type: str) -> float:
    """Default gradient bucket size (MB) for tensors on ``device_type``; CPU's for unknown types."""
    return BUCKET_MB.get(str(device_type), BUCKET_MB["cpu"])


def default_piece_numel(device_type: str) -> int:
    """Default piece of a pipelined compressed all-reduce for ``device_type``; CPU's for unknown."""
    return PIECE_NUMEL.get(str(device_type), PIECE_NUMEL["cpu"])


def synchronize(device: torch.device | str | None) -> None:
    """Wait until ``device`` finished the work queued on it (a no-op on CPU and for None).

    For host timers around device work that has no event-based clock, e.g. the heat map's
    point-to-point probe: on NCCL ``recv`` returns once queued, not once the bytes arrived.
    """
    if device is None or torch.device(device).type == "cpu":
        return
    device = torch.device(device)
    getattr(torch, device.type).synchronize(device)


def device_rng_state() -> torch.Tensor | None:
    """The default CUDA generator's state of this rank's (current) device; None without CUDA in use.

    One state, of the device this rank trains on: saving every visible GPU's
    (``get_rng_state_all``) ties a checkpoint to the device count it was saved with, and a
    restart with one visible GPU per rank could not load it.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.get_rng_state(torch.cuda.current_device())


def set_device_rng_state(state: Any) -> None:
    """Restore :func:`device_rng_state`'s ``state`` on the current device (None: nothing saved).

    A list (every visible GPU's, as snapshots before this helper saved) restores the current
    device's entry. A state saved on a GPU loaded where CUDA is unavailable is logged, not
    applied: that run cannot continue bitwise anyway.
    """
    if state is None:
        return
    if not torch.cuda.is_available():
        log.warning("robust_plugins: the checkpoint holds a CUDA generator state, but CUDA is not available "
                    "here; GPU random numbers are not restored")
        return
    index = torch.cuda.current_device()
    if isinstance(state, (list, tuple)):
        if index >= len(state):
            raise ValueError(f"the saved CUDA generator states cover {len(state)} device(s); this rank's "
                             f"device is cuda:{index}")
        state = state[index]
    torch.cuda.set_rng_state(state, index)


def thread_device() -> torch.device | None:
    """The calling thread's current CUDA device (None without CUDA in use): what a thread it
    starts must :func:`set_thread_device` first."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.device("cuda", torch.cuda.current_device())

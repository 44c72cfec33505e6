"""The device a process group's collectives need: CUDA tensors on NCCL, CPU tensors on gloo.

Every collective the package issues on its own (flags, probes, coordination, trials) allocates its
tensors through :func:`collective_device`, so a job on NCCL never hands NCCL a CPU tensor ("No
backend type associated with device type cpu") and a job on gloo never touches a GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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

"""Bounded agreement between ranks for checkpointing: JSON values over torch.distributed.

Every collective here is started asynchronously and waited for at most ``timeout_s``; a rank
that does not answer turns into a :class:`~robust_plugins.errors.CheckpointError` naming the
step that timed out, instead of a hang. Values travel as JSON text in uint8 tensors, never as
pickles, so a peer cannot make this process run code. Without an initialized process group
(one process) the functions return the local value.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

from robust_plugins.device import collective_device
from robust_plugins.errors import CheckpointError


def _distributed(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CheckpointError(
            f"{what}: not every rank answered within {timeout_s:g} s ({exc}). A rank is stuck or "
            f"dead; see its log. Raise robust_plugins.checkpoint.timeout_s if saves are just slow."
        ) from exc


def all_gather_json(value: Any, timeout_s: float, what: str, device: torch.device | str | None = None,
                    group: Any = None) -> list[Any]:
    """Every rank's ``value`` (JSON-serializable), in rank order (of ``group``; default: world).

    ``device``: where the tensors live; None (default) is what ``group``'s backend moves
    (:func:`~robust_plugins.device.collective_device`: CUDA on NCCL, CPU on gloo)."""
    if not _distributed(group):
        return [json.loads(json.dumps(value))]
    device = collective_device(group) if device is None else device
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    _wait(dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=device),
                          group=group, async_op=True), timeout_s, what)
    longest = int(max(t.item() for t in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    chunks = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    _wait(dist.all_gather(chunks, padded, group=group, async_op=True), timeout_s, what)
    return [json.loads(c[: int(n.item())].cpu().numpy().tobytes().decode()) for c, n in zip(chunks, lengths)]


def broadcast_json(value: Any, timeout_s: float, what: str, src: int = 0,
                   device: torch.device | str | None = None, group: Any = None) -> Any:
    """Global rank ``src``'s ``value`` on every rank of ``group`` (others' ``value`` is ignored;
    ``device`` as in :func:`all_gather_json`)."""
    if not _distributed(group):
        return json.loads(json.dumps(value))
    device = collective_device(group) if device is None else device
    is_src = dist.get_rank() == src
    data = json.dumps(value).encode() if is_src else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    _wait(dist.broadcast(length, src, group=group, async_op=True), timeout_s, what)
    buf = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if is_src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    _wait(dist.broadcast(buf, src, group=group, async_op=True), timeout_s, what)
    return json.loads(buf.cpu().numpy().tobytes().decode())


def barrier(timeout_s: float, what: str, device: torch.device | str | None = None) -> None:
    """Wait (at most ``timeout_s``) until every rank got here (``device`` as in :func:`all_gather_json`)."""
    if _distributed():
        device = collective_device() if device is None else device
        _wait(dist.all_reduce(torch.zeros(1, device=device), async_op=True), timeout_s, what)

"""Compressed gradient communication: collectives, their state, a DDP hook and a byte counter.

Nothing here imports DeepSpeed or megatron-core; host integrations live in ``patches/``.
"""

from __future__ import annotations

from robust_plugins.comm.collectives import compressed_all_reduce, compressed_reduce, compressed_reduce_scatter
from robust_plugins.comm.ddp_hook import ddp_comm_hook
from robust_plugins.comm.momentum import SignMomentumAdam
from robust_plugins.comm.state import CompressionState
from robust_plugins.comm.wire import WireCounter

__all__ = [
    "CompressionState",
    "SignMomentumAdam",
    "WireCounter",
    "compressed_all_reduce",
    "compressed_reduce",
    "compressed_reduce_scatter",
    "ddp_comm_hook",
]

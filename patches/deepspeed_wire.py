"""DeepSpeed's comm backend as seen by the wire counters (``robust_plugins.comm.WireCounter``).

DeepSpeed's ``TorchBackend`` (``deepspeed/comm/torch.py``) binds ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` to its instance (``cdb.all_gather_function``,
``cdb.reduce_scatter_function``) when the backend is built, so wrapping torch's module misses
ZeRO's parameter all-gathers and gradient reduce-scatters. :func:`install` registers this
backend's two attributes with the counters; a backend without them (another DeepSpeed) is an
error when a counter opens, not a silent undercount.
"""

from __future__ import annotations

import sys
from typing import Any

from robust_plugins.comm.wire import register_bound_collectives
from robust_plugins.errors import HostVersionError
from robust_plugins.patches import _ranges

#: The backend's attribute -> the torch function it holds (DeepSpeed 0.19).
BOUND = {"all_gather_function": "all_gather_into_tensor", "reduce_scatter_function": "reduce_scatter_tensor"}


def bound_collectives() -> list[tuple[Any, str, str]]:
    """``(cdb, attribute, torch name)`` for the built backend; nothing before it is built."""
    cdb = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    if cdb is None:
        return []
    missing = [attr for attr in BOUND if not callable(getattr(cdb, attr, None))]
    if missing:
        raise HostVersionError(
            f"DeepSpeed's comm backend ({type(cdb).__name__}) has no {', '.join(missing)}: the wire "
            f"counters cannot see ZeRO's all-gathers and reduce-scatters. robust_plugins supports "
            f"deepspeed {_ranges.DEEPSPEED.spec} here; install it or turn telemetry off.")
    return [(cdb, attr, name) for attr, name in BOUND.items()]


def install() -> None:
    """Register :func:`bound_collectives` with the wire counters (idempotent)."""
    register_bound_collectives(bound_collectives)

"""The one config schema for the ``robust_plugins`` block: the stable import surface.

The same frozen pydantic models (``robust_plugins/schema/``, one module a sub-block) are built
from a DeepSpeed JSON config (``"robust_plugins": {...}``), from keyword arguments (megatron-core
and plain PyTorch users) and by ``robust check-config`` (``--schema`` prints their JSON Schema;
docs/config.md is generated from their field descriptions). Every user mistake raises
:class:`~robust_plugins.errors.ConfigError` naming the key, the bad value and what is allowed;
unknown keys get a "did you mean". The models import pydantic, so they load on first use:
``import robust_plugins`` and the constants here stay cheap.

Environment variables (all in one place, all with the ``ROBUST_`` prefix). Set by users:

=============================  ======================================================================
``ROBUST_CODEC``               replaces ``compression.codec`` (e.g. ``none`` to bisect a run)
``ROBUST_DISABLE=1``           ignores the whole block: the host behaves exactly as without it
``ROBUST_JOB_ID``              names a job's in-memory snapshots (same across restarts; ``robust run``
                               sets it from the run directory when unset)
``ROBUST_TOPOLOGY_SIM=NxM``    simulated topology, N nodes x M ranks (``robust_plugins.topology``)
``ROBUST_TRITON_ON_CPU=1``     with ``TRITON_INTERPRET=1``: run the Triton kernels on CPU tensors
``ROBUST_WATCHDOG_NO_PYSPY=1`` hang stacks via faulthandler instead of py-spy
=============================  ======================================================================

Set by ``robust run`` for its ranks (named in ``robust_plugins.watchdog.protocol``; not for users):
``ROBUST_WATCHDOG_SOCKET``, ``ROBUST_WATCHDOG_RING`` (path prefix of the ranks' shared-memory
step rings), ``ROBUST_RUN_DIR``, ``ROBUST_INJECT``, ``ROBUST_INCARNATION``,
``ROBUST_SDC_EVERY``, ``ROBUST_ROLLBACK_MAX_STEP`` (newest step a rollback's ranks may restore
from memory), ``ROBUST_STRAGGLER`` (1: time collectives for the straggler detector),
``ROBUST_SKIP_STEPS`` (steps whose batch spiked twice: ``watchdog.skip_batch``), ``ROBUST_SPIKE``
(the spike rule a rank holds by), ``ROBUST_SPIKE_WINDOWS`` (the monitor's spike windows a restarted
rank starts from),
``ROBUST_LAUNCH_WORLD_SIZE`` (world size of the job's first incarnation: ``watchdog.grad_accumulation``
says how accumulation changed after a ``--nnodes MIN:MAX`` shrink), ``ROBUST_EMERGENCY_TIMEOUT_S``
(bound of a rank's emergency save: ``watchdog.on_emergency``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from robust_plugins.schema.common import (  # noqa: F401  (re-exported)
    AUTO_CANDIDATES,
    AUTO_CODEC,
    BF16_ALLREDUCE,
    BLOCK_KEY,
    BLOCK_SIZE_MAX,
    BLOCK_SIZE_MIN,
    CODECS,
    CODECS_REQUIRING_EF,
    DEFAULT_BUCKET_MB,
    ENV_OVERRIDES,
    MEMORY_COPY_MODES,
    SIGN_MODES,
    VERIFY_MODES,
    WANDB_MODES,
    load_json,
)

if TYPE_CHECKING:
    from robust_plugins.schema.checkpoint import CheckpointConfig
    from robust_plugins.schema.compression import CompressionConfig
    from robust_plugins.schema.plugin import PluginConfig
    from robust_plugins.schema.telemetry import TelemetryConfig, WandbConfig
    from robust_plugins.schema.topology import TopologyConfig
    from robust_plugins.schema.watchdog import WatchdogConfig

#: Model name -> the ``robust_plugins.schema`` module defining it (imported on first access).
_MODELS = {
    "PluginConfig": "plugin", "CompressionConfig": "compression", "WatchdogConfig": "watchdog",
    "CheckpointConfig": "checkpoint", "TelemetryConfig": "telemetry", "WandbConfig": "telemetry",
    "TopologyConfig": "topology",
}

__all__ = [
    "AUTO_CANDIDATES", "AUTO_CODEC", "BF16_ALLREDUCE", "BLOCK_KEY", "BLOCK_SIZE_MAX", "BLOCK_SIZE_MIN",
    "CODECS", "CODECS_REQUIRING_EF", "DEFAULT_BUCKET_MB", "ENV_OVERRIDES", "MEMORY_COPY_MODES",
    "SIGN_MODES", "VERIFY_MODES", "WANDB_MODES", "load_json", *_MODELS,
]


def __getattr__(name: str) -> Any:
    module = _MODELS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"robust_plugins.schema.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODELS))

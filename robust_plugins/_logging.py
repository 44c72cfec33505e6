"""Library logging: loggers under ``robust_plugins``, no handlers added, rank-0 helpers.

The library never configures the root logger (an application's job). ``log_rank0`` exists
because a message every rank would repeat (4 096 copies on a big job) is noise.
"""

from __future__ import annotations

import logging
import os

ROOT = "robust_plugins"


def get_logger(name: str) -> logging.Logger:
    """Return a logger under the ``robust_plugins`` hierarchy."""
    if not name.startswith(ROOT):
        name = f"{ROOT}.{name}"
    return logging.getLogger(name)


def current_rank() -> int:
    """Global rank from torch.distributed when initialised, else from the launcher's env."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return int(os.environ.get("RANK", "0"))


def log_rank0(logger: logging.Logger, level: int, msg: str, *args) -> None:
    """Log on global rank 0 only, prefixed with the rank."""
    if current_rank() == 0:
        logger.log(level, "[rank 0] " + msg, *args)


def warn_once(logger: logging.Logger, key: str, msg: str, *args) -> None:
    """Warn once per process for ``key`` (loud, but not once per step)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    logger.warning(msg, *args)


_WARNED: set[str] = set()

"""Library logging: loggers under ``robust_plugins``, no handlers added, rank-0 helpers.

The library never configures the root logger (an application's job). ``log_rank0`` exists
because a message every rank would repeat (4 096 copies on a big job) is noise. ``announce`` is for
the few lines the README tells users to look for (features active, resume, faults): they must show
under the HF Trainer, Accelerate and plain scripts alike, where nobody configured logging.
"""

from __future__ import annotations

import logging
import os
import sys

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


def announce(logger: logging.Logger, msg: str, *args, all_ranks: bool = False) -> None:
    """Print a line users look for on rank 0 (every rank with ``all_ranks``), the way DeepSpeed
    prints the lines it means to be seen: ``deepspeed.utils.logging.print_dist``, i.e.
    ``print("[Rank R] ...")`` on stdout, whatever the log levels.

    Why not a log record: DeepSpeed 0.19's logger is at WARNING (its INFO lines never show), our
    ``robust_plugins`` logger has no handler, and the Trainer configures neither, so an INFO record
    is invisible there. The record still goes to ``logger`` at DEBUG, for applications that route
    the library's logs themselves; no handler is added and the root logger is never touched.
    """
    text = msg % args if args else msg
    rank = current_rank()
    logger.debug(text)
    if all_ranks or rank == 0:
        print(f"[Rank {rank}] {text}", flush=True)


def warn_once(logger: logging.Logger, key: str, msg: str, *args) -> None:
    """Warn once per process for ``key`` (loud, but not once per step)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    logger.warning(msg, *args)


_WARNED: set[str] = set()

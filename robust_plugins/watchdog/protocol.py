"""What the launcher (agent, node monitor) and the ranks it starts agree on: the environment variables
it sets for each incarnation and the formats of their values.

The launcher side writes these (:meth:`.monitor.Monitor.worker_env`, the agent); the rank side
(:mod:`.client`, :mod:`.hold`, :mod:`.emergency_rank`) reads them. A leaf: it imports nothing of
ours, so either side can name the protocol without importing the other.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The node monitor's Unix datagram socket. Unset outside ``robust run``: every watchdog call of
#: a rank is then a no-op.
ENV_SOCKET = "ROBUST_WATCHDOG_SOCKET"
#: Path prefix of the ranks' step rings (:func:`ring_path`); empty: a datagram a step instead.
ENV_RING = "ROBUST_WATCHDOG_RING"
#: The run directory (stack dumps, flight records, telemetry).
ENV_RUN_DIR = "ROBUST_RUN_DIR"
#: Armed fault injections (``robust run --inject``), in :func:`.inject.to_env`'s format.
ENV_INJECT = "ROBUST_INJECT"
#: The incarnation number (0 for the first start, +1 at each restart or rollback).
ENV_INCARNATION = "ROBUST_INCARNATION"
#: Compare parameter hashes every this many steps (``sdc_every_steps``; 0: never).
ENV_SDC_EVERY = "ROBUST_SDC_EVERY"
#: ``"1"``: time collectives for the straggler detector.
ENV_STRAGGLER = "ROBUST_STRAGGLER"
#: Steps whose batch must be skipped (:func:`format_skip_steps`).
ENV_SKIP = "ROBUST_SKIP_STEPS"
#: The rank's spike detector: ``"<factor>,<window>,<warmup steps>"`` (:class:`.hold.SpikeWatch`).
ENV_SPIKE = "ROBUST_SPIKE"
#: Seconds a rank may spend in its emergency save (``emergency_save_timeout_s``).
ENV_EMERGENCY_TIMEOUT = "ROBUST_EMERGENCY_TIMEOUT_S"
#: The world size of the job's first incarnation on this node's agent (what the job was planned
#: with), for :func:`.client.grad_accumulation`.
ENV_LAUNCH_WORLD = "ROBUST_LAUNCH_WORLD_SIZE"
#: For the ranks of an incarnation started by a rollback: the newest step they may restore
#: (empty: no bound). Read by :func:`robust_plugins.checkpoint.restore.rollback_bound`, which names
#: the variable itself (checkpoint does not import the watchdog).
ENV_ROLLBACK_MAX_STEP = "ROBUST_ROLLBACK_MAX_STEP"


def ring_path(prefix: str, rank: int) -> str:
    """The step ring of global rank ``rank`` under the ``ENV_RING`` prefix ``prefix``."""
    return f"{prefix}{rank}"


def format_skip_steps(steps: Iterable[int]) -> str:
    """``{40, 25}`` -> ``"25,40"`` (the ``ENV_SKIP`` value)."""
    return ",".join(str(s) for s in sorted(steps))


def parse_skip_steps(text: str) -> frozenset[int]:
    """``"25,40"`` -> ``{25, 40}``; blanks and empty items are ignored."""
    return frozenset(int(x) for x in text.split(",") if x.strip())

"""What the launcher (agent, node monitor) and the ranks it starts agree on: the environment variables
it sets for each incarnation, the formats of their values, and the kinds of datagram they exchange.

The launcher side writes the variables (:meth:`.monitor.Monitor.worker_env`, the agent); the rank
side (:mod:`.client`, :mod:`.hold`, :mod:`.emergency_rank`) reads them. Datagrams are JSON objects
on the monitor's Unix socket (``ENV_SOCKET``); ``"k"`` holds their kind (``MSG_*``), and a rank's
also carry ``r`` (global rank), ``i`` (incarnation) and ``t`` (wall time). Steps themselves travel
in shared-memory rings (:mod:`.ring`), not as datagrams, where the monitor could create them.
A leaf: it imports nothing of ours, so either side can name the protocol without importing the other.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Mapping

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
#: The file holding the monitor's spike windows for this node's ranks at their start
#: (:func:`spike_windows_record`), with which each rank seeds its own rule; empty: none.
ENV_SPIKE_WINDOWS = "ROBUST_SPIKE_WINDOWS"
#: Seconds a rank may spend in its emergency save (``emergency_save_timeout_s``).
ENV_EMERGENCY_TIMEOUT = "ROBUST_EMERGENCY_TIMEOUT_S"
#: The world size of the job's first incarnation on this node's agent (what the job was planned
#: with), for :func:`.client.grad_accumulation`.
ENV_LAUNCH_WORLD = "ROBUST_LAUNCH_WORLD_SIZE"
#: For the ranks of an incarnation started by a rollback: the newest step they may restore
#: (empty: no bound). Read by :func:`robust_plugins.checkpoint.restore.rollback_bound`, which names
#: the variable itself (checkpoint does not import the watchdog).
ENV_ROLLBACK_MAX_STEP = "ROBUST_ROLLBACK_MAX_STEP"
#: Seconds of the shortest process-group timeout that lets the watchdog judge a hang before the
#: backend's own timeout aborts the ranks (:func:`robust_plugins.watchdog.detect.pg_timeout_floor_s`);
#: read by :func:`pg_timeout`.
ENV_PG_TIMEOUT = "ROBUST_PG_TIMEOUT_S"


def pg_timeout(default_s: float, environ: Mapping[str, str] | None = None) -> datetime.timedelta:
    """The timeout to pass to ``init_process_group``: ``default_s`` (the script's own), raised to
    what ``robust run`` sets in :data:`ENV_PG_TIMEOUT` so the watchdog acts before NCCL's watchdog
    aborts every rank of a hang; ``default_s`` outside ``robust run``."""
    text = (os.environ if environ is None else environ).get(ENV_PG_TIMEOUT, "")
    try:
        floor = float(text) if text else 0.0
    except ValueError:
        raise ValueError(f"{ENV_PG_TIMEOUT}={text!r} is not a number of seconds; robust run sets it, "
                         f"unset it to launch outside robust run") from None
    return datetime.timedelta(seconds=max(float(default_s), floor))


# -- datagrams, rank -> node monitor ----------------------------------------------------------------
#: Registration at first use: ``pid``, ``fh`` (faulthandler file), ``ring`` (mapped its ring).
MSG_HELLO = "hello"
#: A step, from a rank without a ring: ``s``, ``l`` (loss), ``g`` (grad norm), ``w`` (wall s),
#: ``c`` (s inside collectives).
MSG_END = "end"
#: A NaN/Inf step, also in the ring (the datagram is never lost to a lapped ring): ``s``, ``l``, ``g``.
MSG_BAD = "bad"
#: An injected fault about to fire: ``s``, ``spec``.
MSG_INJECT = "inject"
#: The device type the rank's collectives run on (the hang verdict): ``dev``.
MSG_COMM = "comm"
#: Step times loaded from a checkpoint (:func:`.client.load_state_dict`): ``times``.
MSG_HISTORY = "history"
#: ``ok_to_save(s)``: asks for a :data:`MSG_VERDICT` to the sender's address: ``s``.
MSG_QUERY = "query"
#: A parameter-hash check (:func:`.param_hash.hash_message`).
MSG_HASH = "hash"
#: An emergency save's phase (``registered``, ``start``, ``done``): ``phase``, ``s``, ``via``, ...
MSG_EMERGENCY = "emerg"
#: The rank's interpreter exits: the monitor stops expecting its steps.
MSG_EXIT = "exit"
#: The rank refuses to run before its first step (a config or host-version problem, which a
#: restart would meet again): ``why`` (the exception's type and message).
MSG_REFUSED = "refused"
#: The ranks the straggler detector compares this rank with: those that sent the same ``g``
#: (:func:`.client.straggler_group`; a pipeline stage).
MSG_GROUP = "group"

# -- datagrams, node monitor -> rank ----------------------------------------------------------------
#: The answer to a :data:`MSG_QUERY`: ``s``, ``ok``.
MSG_VERDICT = "verdict"
#: Save now: sent to a rank's emergency listener (:mod:`.emergency_rank`).
MSG_EMERGENCY_NOW = "emerg_now"


def ring_path(prefix: str, rank: int) -> str:
    """The step ring of global rank ``rank`` under the ``ENV_RING`` prefix ``prefix``."""
    return f"{prefix}{rank}"


def format_skip_steps(steps: Iterable[int]) -> str:
    """``{40, 25}`` -> ``"25,40"`` (the ``ENV_SKIP`` value)."""
    return ",".join(str(s) for s in sorted(steps))


def parse_skip_steps(text: str) -> frozenset[int]:
    """``"25,40"`` -> ``{25, 40}``; blanks and empty items are ignored."""
    return frozenset(int(x) for x in text.split(",") if x.strip())


#: Name of the spike-window file in the run directory (``ENV_SPIKE_WINDOWS``).
SPIKE_WINDOWS_FILE = "spike_windows.json"


def spike_windows_record(incarnation: int, windows: dict[int, dict[str, list[float]]]) -> dict:
    """The ``ENV_SPIKE_WINDOWS`` file's content: the incarnation about to start and, per global
    rank, the values of each metric (``loss``, ``grad_norm``) in the monitor's running window,
    oldest first."""
    return {"incarnation": incarnation, "ranks": {str(r): w for r, w in windows.items()}}

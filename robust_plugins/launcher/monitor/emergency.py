"""Emergency saves after a crash, as the node monitor sees them: ask the live ranks that cannot
notice the dead peer themselves, and wait, bounded, for every registered saver before the agent
stops the ranks. The rank side is :mod:`robust_plugins.watchdog.emergency_rank`.

:class:`EmergencySaves` promises that the wait never exceeds ``emergency_save_timeout_s`` (0: no
wait at all) and that a rank with no save under way is waited for only while it may still start
one. It decides nothing about the fault; it reports what each saver said.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from robust_plugins._logging import get_logger
from robust_plugins.watchdog.protocol import MSG_EMERGENCY_NOW

log = get_logger(__name__)

#: ``{global rank: (its emergency record, pid, device type)}`` of the ranks that registered a
#: saver, read after draining what the ranks sent (the record: ``phase`` registered|start|done,
#: ``s``, ``ok``, ``sec``, ``error``, ``addr``, ``via``).
Savers = Callable[[], dict[int, tuple[dict[str, Any], "int | None", "str | None"]]]

def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


#: The least time a live rank gets to start its emergency save before the agent stops it.
EMERGENCY_START_MIN_S = 1.0


def asks_rank(via: str | None, device_type: str | None) -> bool:
    """Whether the monitor asks a rank that registered a saver with ``via`` to save (pure): always
    for ``monitor``; for ``auto`` when its collectives move device tensors (NCCL: a dead peer
    raises nothing on the host, :mod:`robust_plugins.watchdog.emergency_rank`); never for
    ``exception``."""
    if via == "monitor":
        return True
    return via == "auto" and device_type not in (None, "cpu")


class EmergencySaves:
    """The monitor's part in the live ranks' emergency saves (``watchdog.on_emergency``).

    ``savers``: what the ranks said (:data:`Savers`); ``typical_step_s``: a median step time of
    the job so far (0 when unknown); ``send(addr, message)``: one datagram to a rank's listener."""

    def __init__(self, timeout_s: float, savers: Savers, typical_step_s: Callable[[], float],
                 send: Callable[[Any, dict[str, Any]], None]) -> None:
        self.timeout_s = timeout_s
        self._savers = savers
        self._typical_step_s = typical_step_s
        self._send = send
        self.hold_s: float | None = None
        """How long the stop after the latest crash waited in :meth:`hold` (None: no wait); the
        crash's fault takes it (:meth:`take_hold_s`)."""

    def hold(self) -> None:
        """Before torch's agent stops the ranks after a crash (``patches.torch_elastic.
        before_failure_stop``): wait, bounded, while a live rank's emergency save runs or may
        still start: a survivor that has not reached its failing collective yet would otherwise
        be stopped before its save could begin."""
        t0 = time.monotonic()
        asked = self._ask()
        if self.await_saves(start_grace_s=self._start_grace_s(), asked=asked) is not None:
            self.hold_s = round(time.monotonic() - t0, 3)

    def take_hold_s(self) -> float | None:
        """The latest :meth:`hold`'s wait, once (None: no wait since the last call)."""
        held, self.hold_s = self.hold_s, None
        return held

    def _ask(self) -> set[int]:
        """Ask every live rank whose save would not start by itself (:func:`asks_rank`) to save:
        one datagram to its listener. Returns the ranks asked."""
        asked = [(r, e["addr"]) for r, (e, pid, device) in self._savers().items()
                 if e.get("phase") == "registered" and e.get("addr")
                 and asks_rank(e.get("via"), device) and _pid_alive(pid)]
        sent = set()
        for rank, addr in asked:
            try:
                self._send(addr, {"k": MSG_EMERGENCY_NOW})
                sent.add(rank)
            except OSError as exc:  # the rank is gone: its save is "not started"
                log.warning("robust watchdog: could not ask rank %d for its emergency save: %r", rank, exc)
        return sent

    def _start_grace_s(self) -> float:
        # A live rank meets a collective at least once a step (the gradient reduction), so it
        # sees the dead peer within about a step; two median steps for the noise, at least
        # EMERGENCY_START_MIN_S. A rank that has not started by then is not waiting on a failed
        # collective (NCCL, say, blocks until its own timeout): the agent stops it.
        return min(self.timeout_s, max(EMERGENCY_START_MIN_S, 2 * self._typical_step_s()))

    def await_saves(self, start_grace_s: float | None = None,
                    asked: set[int] = frozenset()) -> dict[str, Any] | None:
        """Give the live ranks that registered an emergency saver a bounded chance to finish it
        (they start when their collective fails, a moment after the peer died); return what each
        reported, or None when no rank registered one. ``start_grace_s``: how long a live rank
        that has not started is waited for (default: the whole ``emergency_save_timeout_s``);
        a rank in ``asked`` starts when its listener reads the ask, so it is waited for up to
        the whole timeout (a loaded host may take seconds to schedule that thread)."""
        timeout = self.timeout_s
        if timeout <= 0:
            return None
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            savers = {r: (e, pid) for r, (e, pid, _) in self._savers().items()}
            if not savers:
                return None
            # Waiting for: a save under way, or a live rank that may still hit the failed collective.
            may_start = start_grace_s is None or time.monotonic() - t0 < start_grace_s
            pending = [r for r, (e, pid) in savers.items()
                       if e["phase"] == "start"
                       or (e["phase"] == "registered" and (may_start or r in asked) and _pid_alive(pid))]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        out: dict[str, Any] = {}
        for r, (e, _) in sorted(savers.items()):
            via = {"via": e["via"]} if e.get("via") in ("monitor", "exception") else {}
            if e["phase"] == "done":
                out[str(r)] = {"step": e["s"], "ok": bool(e["ok"]), "seconds": e["sec"], **via,
                               **({"error": e["error"]} if e.get("error") else {})}
            elif e["phase"] == "start":
                out[str(r)] = {"step": e["s"], "ok": False, **via,
                               "error": f"not finished within emergency_save_timeout_s = {timeout:g} s"}
            else:
                out[str(r)] = {"step": None, "ok": False, "error": "not started (no failed collective on this rank)"}
        return out

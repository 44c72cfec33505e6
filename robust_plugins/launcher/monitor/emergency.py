"""The node monitor's emergency-save coordination: asking the live ranks (NCCL) and a bounded wait for
their saves after a crash (the rank side is :mod:`robust_plugins.watchdog.emergency_rank`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from robust_plugins._logging import get_logger
from robust_plugins.watchdog.protocol import MSG_EMERGENCY_NOW

log = get_logger("robust_plugins.launcher.monitor")


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
    raises nothing on the host, :mod:`robust_plugins.watchdog.emergency_rank`); never for ``exception``."""
    if via == "monitor":
        return True
    return via == "auto" and device_type not in (None, "cpu")


class _MonitorEmergency:
    """Part of :class:`~robust_plugins.launcher.monitor.Monitor`: waiting, bounded, for the live ranks'
    emergency saves (``watchdog.on_emergency``) before the agent stops them. The state it uses is set
    up in ``Monitor.__init__``."""

    def hold_for_emergency_saves(self) -> None:
        """Before torch's agent stops the ranks after a crash (``patches.torch_elastic.
        before_failure_stop``): wait, bounded, while a live rank's emergency save runs or may
        still start: a survivor that has not reached its failing collective yet would otherwise
        be stopped before its save could begin."""
        t0 = time.monotonic()
        asked = self._ask_for_saves()
        grace = self._emergency_start_grace_s()
        if self._await_emergency_saves(start_grace_s=grace, asked=asked) is not None:
            self.emergency_hold_s = round(time.monotonic() - t0, 3)

    def _ask_for_saves(self) -> set[int]:
        """Ask every live rank whose save would not start by itself (:func:`asks_rank`) to save:
        one datagram to its listener. Returns the ranks asked."""
        self._drain()
        with self._lock:
            asked = [(r, st.emergency["addr"]) for r, st in self.ranks.items()
                     if st.emergency and st.emergency.get("phase") == "registered" and st.emergency.get("addr")
                     and asks_rank(st.emergency.get("via"), st.device_type) and _pid_alive(st.pid)]
        sent = set()
        for rank, addr in asked:
            try:
                self._sock.sendto(json.dumps({"k": MSG_EMERGENCY_NOW}).encode(), addr)
                sent.add(rank)
            except OSError as exc:  # the rank is gone: its save is "not started"
                log.warning("robust watchdog: could not ask rank %d for its emergency save: %r", rank, exc)
        return sent

    def _emergency_start_grace_s(self) -> float:
        # A live rank meets a collective at least once a step (the gradient reduction), so it
        # sees the dead peer within about a step; two median steps for the noise, at least
        # EMERGENCY_START_MIN_S. A rank that has not started by then is not waiting on a failed
        # collective (NCCL, say, blocks until its own timeout): the agent stops it.
        with self._lock:
            times = sorted([*self._history, *(t for st in self.ranks.values() for t in st.progress.step_times)])
        typical = times[len(times) // 2] if times else 0.0
        return min(self.cfg.emergency_save_timeout_s, max(EMERGENCY_START_MIN_S, 2 * typical))

    def _await_emergency_saves(self, start_grace_s: float | None = None,
                               asked: set[int] = frozenset()) -> dict[str, Any] | None:
        """Give the live ranks that registered an emergency saver a bounded chance to finish it
        (they start when their collective fails, a moment after the peer died); return what each
        reported, or None when no rank registered one. ``start_grace_s``: how long a live rank
        that has not started is waited for (default: the whole ``emergency_save_timeout_s``);
        a rank in ``asked`` starts when its listener reads the ask, so it is waited for up to
        the whole timeout (a loaded host may take seconds to schedule that thread)."""
        timeout = self.cfg.emergency_save_timeout_s
        if timeout <= 0:
            return None
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            self._drain()
            with self._lock:
                savers = {r: (st.emergency, st.pid) for r, st in self.ranks.items() if st.emergency}
            if not savers:
                return None
            # Waiting for: a save under way, or a live rank that may still hit the failed collective.
            may_start = start_grace_s is None or time.monotonic() - t0 < start_grace_s
            pending = [r for r, (e, pid) in savers.items()
                       if e["phase"] == "start"
                       or (e["phase"] == "registered" and (may_start or r in asked) and _pid_alive(pid))]
            if not pending or timeout <= 0 or time.monotonic() >= deadline:
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

"""The node monitor's emergency-save coordination: a bounded wait for the live ranks' saves after a crash."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class _MonitorEmergency:
    """Part of :class:`~robust_plugins.watchdog.monitor.Monitor`: waiting, bounded, for the live ranks'
    emergency saves (``watchdog.on_emergency``) before the agent stops them. The state it uses is set
    up in ``Monitor.__init__``."""

    def _await_emergency_saves(self) -> dict[str, Any] | None:
        """Give the live ranks that registered an emergency saver a bounded chance to finish it
        (they start when their collective fails, a moment after the peer died); return what each
        reported, or None when no rank registered one. Called before the agent stops the ranks."""
        timeout = self.cfg.emergency_save_timeout_s
        if timeout <= 0:
            return None
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            with self._lock:
                savers = {r: (st.emergency, st.pid) for r, st in self.ranks.items() if st.emergency}
            if not savers:
                return None
            # Waiting for: a save under way, or a live rank that may still hit the failed collective.
            pending = [r for r, (e, pid) in savers.items()
                       if e["phase"] == "start" or (e["phase"] == "registered" and _pid_alive(pid))]
            if not pending or timeout <= 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        out: dict[str, Any] = {}
        for r, (e, _) in sorted(savers.items()):
            if e["phase"] == "done":
                out[str(r)] = {"step": e["s"], "ok": bool(e["ok"]), "seconds": e["sec"],
                               **({"error": e["error"]} if e.get("error") else {})}
            elif e["phase"] == "start":
                out[str(r)] = {"step": e["s"], "ok": False,
                               "error": f"not finished within emergency_save_timeout_s = {timeout:g} s"}
            else:
                out[str(r)] = {"step": None, "ok": False, "error": "not started (no failed collective on this rank)"}
        return out

"""The node monitor's fault log: recorded faults, their resume step and the SDC replay's verdict."""

from __future__ import annotations

import json
import time

from robust_plugins._logging import get_logger
from robust_plugins.watchdog.faults import Fault

# The monitor's logger: every line of the node monitor carries one name in monitor.log.
log = get_logger("robust_plugins.launcher.monitor")


class _MonitorFaultLog:
    """Part of :class:`~robust_plugins.launcher.monitor.Monitor`: recording a fault (rollback bounds,
    re-armed injections), holding a restart's fault until its resume step, the SDC replay's verdict,
    and writing ``faults.jsonl``. The state it uses is set up in ``Monitor.__init__``."""

    def _note_resume(self, step: int, now: float) -> None:
        fault = self._pending_resume
        # The faulty incarnation's ranks may report a step or two more before they are stopped.
        if fault is None or self.incarnation <= fault.incarnation:
            return
        fault.resumed_at_step = step
        if self._detected_at is not None:
            fault.detail["recovered_after_s"] = round(max(0.0, now - self._detected_at), 3)
        if self._max_step_before_fault is not None:
            fault.lost_steps = max(0, self._max_step_before_fault - (step - 1))
        self._pending_resume = None
        rp = self._sdc_replay
        if rp is not None and rp["fault"] is fault:
            return  # written with the replay's verdict
        self.faults.write(fault)

    def note_restart(self, standby_ranks: list[int], ranks: int) -> None:
        """The agent started the ranks after the pending fault (before ``begin_incarnation``):
        ``detail.restart_s`` (detection to the ranks running the script again) and whether
        standbys served it (``detail.standby``: every one of this node's ``ranks``)."""
        with self._lock:
            fault = self._pending_resume
            if fault is None or self._detected_at is None:
                return
            fault.detail["restart_s"] = round(time.monotonic() - self._detected_at, 3)
            fault.detail["standby"] = bool(ranks) and len(standby_ranks) == ranks
            fault.detail["standby_ranks"] = sorted(standby_ranks)

    def _replay_verdict(self, verdict: str, minority: list[int]) -> Fault:
        """Close the awaited SDC replay (under ``self._lock``): record the verdict and its evidence
        in the held fault, and write the fault unless it still waits for its resume step."""
        rp, self._sdc_replay = self._sdc_replay, None
        fault = rp["fault"]
        detected = self._hash_log.get((rp["incarnation"], rp["step"]), {})
        replayed = ({} if verdict == "not replayed"
                    else self._hash_log.get((self.incarnation, rp["step"]), {}))
        why = {"transient": "the replicas agree after the replay from the checkpoint: a transient "
                            "fault; the ranks stay",
               "persistent": f"the replay from the checkpoint corrupted ranks {minority} again: a "
                             f"persistent fault; evicted",
               "different": f"the replay disagreed again but on ranks {minority}, not {rp['ranks']}",
               "not replayed": "the job stopped, or another fault came, before the replayed check"}[verdict]
        evidence = {"step": rp["step"], "minority": rp["ranks"], "verdict": verdict, "why": why,
                    "hashes_at_detection": {str(r): h for r, h in sorted(detected.items())},
                    "detected_in_incarnation": rp["incarnation"],
                    "hashes_at_replay": {str(r): h for r, h in sorted(replayed.items())},
                    "replayed_in_incarnation": self.incarnation if verdict != "not replayed" else None}
        path = self.run_dir / "sdc" / f"replay-step{rp['step']}-inc{rp['incarnation']}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(evidence, indent=1) + "\n")
            fault.evidence.append(str(path))
        except OSError as exc:  # the verdict still goes into faults.jsonl
            log.warning("robust watchdog: could not write the SDC replay evidence %s: %r", path, exc)
        fault.detail["replay"] = {"verdict": verdict, "why": why, "replayed_in_incarnation":
                                  evidence["replayed_in_incarnation"]}
        log.warning("robust watchdog: SDC at step %d on ranks %s: %s", rp["step"], rp["ranks"], why)
        if fault is not self._pending_resume:
            self.faults.write(fault)
        return fault

    def _flush_pending(self) -> None:
        # Written under the lock: fault_state() must never see a fault neither held nor in the file.
        with self._lock:
            if self._sdc_replay is not None:
                held = self._sdc_replay["fault"]
                self._replay_verdict("transient" if self._sdc_replay.get("agreed") else "not replayed", [])
                if held is self._pending_resume:
                    self._pending_resume = None
                    self.faults.write(held)
            fault, self._pending_resume = self._pending_resume, None
            if fault is not None:
                self.faults.write(fault)

    def flush_faults(self) -> None:
        """Write the faults still held for their resume step or an SDC verdict, and the straggler
        episodes still open (the job ends)."""
        self._end_straggler_episodes("job end")
        self._flush_pending()

    def fault_state(self) -> tuple[int, set[int]]:
        """(the current incarnation, incarnations with a recorded fault not yet in ``faults.jsonl``),
        read together: an incarnation below the first and not in the second has all its faults in
        the file (the job-wide view then closes its round, ``jobfaults_sync``)."""
        with self._lock:
            held = {f.incarnation for f in (self._pending_resume,
                                            (self._sdc_replay or {}).get("fault")) if f is not None}
            return self.incarnation, held

    def _max_step(self) -> int | None:
        steps = [st.progress.last_step for st in self.ranks.values() if st.progress.last_step is not None]
        return max(steps) if steps else None

    def _record(self, fault: Fault, detected_at: float | None = None) -> Fault:
        """Record ``fault``, detected at ``detected_at`` (monotonic; now if None)."""
        self._flush_pending()
        with self._lock:
            self._max_step_before_fault = self._max_step()
            self._detected_at = time.monotonic() if detected_at is None else detected_at
            fault.incarnation = self.incarnation
            self.all_faults.append(fault)
            # Ranks run on for a few steps between a fault and their stop; injections they fired
            # after the fault's step are replayed by the restarted job: arm them again.
            if fault.step is not None:
                rearm = [i for inc, step, i in self._fired
                         if inc == self.incarnation and step > fault.step]
                self._fired = [f for f in self._fired if f[2] not in rearm]
                self.pending_injections += rearm
            if fault.action == "rollback" and fault.step is not None:
                back = int(fault.detail.get("check_every", 1)) if fault.kind == "sdc" else 1
                newest = fault.step - back
                # Snapshots up to the newest step any rank reached hold the bad state until the
                # job has run past it again (each of those steps was then snapshotted anew).
                reached = max(fault.step, self._max_step_before_fault or fault.step)
                if self._rollback_limit is not None:
                    newest = min(newest, self._rollback_limit[0])
                    reached = max(reached, self._rollback_limit[2])
                self._rollback_limit = [newest, self.incarnation, reached]
            if fault.action in ("restart", "rollback"):
                self._pending_resume = fault  # written when the restarted job reports a step
            else:
                self.faults.write(fault)
        log.warning("robust watchdog: %s fault at step %s, suspect ranks %s (%s); action: %s",
                    fault.kind, fault.step, fault.suspect_ranks, fault.detail.get("reason", ""),
                    fault.action)
        return fault

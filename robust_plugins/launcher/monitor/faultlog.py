"""The node monitor's record of faults: ``faults.jsonl``, faults held for their resume step or SDC
verdict, the rollback bound the next ranks get, and injected faults still to fire.

:class:`FaultBook` promises that each recorded fault reaches ``faults.jsonl`` exactly once: at
once when nothing follows it (``report``, ``evict``), else when the restarted ranks report their
first step (it then carries ``resumed_at_step``, ``lost_steps``, ``detail.recovered_after_s``),
with the verdict of its SDC replay, or at :meth:`FaultBook.flush` (the job ends). It judges
nothing: the detectors decide that a fault happened; the book decides when it is written.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from robust_plugins._logging import get_logger
from robust_plugins.watchdog import inject as _inject
from robust_plugins.watchdog.faults import Fault, FaultLog

log = get_logger(__name__)


class Injections:
    """Injected faults (``--inject``) for the next ranks: fired ones leave, except those a restart
    replays (a bad batch; a fault fired after the step that the job rolls back to)."""

    def __init__(self, pending: list[_inject.Injection] | None = None) -> None:
        self.pending = list(pending or [])
        """Injections the next incarnation's ranks get (``ROBUST_WATCHDOG_INJECT``)."""
        self._fired: list[tuple[int, int, _inject.Injection]] = []

    def fired(self, spec: str, step: int, incarnation: int) -> None:
        """A rank announced that the injection ``spec`` fired at ``step``."""
        fired = [i for i in self.pending if i.spec() == spec]
        if not any(i.kind in _inject.RECURRING_KINDS for i in fired):
            # A bad batch stays armed: every replay of its step fires it again.
            self.pending = [i for i in self.pending if i.spec() != spec]
            self._fired += [(incarnation, step, i) for i in fired]

    def rearm_after(self, step: int, incarnation: int) -> None:
        """Ranks run on for a few steps between a fault and their stop; the injections they fired
        after the fault's ``step`` are replayed by the restarted job: arm them again."""
        rearm = [i for inc, s, i in self._fired if inc == incarnation and s > step]
        self._fired = [f for f in self._fired if f[2] not in rearm]
        self.pending += rearm

    def to_env(self) -> str:
        """The value of ``ROBUST_WATCHDOG_INJECT`` for the next ranks."""
        return _inject.to_env(self.pending)


class FaultBook:
    """Faults of one node, recorded by the monitor. Its state is read and changed under ``lock``
    (the monitor's); a method that takes the lock itself says so."""

    def __init__(self, run_dir: Path, lock: threading.Lock, injections: Injections) -> None:
        self.run_dir = run_dir
        self.lock = lock
        self.injections = injections
        self.file = FaultLog(run_dir / "faults.jsonl")
        self.all: list[Fault] = []
        """Faults that stopped the ranks (restart, rollback, or the job's end)."""
        self.pending_resume: Fault | None = None
        """A restart's fault, written when the restarted ranks report a step."""
        self.sdc_replay: dict[str, Any] | None = None
        """An SDC rollback whose replay is awaited (``sdc_replay``): ``fault`` (its record, held
        until the verdict), ``step``, ``ranks`` (the minority), ``incarnation``, ``agreed``."""
        self.hash_log: dict[tuple[int, int], dict[int, str]] = {}
        """{(incarnation, step): {rank: hex}} of the latest parameter-hash checks (SDC evidence)."""
        self.rollback_limit: list[int] | None = None
        """After a rollback: [newest step the ranks may restore, incarnation of the fault, newest
        step its ranks reported]; kept until a later incarnation runs past that step."""
        self._max_step_before_fault: int | None = None
        self._detected_at: float | None = None

    def rollback_max_step(self) -> str:
        """``ROBUST_ROLLBACK_MAX_STEP`` for the next ranks ("" when no bound); takes the lock."""
        # For in-memory snapshots (robust_plugins.checkpoint.restore.rollback_bound): a snapshot
        # taken every step holds the bad state of a rollback; the restarted ranks must not restore
        # anything newer than the last good step. The fault's record is written only later, and
        # the pending fault is replaced by the next one (a crash of the restarted ranks before
        # their first step), so the limit is kept on its own until the job ran past the bad steps.
        with self.lock:
            limit = self.rollback_limit
        return "" if limit is None else str(limit[0])

    def on_step(self, step: int, now: float, incarnation: int) -> None:
        """A rank of ``incarnation`` finished ``step`` at monotonic time ``now``: the resume of a
        held fault, and the rollback bound's upkeep."""
        self._note_resume(step, now, incarnation)
        limit = self.rollback_limit
        if limit is not None and incarnation > limit[1]:
            # The ranks that were stopped may have snapshotted one step past the last
            # they reported. Beyond that, every snapshot the bad steps left was replaced.
            if step > limit[2] + 1:
                self.rollback_limit = None
        elif limit is not None:
            limit[2] = max(limit[2], step)  # the faulty ranks run on until they are stopped

    def _note_resume(self, step: int, now: float, incarnation: int) -> None:
        fault = self.pending_resume
        # The faulty incarnation's ranks may report a step or two more before they are stopped.
        if fault is None or incarnation <= fault.incarnation:
            return
        fault.resumed_at_step = step
        if self._detected_at is not None:
            fault.detail["recovered_after_s"] = round(max(0.0, now - self._detected_at), 3)
        if self._max_step_before_fault is not None:
            fault.lost_steps = max(0, self._max_step_before_fault - (step - 1))
        self.pending_resume = None
        rp = self.sdc_replay
        if rp is not None and rp["fault"] is fault:
            return  # written with the replay's verdict
        self.file.write(fault)

    def note_restart(self, standby_ranks: list[int], ranks: int) -> None:
        """The agent started the ranks after the pending fault: ``detail.restart_s`` (detection to
        the ranks running the script again) and whether standbys served it (``detail.standby``:
        every one of this node's ``ranks``). Takes the lock."""
        with self.lock:
            fault = self.pending_resume
            if fault is None or self._detected_at is None:
                return
            fault.detail["restart_s"] = round(time.monotonic() - self._detected_at, 3)
            fault.detail["standby"] = bool(ranks) and len(standby_ranks) == ranks
            fault.detail["standby_ranks"] = sorted(standby_ranks)

    def replay_verdict(self, verdict: str, minority: list[int], incarnation: int) -> Fault:
        """Close the awaited SDC replay: record the verdict and its evidence in the held fault,
        and write the fault unless it still waits for its resume step."""
        rp, self.sdc_replay = self.sdc_replay, None
        fault = rp["fault"]
        detected = self.hash_log.get((rp["incarnation"], rp["step"]), {})
        replayed = ({} if verdict == "not replayed"
                    else self.hash_log.get((incarnation, rp["step"]), {}))
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
                    "replayed_in_incarnation": incarnation if verdict != "not replayed" else None}
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
        if fault is not self.pending_resume:
            self.file.write(fault)
        return fault

    def flush(self, incarnation: int) -> None:
        """Write the faults still held for their resume step or an SDC verdict. Takes the lock:
        ``state`` must never see a fault neither held nor in the file."""
        with self.lock:
            if self.sdc_replay is not None:
                held = self.sdc_replay["fault"]
                self.replay_verdict("transient" if self.sdc_replay.get("agreed") else "not replayed", [],
                                    incarnation)
                if held is self.pending_resume:
                    self.pending_resume = None
                    self.file.write(held)
            fault, self.pending_resume = self.pending_resume, None
            if fault is not None:
                self.file.write(fault)

    def held(self) -> set[int]:
        """Incarnations with a recorded fault not yet in ``faults.jsonl``."""
        return {f.incarnation for f in (self.pending_resume, (self.sdc_replay or {}).get("fault"))
                if f is not None}

    def record(self, fault: Fault, incarnation: int, max_step: int | None,
               detected_at: float | None = None) -> Fault:
        """Record ``fault`` of ``incarnation``, whose ranks reached ``max_step``, detected at
        ``detected_at`` (monotonic; now if None)."""
        self._max_step_before_fault = max_step
        self._detected_at = time.monotonic() if detected_at is None else detected_at
        fault.incarnation = incarnation
        self.all.append(fault)
        if fault.step is not None:
            self.injections.rearm_after(fault.step, incarnation)
        if fault.action == "rollback" and fault.step is not None:
            back = int(fault.detail.get("check_every", 1)) if fault.kind == "sdc" else 1
            newest = fault.step - back
            # Snapshots up to the newest step any rank reached hold the bad state until the
            # job has run past it again (each of those steps was then snapshotted anew).
            reached = max(fault.step, max_step or fault.step)
            if self.rollback_limit is not None:
                # A later incarnation restored at most the earlier bound and snapshotted every
                # step after it anew up to the fault's (and its restore retired the stale ones
                # above that bound: restore_from_memory), so only a fault of the same incarnation
                # keeps the earlier bound; the stale steps past this fault still count in reached.
                if incarnation <= self.rollback_limit[1]:
                    newest = min(newest, self.rollback_limit[0])
                reached = max(reached, self.rollback_limit[2])
            self.rollback_limit = [newest, incarnation, reached]
        if fault.action in ("restart", "rollback"):
            self.pending_resume = fault  # written when the restarted job reports a step
        else:
            self.file.write(fault)
        return fault

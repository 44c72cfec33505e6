"""The node monitor: receives step signals from local ranks, detects faults, writes ``faults.jsonl``.

It lives in the ``robust run`` launcher process (the elastic agent), which calls
:meth:`Monitor.check` every monitor interval and :meth:`Monitor.on_crash` when a rank exits
badly. Steps arrive in one shared-memory ring per rank (:mod:`robust_plugins.watchdog.ring`),
created here before the
ranks start and read at every poll; rare events arrive as datagrams. A receiver thread reads the
datagrams as they come and polls the rings at least every ``_RECV_POLL_S``; the agent thread
drains both before it decides. Only the agent thread starts or stops ranks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from robust_plugins._logging import get_logger
from robust_plugins.config import WatchdogConfig
from robust_plugins.watchdog import flight as _flight
from robust_plugins.watchdog import inject as _inject
from robust_plugins.watchdog import protocol as _protocol
from robust_plugins.watchdog import ring as _ring
from robust_plugins.watchdog.detect import STEP_WINDOW, RunningMedian
from robust_plugins.watchdog.faults import Fault, FaultLog
from robust_plugins.launcher.monitor.detectors import _MonitorDetectors
from robust_plugins.launcher.monitor.emergency import _MonitorEmergency
from robust_plugins.launcher.monitor.faultlog import _MonitorFaultLog
from robust_plugins.launcher.monitor.transport import _RECV_POLL_S, _MonitorIPC
from robust_plugins.launcher.monitor.state import _RankState

log = get_logger(__name__)

class Monitor(_MonitorIPC, _MonitorDetectors, _MonitorFaultLog, _MonitorEmergency):
    """Fault detection for the ranks of one node (transport, detectors, fault log and emergency
    saves are in the sibling ``monitor_*`` modules)."""

    def __init__(self, cfg: WatchdogConfig, run_dir: str | os.PathLike,
                 injections: list[_inject.Injection] | None = None, host: str | None = None,
                 ring_entries: int = _ring.DEFAULT_ENTRIES) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.faults = FaultLog(self.run_dir / "faults.jsonl")
        self.host = host or socket.gethostname()
        self.pending_injections = list(injections or [])
        self.incarnation = -1
        self.ranks: dict[int, _RankState] = {}
        self.all_faults: list[Fault] = []
        """Faults that stopped the ranks (restart, rollback, or the job's end)."""
        self.reports: list[Fault] = []
        """Faults reported without stopping anything (stragglers)."""
        self._spiked: dict[int, int] = {}
        """Spike faults per step, over every incarnation."""
        self.skip_path = self.run_dir / "skip_steps.json"
        self.skip_steps: set[int] = set()
        """Steps whose batch the ranks skip (spiked twice); kept in the run directory, so a
        relaunch with the same ``--run-dir`` skips them too."""
        if self.skip_path.exists():
            self.skip_steps = {int(x) for x in json.loads(self.skip_path.read_text())["steps"]}
        self._pending_resume: Fault | None = None
        self._sdc_replay: dict[str, Any] | None = None
        """An SDC rollback whose replay is awaited (``sdc_replay``): ``fault`` (its record, held
        until the verdict), ``step``, ``ranks`` (the minority), ``incarnation``, ``agreed``."""
        self._hash_log: dict[tuple[int, int], dict[int, str]] = {}
        """{(incarnation, step): {rank: hex}} of the latest parameter-hash checks (SDC evidence)."""
        self._rollback_limit: list[int] | None = None
        """After a rollback: [newest step the ranks may restore, incarnation of the fault, newest
        step its ranks reported]; kept until a later incarnation runs past that step."""
        self._max_step_before_fault: int | None = None
        self._detected_at: float | None = None
        self._history: list[float] = []
        """Step times of earlier incarnations (the learned hang timeout survives restarts)."""
        self._seeded: set[int] = set()
        """Ranks whose checkpointed step times seeded ``_history`` (a fresh launcher only)."""
        self._incarnation_started = 0.0
        self._warned_unregistered = False
        self._uses_api = False
        self._warned_receiver = False
        self._learned: tuple[float, float] | None = None
        """(monotonic time, value) of the latest learned hang timeout; None: compute anew."""
        self._medians: dict[tuple[int, str], RunningMedian] = {}
        self._queries: list[tuple[int, Any]] = []
        """(step, reply address) of ``ok_to_save`` questions not answered yet."""
        self._stopping = -1
        """The incarnation whose fault ``check`` returned: its ranks are being stopped."""
        self.emergency_hold_s: float | None = None
        """How long torch's stop after the latest crash waited for emergency saves (None: no wait)."""
        self._fired: list[tuple[int, int, _inject.Injection]] = []
        """(incarnation, step, injection) of every injected fault the ranks announced."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # In the run directory when the path fits AF_UNIX's 107 bytes (then even a SIGKILLed
        # launcher leaves nothing outside it), else in a short temporary directory.
        in_run_dir = str((self.run_dir / "monitor.sock").resolve())
        self._sock_dir = None if len(in_run_dir) < 100 else tempfile.mkdtemp(prefix="robust-wd-")
        self.address = in_run_dir if self._sock_dir is None else os.path.join(self._sock_dir, "monitor.sock")
        if os.path.exists(self.address):
            os.unlink(self.address)  # left by a launcher that was killed; nobody listens there
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.address)
        self._recv_lock = threading.Lock()
        self.ring_entries = ring_entries
        self._ring_dir = _ring.ring_dir(self.run_dir)
        stale = _ring.sweep_stale(self._ring_dir)
        if stale:
            log.info("robust watchdog: removed %d step rings left in %s by launchers that are gone",
                     len(stale), self._ring_dir)
        self._ring_seq = 0
        self._rings: dict[int, _ring.RingReader] = {}
        """This incarnation's step rings by global rank (read under ``_recv_lock``)."""
        self._pending_rings: dict[int, _ring.RingReader] = {}
        """Rings created for the next incarnation, attached by ``begin_incarnation``."""
        self.ring_missed: dict[int, int] = {}
        """Step records per rank overwritten before the monitor read them, over the job."""
        self._thread = threading.Thread(target=self._receive, name="robust-watchdog-recv", daemon=True)
        self._thread.start()

    # -- lifecycle -----------------------------------------------------------------------------
    def worker_env(self, ranks: Iterable[int] | None = None) -> dict[str, str]:
        """Variables the next incarnation's ranks need (set by the agent before starting them).

        With ``ranks`` (the global ranks about to start on this node) it also creates their step
        rings; without, the ranks send a datagram a step."""
        return {
            _protocol.ENV_SOCKET: self.address,
            _protocol.ENV_RING: self._create_rings(ranks) if ranks is not None else "",
            _protocol.ENV_RUN_DIR: str(self.run_dir),
            _protocol.ENV_INJECT: _inject.to_env(self.pending_injections),
            _protocol.ENV_INCARNATION: str(self.incarnation + 1),
            _protocol.ENV_SDC_EVERY: str(self.cfg.sdc_every_steps),
            _protocol.ENV_STRAGGLER: "1" if self.cfg.straggler_factor > 0 else "0",
            _protocol.ENV_SKIP: _protocol.format_skip_steps(self.skip_steps),
            _protocol.ENV_EMERGENCY_TIMEOUT: str(self.cfg.emergency_save_timeout_s),
            _protocol.ENV_ROLLBACK_MAX_STEP: self._rollback_max_step(),
            _protocol.ENV_SPIKE: (f"{self.cfg.spike_factor:g},{self.cfg.spike_window},"
                                  f"{self.cfg.spike_warmup_steps}"),
            # The flight recorder records nothing by default; the hang verdict on NCCL needs it.
            **_flight.recorder_env(os.environ),
        }

    def _rollback_max_step(self) -> str:
        # For in-memory snapshots (robust_plugins.checkpoint.restore.rollback_bound): a snapshot
        # taken every step holds the bad state of a rollback; the restarted ranks must not restore
        # anything newer than the last good step. The fault's record is written only later, and
        # the pending fault is replaced by the next one (a crash of the restarted ranks before
        # their first step), so the limit is kept on its own until the job ran past the bad steps.
        with self._lock:
            limit = self._rollback_limit
        return "" if limit is None else str(limit[0])

    def begin_incarnation(self, pids: dict[int, int]) -> None:
        """New ranks ``{global_rank: pid}`` started; forget the previous incarnation's state."""
        self._end_straggler_episodes("restart")
        with self._recv_lock:
            # The previous ranks are stopped by now: whatever they wrote since the last poll
            # (steps past a fault extend a rollback's bad range) is read under their incarnation.
            self._drain_locked()
            now = time.monotonic()
            with self._lock:
                for st in self.ranks.values():
                    self._history.extend(st.progress.step_times)
                del self._history[:-STEP_WINDOW * max(1, len(pids))]
                self.incarnation += 1
                self._incarnation_started = now
                self._learned = None
                # A script that reported steps before will again: watch the new ranks from their start
                # (a restarted rank can hang before its first step, e.g. in init_process_group).
                self.ranks = {r: _RankState(pid=p, registered=self._uses_api) for r, p in pids.items()}
                for st in self.ranks.values():
                    st.progress.last_progress = now
            old, self._rings = self._rings, {r: g for r, g in self._pending_rings.items() if r in pids}
            self._close_rings(old)
            self._close_rings({r: g for r, g in self._pending_rings.items() if r not in pids})
            self._pending_rings = {}
        with open(self.run_dir / "workers.jsonl", "a") as f:
            f.write(json.dumps({"incarnation": self.incarnation, "host": self.host,
                                "pids": {str(r): p for r, p in sorted(pids.items())}}) + "\n")
        log.info("robust watchdog: incarnation %d started, ranks %s", self.incarnation,
                 {r: p for r, p in sorted(pids.items())})

    def close(self) -> None:
        """Stop the receiver, write a fault still waiting for its resume step, remove the socket
        and the step rings."""
        self._stop.set()
        self._thread.join(timeout=2 * _RECV_POLL_S + 1.0)
        with self._recv_lock:
            self._close_rings(self._rings)
            self._close_rings(self._pending_rings)
            self._rings, self._pending_rings = {}, {}
        self._sock.close()
        self._end_straggler_episodes("job end")
        self._flush_pending()
        try:
            os.unlink(self.address)
            if self._sock_dir is not None:
                os.rmdir(self._sock_dir)
        except OSError:
            pass

    def on_crash(self, failures: dict[int, Any], will_restart: bool,
                 seen: tuple[float, float] | None = None) -> Fault:
        """Ranks exited badly: ``{global_rank: ProcessFailure}`` from the elastic agent.

        ``seen``: (wall, monotonic) time when the agent's poll that found the exit began. torch
        stops the other ranks inside that poll, before it returns, so detection is timed to its
        start and the stop counts in the restart (``detail.stop_s``: how long the stop took)."""
        self._drain()
        now_wall = time.time() if seen is None else seen[0]
        with self._lock:
            states = {r: self.ranks.get(r, _RankState()) for r in failures}
        # When one rank fails, the elastic agent stops its peers with SIGTERM, and they appear in
        # `failures` too: rank the causes as announced injection < any other failure < SIGTERM.
        def cause_order(r: int) -> tuple[int, float]:
            st, code = states[r], getattr(failures[r], "exitcode", None)
            klass = 0 if st.injected else 2 if code == -int(signal.SIGTERM) else 1
            return klass, getattr(failures[r], "timestamp", 0) or 0

        emergency = self._await_emergency_saves()
        ranks = sorted(failures, key=cause_order)
        first = ranks[0]
        st, failure = states[first], failures[first]
        exitcode = getattr(failure, "exitcode", None)
        sig = None
        if exitcode is not None and exitcode < 0:
            try:
                sig = signal.Signals(-exitcode).name
            except ValueError:
                sig = str(-exitcode)
        onset = st.injected["t"] if st.injected else st.last_msg_wall
        last = st.progress.last_step
        step = st.injected["s"] if st.injected else (last + 1 if last is not None else None)
        suspects = sorted(r for r in ranks if cause_order(r)[0] == cause_order(first)[0])
        fault = Fault(
            kind="crash", step=step, suspect_ranks=suspects, suspect_hosts=[self.host],
            detected_after_s=None if onset is None else round(max(0.0, now_wall - onset), 3),
            action="restart" if will_restart else "report",
            detail={"exitcodes": {str(r): getattr(failures[r], "exitcode", None) for r in ranks},
                    "signal": sig, "onset": "injected" if st.injected else "last signal",
                    "reason": f"rank {first} exited with {sig or exitcode}",
                    "emergency_save": emergency},
        )
        if seen is not None:
            fault.detail["stop_s"] = round(time.monotonic() - seen[1], 3)
        if self.emergency_hold_s is not None:  # part of stop_s: the stop waited for the saves
            fault.detail["emergency_hold_s"], self.emergency_hold_s = self.emergency_hold_s, None
        return self._record(fault, detected_at=None if seen is None else seen[1])

    def check(self, will_restart: bool) -> Fault | None:
        """Look for faults (SDC, NaN/Inf, spike, hang); returns the fault if the ranks must be
        stopped. Then answers the ranks' ``ok_to_save`` questions."""
        fault = self._check(will_restart)
        if fault is not None:
            with self._lock:
                self._stopping = self.incarnation  # later questions: answered at once (transport.py)
        self._answer_queries(fault)
        return fault

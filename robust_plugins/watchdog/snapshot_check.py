"""The watchdog's silent-data-corruption check on every in-memory snapshot (``checkpoint.verify_replicas``).

Under ``robust run``, a snapshot binding (DeepSpeed, megatron-core) that takes a snapshot every
``memory_every`` steps also has it checked against the data-parallel replicas on its snapshot thread
(:mod:`robust_plugins.checkpoint.replicas`). What this module adds is the watchdog's side:

- a mismatch goes to the node monitor as the ``hash`` message ``watchdog.check_params`` sends, with
  ``every`` = steps since the previous snapshot that agreed. The monitor records an ``sdc`` fault
  naming the ranks that differ and rolls back that far: to the snapshot before, which is still in
  memory (one step lost with ``memory_every: 1``, where ``check_params`` every 100 steps would have
  lost up to 100 and a disk checkpoint's interval);
- before the next optimizer step (the bindings' step hook, where the background copy is waited for
  too) and again before the next snapshot, which would overwrite the slot of that last good one, the
  rank waits for the verdict and, after a mismatch, holds until it is stopped (:mod:`.hold`, as for
  a NaN): every replica got the same verdict from the same all-reduce, so none of them takes that
  step or that snapshot;
- ``bitflip`` / ``stuckbit`` injections fire right before the snapshot of their step (the corrupted
  parameter is then in that snapshot and in the next forward), so tests and benchmarks exercise it.

The message leaves the snapshot thread on a socket of its own: the client's socket changes its
timeout while the main thread waits for a monitor's answer (:func:`.hold.after_fault`), and a send
from another thread resetting it could leave that wait without a bound.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Callable, Sequence

from robust_plugins._logging import announce, get_logger
from robust_plugins.checkpoint import replicas
from robust_plugins.checkpoint.restore import rollback_bound
from robust_plugins.watchdog import client as _client
from robust_plugins.watchdog import hold as _hold
from robust_plugins.watchdog.param_hash import hash_message

log = get_logger(__name__)


#: :func:`off_reason` for a rank without a data-parallel replica, unless the host says more.
NO_REPLICA = "this rank has no data-parallel replica to compare with"


def off_reason(verify_replicas: bool, under_robust_run: bool, sdc_every: int, replicas_n: int,
               alone: str | None = None) -> str | None:
    """Why the snapshot check does not run, or None when it does (pure). ``alone``: the reason
    when there is no replica (a host's own words, e.g. ZeRO-3's; default :data:`NO_REPLICA`)."""
    if not verify_replicas:
        return "checkpoint.verify_replicas is false"
    if not under_robust_run:
        return "not under robust run (no monitor to roll back)"
    if sdc_every <= 0:
        return "the watchdog's SDC check is off (sdc_every_steps=0)"
    if replicas_n < 2:
        return alone or NO_REPLICA
    return None


class SnapshotCheck:
    """One binding's check: ``verify`` runs on the snapshot thread (``SnapshotStore.verify``),
    ``before_snapshot`` on the training thread before each snapshot is captured."""

    def __init__(self, store: Any, replica_ranks: Sequence[int], every: int, timeout_s: float) -> None:
        self.client = _client.get_client()
        self.store, self.every, self.timeout_s = store, every, timeout_s
        self.check = replicas.ReplicaCheck(replica_ranks, timeout_s)
        self._last_good: int | None = None
        bound = rollback_bound()
        # After a rollback, the first snapshot past the bound replays the step the corruption was
        # found at: its agreement is the replay's verdict (transient), so it is reported too.
        self._replay_after = bound
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.settimeout(1.0)
        store.verify = self.verify

    # ------------------------------------------------------------------------ snapshot thread
    def verify(self, slot: Any, step: int, ranges: list[tuple[int, int]]) -> bool:
        """True when every replica's parameters in this snapshot are the same (collective)."""
        mine = replicas.slot_digest(slot, ranges)
        hashes = self.check.agree(mine)
        every = step - self._last_good if self._last_good is not None else self.every
        if hashes is None:
            self._last_good = step
            if self._replay_after is not None and step > self._replay_after:
                self._replay_after = None
                self._send(hash_message(step, mine, {r: mine for r in self.check.ranks}, every))
            return True
        self._send(hash_message(step, mine, hashes, every, max_sent=_client.MAX_HASHES_SENT))
        return False

    def _send(self, msg: dict) -> None:
        c = self.client
        msg.update(r=c.rank, i=c.incarnation, t=time.time())
        try:
            self._sock.sendto(json.dumps(msg).encode(), c.address)
        except OSError as exc:  # the monitor is gone or behind: the hold below still stops the rank
            log.warning("robust watchdog: rank %d could not report the replica check of step %s: %r",
                        c.rank, msg.get("s"), exc)

    # ------------------------------------------------------------------------ training thread
    def before_step(self) -> None:
        """Wait for the newest snapshot's verdict; after a mismatch, hold until stopped."""
        bad = self.store.verdict(self.timeout_s)
        if bad is not None:
            _hold.after_fault(self.client, bad, "parameters differing from the data-parallel replicas")

    def before_snapshot(self, step: int, params: Callable[[], list]) -> None:
        """:meth:`before_step` (again: a loop without an optimizer hook gets here first), then
        fire a parameter injection armed for ``step`` (``params()``: the parameters, in the same
        order on every replica)."""
        self.before_step()
        injections = self.client.injections
        if injections.params:
            injections.fire_param_fault(step, params())

    def close(self) -> None:
        """Close the reporting socket (the group lives as long as the process group)."""
        self._sock.close()


def build(store: Any, verify_replicas: bool, replica_ranks: Sequence[int], every: int,
          timeout_s: float, alone: str | None = None) -> SnapshotCheck | None:
    """The check for a binding, or None (with one rank-0 line saying why, when it was asked for).

    Collective when it runs: every rank of the job calls it at the same point."""
    c = _client.get_client()
    reason = off_reason(verify_replicas, c is not None, c.sdc_every if c is not None else 0, len(replica_ranks),
                        alone)
    if reason is not None:
        if verify_replicas and c is not None:
            announce(log, "robust_plugins: in-memory snapshots are not checked against the replicas: %s", reason)
        return None
    check = SnapshotCheck(store, replica_ranks, every, timeout_s)
    announce(log, "robust_plugins: every in-memory snapshot is checked against its %d data-parallel replicas "
             "(silent data corruption rolls back to the snapshot before it)", len(replica_ranks))
    return check

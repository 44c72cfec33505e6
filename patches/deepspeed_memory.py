"""DeepSpeed binding of the in-memory snapshots (``checkpoint.memory_every`` / ``peer_backup``).

What one snapshot holds, so that a restored engine continues bitwise as if never stopped
(DeepSpeed 0.19, ZeRO 0-3, same world size):

* ``engine.module.state_dict()`` (parameters and buffers); with ZeRO-3 the buffers, this rank's
  parameter partitions and its optimizer state (``patches/deepspeed_zero3.py``: no gather),
* the optimizer: for ZeRO 1/2 ``DeepSpeedZeroOptimizer.state_dict()`` (loss scaler, fp32 master
  partition, base optimizer state; restored through its own ``load_state_dict`` with
  ``load_from_fp32_weights``), for ZeRO 0 a torch optimizer's ``state_dict()`` or, with bf16/fp16
  on ZeRO 0, ``FP16_UnfusedOptimizer.state_dict()`` (loss-scale settings, wrapped optimizer,
  fp32 master copies; its ``load_state_dict`` copies them back),
* the LR scheduler, DeepSpeed's step counters (``global_steps``, ``global_samples``,
  ``skipped_steps``, ``micro_steps``),
* RNG states: torch (CPU and, where initialized, CUDA), numpy and Python's ``random``,
* the compression residuals (``compression`` sub-block),
* whatever the training script registers with :meth:`MemorySnapshots.register` (e.g. its data
  position: a function returning tensors / plain data, and one taking them back).

* the ``client_state`` of the last ``save_checkpoint`` call (tensors and plain data; a copy taken
  at the call). ``save_checkpoint`` at a step whose snapshot was already taken snapshots that step
  again, into the same slot, with the client_state; a restore from memory returns it from
  ``load_checkpoint`` as a disk load would (the user's keys; not DeepSpeed's own bookkeeping keys
  such as ``ds_config``). Restoring a later step than the one client_state was given at logs
  one line: per-step values (a data position) belong in :meth:`MemorySnapshots.register`.

The watchdog's learned hang timeouts live in ``robust run``'s node monitor, which outlives every
rank restart, and in the client_state above.

Snapshots go through :class:`robust_plugins.checkpoint.memory.SnapshotStore` (shared memory,
double buffer) and, with ``peer_backup``, :class:`robust_plugins.checkpoint.peer.PeerBackup`;
the restore order lives in :mod:`robust_plugins.checkpoint.restore`.

What the step waits for (``checkpoint.memory_copy``, default ``background``): parameters and
optimizer state change only in the optimizer step, so their copy (nearly all the bytes) runs on
the snapshot thread while the next forward and backward run; ``engine.step`` (shadowed on the
instance, innermost, so before DeepSpeed's step and whatever wraps it) first waits until the
previous snapshot is committed, and that wait is added to the snapshot's blocking time. Loads
wait too before they overwrite the state. ``in_step`` copies everything inside the step.
"""

from __future__ import annotations

import copy
import json
import os
import time
from typing import Any, Callable

import torch

from robust_plugins._logging import get_logger
from robust_plugins.checkpoint import flat, memory
from robust_plugins.checkpoint.binding import SnapshotBinding, finish_live, rng_state, set_rng_state
from robust_plugins.checkpoint.disk import DiskCheckpointer
from robust_plugins.checkpoint.peer import PeerBackup, plan_peers
from robust_plugins.checkpoint.persist import FORMAT as PERSIST_FORMAT
from robust_plugins.checkpoint.persist import SnapshotPersister, load_snapshot_checkpoint
from robust_plugins.checkpoint.restore import restore_from_memory, rollback_bound
from robust_plugins.errors import CheckpointError, UnsupportedError
from robust_plugins.patches import deepspeed_zero3 as _zero3
from robust_plugins.watchdog import ok_to_save, snapshot_check

log = get_logger(__name__)

#: Name of the per-run log of restores (one JSON line a rank and restore) in ``ROBUST_RUN_DIR``.
RESTORE_LOG = "restores.jsonl"

def _allowed() -> dict[str, type]:
    import importlib

    from robust_plugins.patches.deepspeed import SAFE_GLOBALS

    return flat.allow(*(getattr(importlib.import_module(m), n) for m, n in SAFE_GLOBALS))


def _zero_optimizer(engine):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return engine.optimizer if isinstance(engine.optimizer, DeepSpeedZeroOptimizer) else None


def _unfused_wrapper(opt) -> bool:
    # ZeRO 0's FP16_UnfusedOptimizer (bf16 on CPU): its state_dict holds everything it steps from
    # (loss-scale settings, the wrapped optimizer's state, the fp32 master copies, as tensors and
    # plain data) and its load_state_dict copies the masters back in place: exact. The other
    # wrappers (fused FP16_Optimizer, BF16_Optimizer) run on GPUs only and were never checked here.
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    return isinstance(opt, FP16_UnfusedOptimizer)


def check_engine(engine) -> None:
    """Refuse optimizers whose state this binding cannot restore exactly."""
    opt = engine.optimizer
    if _zero3.is_zero3(engine):
        _zero3.check_engine(engine, "checkpoint.memory_every")
        return
    if _zero_optimizer(engine) is None and not isinstance(opt, torch.optim.Optimizer) and not _unfused_wrapper(opt):
        raise UnsupportedError(
            f"robust_plugins.checkpoint.memory_every supports ZeRO 1/2 (DeepSpeedZeroOptimizer), ZeRO-3 and, "
            f"with ZeRO 0, plain torch optimizers and DeepSpeed's FP16_UnfusedOptimizer; this engine has "
            f"{type(opt).__name__}, whose exact capture was not verified. Remove memory_every or use ZeRO 1/2."
        )


def _finish_before_destroy() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (once): every live binding first finishes
    its background work (:func:`robust_plugins.checkpoint.binding.finish_live`). A script's last
    step is often a persist step, whose background save agrees over a process group; a script
    that destroyed the group right after that step would lose the save. DeepSpeed's
    ``deepspeed.comm`` calls through ``torch.distributed``, so its destroy is covered too."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d as c10d

    from robust_plugins.patches import _guard

    if _guard.is_patched(tdist.destroy_process_group):
        return
    original = c10d.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        finish_live()
        return original(*args, **kwargs)

    wrapped = _guard.wrap(original, destroy_process_group)
    tdist.destroy_process_group = wrapped
    c10d.destroy_process_group = wrapped


class MemorySnapshots(SnapshotBinding):
    """Snapshots of one engine; reachable as ``engine.robust_plugins.memory``."""

    def __init__(self, engine, plugin) -> None:
        from deepspeed import comm as dist

        check_engine(engine)
        cfg = plugin.config.checkpoint
        self.engine, self.plugin, self.every = engine, plugin, cfg.memory_every
        self.timeout_s = cfg.timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.job = memory.job_key()
        self._user: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.peers: PeerBackup | None = None
        self.persister: SnapshotPersister | None = None
        """Background disk saves of snapshots (``persist_every`` with ``memory_every``)."""
        self.persist_every = cfg.persist_every
        group = None
        if cfg.peer_backup or cfg.persist_every:
            import torch.distributed as tdist

            # A separate gloo group: the snapshot thread sends and agrees on it while training
            # uses the default one.
            group = tdist.new_group(backend="gloo")
        if cfg.peer_backup:
            import torch.distributed as tdist

            from robust_plugins.topology import discover

            hosts = [r.host for r in sorted(discover().records, key=lambda r: r.rank)]
            groups = []
            mpu = getattr(engine, "mpu", None)
            # ZeRO's DP group spans every rank of a pure data-parallel job: leaving it is
            # impossible there, and plan_peers then only keeps the copy off the source's node.
            if mpu is not None and hasattr(mpu, "get_model_parallel_group"):
                groups.append(tdist.get_process_group_ranks(mpu.get_model_parallel_group()))
            groups.append(_replica_ranks(engine, self.world))
            holders = plan_peers(hosts, groups)
            self.peers = PeerBackup(self.job, self.rank, holders, group, timeout_s=self.timeout_s)
            if self.rank == 0:
                log.info("robust_plugins: peer backup holders %s (hosts %s)", holders, sorted(set(hosts)))
        if cfg.persist_every:
            disk = plugin.disk
            self.persister = SnapshotPersister(
                DiskCheckpointer(cfg, rank=self.rank, world_size=self.world,
                                 layout={**disk.layout, "format": PERSIST_FORMAT}, versions=disk.versions,
                                 group=group),
                cfg.dir, ok_to_save=ok_to_save)
        # A third slot with a peer backup: the snapshot whose copy every rank holds stays while
        # newer copies are in flight (checkpoint/peer.py).
        self.store = memory.SnapshotStore(self.job, self.rank, self.world, allowed=_allowed(),
                                          after_commit=self._after_commit, n_slots=3 if self.peers is not None else 2)
        self.zero3 = _zero3.is_zero3(engine)
        """ZeRO-3: a snapshot holds this rank's partitions (``patches/deepspeed_zero3.py``)."""
        if self.zero3:
            _zero3.refuse_sdc(cfg)
        # ZeRO-3 ranks hold disjoint partitions: no replica to check a snapshot against.
        self.sdc = snapshot_check.build(self.store, cfg.verify_replicas,
                                        [self.rank] if self.zero3 else _replica_ranks(engine, self.world),
                                        self.every, self.timeout_s, alone=_zero3.NO_REPLICA if self.zero3 else None)
        """The replica check of every snapshot under robust run (``verify_replicas``), or None."""
        self.background = cfg.memory_copy == "background"
        """Parameters and optimizer state copied on the snapshot thread (``memory_copy``)."""
        self.taken_at: int | None = None
        self.blocking_s: list[float] = []
        """Seconds each snapshot of this process blocked the training loop: its part in the step
        plus, with ``memory_copy: background``, the wait at the next optimizer step."""
        self.wait_s: list[float] = []
        """Of that, the waits at the optimizer step for the background copy (one a snapshot)."""
        self._unsettled = False
        if self.background or self.sdc is not None:
            # Bound now, before the plugin's own step and load wrappers: they stack on top, so this
            # wait runs right before DeepSpeed's step and DeepSpeed's own load.
            from robust_plugins.patches import _guard

            # A pipeline engine's optimizer step is _take_model_step inside train_batch.
            name = "_take_model_step" if engine.pipeline_parallelism else "step"
            _guard.bind_instance(engine, name, _settle_before(getattr(engine, name), self._settle_in_step))
            _guard.bind_instance(engine, "load_checkpoint", _settle_before(engine.load_checkpoint, self.settle))
        self.restored: dict | None = None
        """What the last restore used: ``{"step", "source"}``."""
        self.pending_user: dict | None = None
        """Registered state a restore inside ``deepspeed.initialize`` found before the script
        could register it (``patches/deepspeed_resume.py`` sets ``{}`` for that restore): handed to
        ``register`` when it comes; None outside that window, when an unknown name is an error."""
        self.client_state: dict | None = None
        """``{"step", "state"}``: the last ``save_checkpoint`` call's client_state (a copy), carried
        by every snapshot from then on; set back by a restore."""
        self._persisted_step: int | None = None
        self._track()
        _finish_before_destroy()

    # ------------------------------------------------------------------------------- capture
    def capture(self) -> dict:
        """The engine's whole training state (live tensors; the store copies them)."""
        e = self.engine
        state = {
            "counters": {"global_steps": e.global_steps, "global_samples": e.global_samples,
                         "skipped_steps": e.skipped_steps, "micro_steps": e.micro_steps},
            **(_zero3.capture(e) if self.zero3 else
               {"module": e.module.state_dict(), "optimizer": e.optimizer.state_dict()}),
            "lr_scheduler": e.lr_scheduler.state_dict() if e.lr_scheduler is not None else None,
            "rng": rng_state(),
            "compression": self.plugin.state_dict() if self.plugin.has_state else None,
            "user": {name: get() for name, (get, _) in self._user.items()},
            "client_state": self.client_state,
        }
        return state

    def note_client_state(self, client_state) -> None:
        """``save_checkpoint(client_state=...)`` was called: keep a copy in the snapshots (module
        docstring), re-taking this step's snapshot if it was taken already."""
        cs = dict(client_state or {})
        try:
            flat.flatten(cs, _allowed())  # refuse now, naming the key, not at the next step
        except CheckpointError as exc:
            raise CheckpointError(f"save_checkpoint(client_state=...) cannot go into an in-memory snapshot "
                                  f"(checkpoint.memory_every): {exc} Keep client_state to tensors and plain "
                                  f"data, or remove memory_every; nothing was saved.") from exc
        cs = copy.deepcopy(cs)  # the caller may change its dict or tensors after the call
        n = self.engine.global_steps
        self.client_state = {"step": n, "state": cs}
        if self.taken_at == n:
            self._save(n, replace_newest=True)

    def apply(self, state: dict) -> None:
        """Load a captured state into the engine (same layout)."""
        e = self.engine
        zero = _zero_optimizer(e)
        if self.zero3:
            _zero3.apply(e, state)
        elif zero is not None:
            e.module.load_state_dict(state["module"], strict=True)
            from deepspeed import comm as dist

            dp_rank = dist.get_rank(group=zero.dp_process_group)
            sd_list = [None] * dist.get_world_size(group=zero.dp_process_group)
            sd_list[dp_rank] = state["optimizer"]
            zero.load_state_dict(sd_list, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            e.module.load_state_dict(state["module"], strict=True)
            e.optimizer.load_state_dict(state["optimizer"])
        if e.lr_scheduler is not None and state["lr_scheduler"] is not None:
            e.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for key, value in state["counters"].items():
            setattr(e, key, value)
        set_rng_state(state["rng"])
        if state["compression"] is not None and self.plugin.has_state:
            self.plugin.load_state_dict(state["compression"])
        for name, value in state["user"].items():
            if name in self._user:
                self._user[name][1](value)
            elif self.pending_user is not None:
                self.pending_user[name] = value
            else:
                raise CheckpointError(f"The snapshot holds registered state {name!r}, which this run did not "
                                      f"register (registered: {sorted(self._user)}). Register it before loading.")
        self.client_state = state.get("client_state")
        step = state["counters"]["global_steps"]
        if self.client_state is not None and self.client_state["step"] != step:
            log.warning("robust_plugins: [rank %d] the client_state returned was given to save_checkpoint at "
                        "step %d; the state restored is step %d. Values that change every step (a data "
                        "position) belong in engine.robust_plugins.memory.register().", self.rank,
                        self.client_state["step"], step)

    def check_pending_user(self, when: str) -> None:
        """Raise if the resume in ``deepspeed.initialize`` restored registered state that the
        script has not registered by ``when`` (it would be lost without a word)."""
        if self.pending_user:
            names = sorted(self.pending_user)
            raise CheckpointError(
                f"The snapshot restored in deepspeed.initialize holds registered state {names}, which this "
                f"run did not register before {when} (registered: {sorted(self._user)}). Call "
                f"engine.robust_plugins.memory.register(name, get, set) for each right after "
                f"deepspeed.initialize.")
        self.pending_user = None

    def restored_client_state(self) -> dict:
        """What ``load_checkpoint`` returns as client_state after a restore of a snapshot."""
        return dict(self.client_state["state"]) if self.client_state is not None else {}

    def _module(self):
        return self.engine.module

    def _save(self, n: int, replace_newest: bool = False) -> None:
        t0 = time.perf_counter()  # building the state dicts is blocking too
        if not replace_newest:
            self._before_snapshot(n)
        state = self.capture()
        self.store.save(n, state, replace_newest=replace_newest, defer=self.stable_tensors(state),
                        timeout_s=self.timeout_s, replicated=self._replicated())
        self.blocking_s.append(time.perf_counter() - t0)
        self._unsettled = self.background or self.sdc is not None

    # ---------------------------------------------------------------------------------- hooks
    def on_step(self, engine=None) -> None:
        """Step observer (``add_step_observer``), after every optimizer step: snapshot at every
        ``memory_every``-th step (and every ``persist_every``-th, which the background save
        writes from)."""
        self.check_pending_user("the first optimizer step after it")
        n = self.engine.global_steps
        due = n % self.every == 0 or (self.persister is not None and n % self.persist_every == 0)
        if due and n != self.taken_at:
            self.taken_at = n
            self._save(n)

    def restore(self, disk_step: int | None) -> tuple[int, str] | None:
        """Restore from memory (own, then a peer's copy) on every rank; (step, source) or None."""
        t0 = time.perf_counter()
        self.settle()  # a snapshot still copying reads the tensors apply() overwrites
        found = restore_from_memory(self.store, self.peers, self.timeout_s, disk_step=disk_step,
                                    device=self.engine.device, max_step=rollback_bound())
        if found is None:
            return None
        step, state, source = found
        self.apply(state)
        self.taken_at = step
        self.restored = {"step": step, "source": source, "seconds": time.perf_counter() - t0}
        record_restore(step, source, self.restored["seconds"])
        return step, source

    def load_from_disk(self, root: str, tag: str) -> None:
        """Apply this rank's state from a verified checkpoint written by the background saver."""
        self.settle()
        step, state = load_snapshot_checkpoint(root, tag, self.rank, self.job, self.world, _allowed())
        self.apply(state)
        self.taken_at = step



def _replica_ranks(engine, world: int) -> list[int]:
    """Global ranks holding the same parameters as this one: ZeRO 1/2's data-parallel group (with
    sequence parallelism, the group its gradients are reduced over), else every rank."""
    import torch.distributed as tdist

    group = getattr(engine, "seq_data_parallel_group", None)
    return tdist.get_process_group_ranks(group) if group is not None else list(range(world))


def _settle_before(original: Callable, settle: Callable[[], Any]) -> Callable:
    # One closure for engine.step and engine.load_checkpoint: wait for the snapshot copy, then
    # run what was bound (DeepSpeed's method).
    def settled(*args, **kwargs):
        settle()
        return original(*args, **kwargs)

    return settled


def record_restore(step: int, source: str, seconds: float) -> None:
    """Append one line to ``$ROBUST_RUN_DIR/restores.jsonl`` (under ``robust run``) and log it."""
    from robust_plugins._logging import current_rank

    line = {"rank": current_rank(), "incarnation": int(os.environ.get("ROBUST_INCARNATION", "0") or 0),
            "step": step, "source": source, "seconds": round(seconds, 6), "time": time.time()}
    log.info("robust_plugins: [rank %d] restored step %d from %s in %.3f s", line["rank"], step, source, seconds)
    run_dir = os.environ.get("ROBUST_RUN_DIR")
    if run_dir and os.path.isdir(run_dir):
        with open(os.path.join(run_dir, RESTORE_LOG), "a") as f:
            f.write(json.dumps(line) + "\n")

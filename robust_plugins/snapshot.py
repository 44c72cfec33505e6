"""In-memory snapshots for a plain PyTorch training loop: DDP, FSDP2 (``fully_shard``), one process.

::

    import robust_plugins

    model = DistributedDataParallel(net)          # or fully_shard(net), or net alone
    optimizer = torch.optim.AdamW(model.parameters())
    snap = robust_plugins.Snapshotter(model, optimizer, {"memory_every": 1}, lr_scheduler=sched)
    snap.register("data", get=lambda: {"pos": loader_pos}, set_=restore_pos)   # optional
    start = snap.restore() or 0     # own memory -> a peer's copy -> disk (persist_every); None: fresh
    for step in range(start + 1, total + 1):
        ...forward, backward, optimizer.step()...
        snap.step_end(step, loss=loss)     # snapshot, then robust run's step signal
    snap.close()

The same machinery as the hosts' bindings (``patches/deepspeed_memory.py``,
``patches/megatron_memory.py``), through public torch APIs only: the shared-memory store
(:mod:`robust_plugins.checkpoint.memory`), the peer copies (``peer_backup``), the replica check
of each snapshot under ``robust run`` (``verify_replicas``, DDP: every rank is a replica), the
restore order of :mod:`robust_plugins.checkpoint.restore`, background disk saves from committed
snapshots (``persist_every`` with ``dir``), and ``robust run``'s rollback bound.

What one snapshot holds, so that a restored loop continues bitwise (same world size and layout):

* the step, ``model.state_dict()`` and ``optimizer.state_dict()``; with FSDP2 (parameters are
  ``DTensor``) ``torch.distributed.checkpoint.state_dict.get_state_dict``'s model and optimizer
  state, each ``DTensor`` as this rank's local shard (no gather), loaded back with
  ``set_state_dict`` on the live parameters' mesh and placements,
* the LR scheduler's ``state_dict()`` (``lr_scheduler=``),
* RNG states: torch CPU (and this rank's device), numpy, Python,
* whatever the script registers with :meth:`Snapshotter.register` (a data position).

With ``memory_copy: background`` (the default) parameters and optimizer state are copied on the
snapshot thread while the next forward and backward run; a step pre-hook on the optimizer
(``register_step_pre_hook``) makes the next ``optimizer.step()`` wait until the snapshot is
committed, so a loop must change parameters and optimizer state only inside ``optimizer.step()``
(else ``memory_copy: in_step``). Buffers (batch-norm statistics) are copied inside the step.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

import torch

from robust_plugins._logging import get_logger
from robust_plugins.checkpoint import binding, memory
from robust_plugins.checkpoint.binding import SnapshotBinding, collect_ptrs, rng_state, set_rng_state
from robust_plugins.checkpoint.disk import DiskCheckpointer
from robust_plugins.checkpoint.peer import PeerBackup, plan_peers
from robust_plugins.checkpoint.persist import FORMAT as PERSIST_FORMAT
from robust_plugins.checkpoint.persist import SnapshotPersister, is_snapshot_checkpoint, load_snapshot_checkpoint
from robust_plugins.checkpoint.restore import restore_from_memory, rollback_bound
from robust_plugins.config import CheckpointConfig, PluginConfig
from robust_plugins.errors import CheckpointError, ConfigError, UnsupportedError
from robust_plugins.patches.deepspeed_memory import _finish_before_destroy, record_restore
from robust_plugins.watchdog import ok_to_save, snapshot_check

log = get_logger(__name__)

#: Why an FSDP2 loop has no replica check: every rank holds other shards.
FSDP_ALONE = "FSDP2 shards the parameters: no rank holds another's, so no replica to compare with"


def _config(config: Any) -> CheckpointConfig:
    """The ``checkpoint`` block, ``memory_every`` defaulting to 1."""
    if config is None:
        config = {}
    if isinstance(config, PluginConfig):
        if config.checkpoint is None:
            raise ConfigError("Snapshotter: the PluginConfig has no checkpoint sub-block; pass "
                              "{'memory_every': 1} (the checkpoint sub-block) instead.")
        config = config.checkpoint
    if isinstance(config, Mapping):
        config = PluginConfig.from_dict({"checkpoint": {"memory_every": 1, **dict(config)}}).checkpoint
    if not isinstance(config, CheckpointConfig):
        raise ConfigError(f"Snapshotter: config must be the checkpoint sub-block (a dict or CheckpointConfig), "
                          f"got {type(config).__name__}.")
    if config.memory_every is None:
        raise ConfigError("Snapshotter: checkpoint.memory_every is null, which turns the snapshots off; set it "
                          "to a number of steps (e.g. 1) or do not create a Snapshotter.")
    return config


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


class Snapshotter(SnapshotBinding):
    """In-memory snapshots of one plain PyTorch loop (see the module docstring).

    Args:
        model: the module trained (``DistributedDataParallel``, an FSDP2 ``fully_shard`` module,
            or a plain module); its parameters are those ``optimizer`` steps.
        optimizer: a ``torch.optim.Optimizer`` (others are refused: their state is not captured).
        config: the ``checkpoint`` sub-block as a dict or ``CheckpointConfig`` (``memory_every``,
            default 1; ``peer_backup``, ``verify_replicas``, ``memory_copy``, ``timeout_s``, and
            ``persist_every`` with ``dir`` for background disk saves).
        lr_scheduler: captured and restored with the rest (optional).
        replicas: global ranks holding the same parameters as this one, for the replica check
            (default: every rank with replicated parameters, none with FSDP2).

    Collective: every rank creates it at the same point, after ``init_process_group``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Any = None, *,
                 lr_scheduler: Any = None, replicas: list[int] | None = None) -> None:
        import torch.distributed as dist

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UnsupportedError(f"Snapshotter: optimizer must be a torch.optim.Optimizer, got "
                                   f"{type(optimizer).__name__}, whose state would not be captured. Pass the "
                                   f"torch optimizer (not a wrapper).")
        cfg = _config(config)
        self.model, self.optimizer, self.lr_scheduler, self.config = model, optimizer, lr_scheduler, cfg
        self.every, self.timeout_s = cfg.memory_every, cfg.timeout_s
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self.fsdp = any(_is_dtensor(p) for p in model.parameters())
        """Parameters are DTensors (FSDP2): state through torch.distributed.checkpoint.state_dict."""
        self.job = memory.job_key()
        self._user: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.peers: PeerBackup | None = None
        self.persister: SnapshotPersister | None = None
        self.persist_every = cfg.persist_every
        everyone = list(range(self.world))
        self.replicas = ([self.rank] if self.fsdp else everyone) if replicas is None else list(replicas)
        group = None
        if cfg.peer_backup or cfg.persist_every:
            # A gloo group of its own: the snapshot thread sends and agrees on it while training
            # uses the default one.
            group = dist.new_group(backend="gloo")
        if cfg.peer_backup:
            from robust_plugins.topology import discover

            hosts = [r.host for r in sorted(discover().records, key=lambda r: r.rank)]
            holders = plan_peers(hosts, [self.replicas])
            self.peers = PeerBackup(self.job, self.rank, holders, group, timeout_s=self.timeout_s)
        layout = {"format": PERSIST_FORMAT, "host": "torch", "fsdp": self.fsdp}
        versions = {"torch": torch.__version__}
        if cfg.persist_every:
            self.persister = SnapshotPersister(
                DiskCheckpointer(cfg, rank=self.rank, world_size=self.world, layout=layout, versions=versions,
                                 group=group), cfg.dir, ok_to_save=ok_to_save)
        self.disk = DiskCheckpointer(cfg, rank=self.rank, world_size=self.world, layout=layout,
                                     versions=versions) if cfg.dir else None
        after = self._after_commit if self.peers is not None or self.persister is not None else None
        self.store = memory.SnapshotStore(self.job, self.rank, self.world, allowed={}, after_commit=after,
                                          n_slots=3 if self.peers is not None else 2)
        self.sdc = snapshot_check.build(self.store, cfg.verify_replicas, self.replicas, self.every, self.timeout_s,
                                        alone=FSDP_ALONE if self.fsdp else None)
        """The replica check of every snapshot under robust run (``verify_replicas``), or None."""
        self.background = cfg.memory_copy == "background"
        self.taken_at: int | None = None
        self.blocking_s: list[float] = []
        """Seconds each snapshot blocked the loop: its part in ``step_end`` plus the wait at the
        next ``optimizer.step()`` for the background copy."""
        self.wait_s: list[float] = []
        self._unsettled = False
        waits = self.background or self.sdc is not None
        self._hook = optimizer.register_step_pre_hook(self._settle_in_step) if waits else None
        self.restored: dict | None = None
        """What the last :meth:`restore` used: ``{"step", "source", "seconds"}``, or None."""
        self._persisted_step: int | None = None
        self._closed = False
        self._track()
        _finish_before_destroy()

    # ------------------------------------------------------------------------------- capture
    def capture(self, step: int) -> dict:
        """The loop's whole state (live tensors, FSDP2 shards as local tensors; the store copies)."""
        dtensors: list[list[str]] = []
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.optimizer)
            msd = {k: self._shard(v, ["model", k], dtensors) for k, v in msd.items()}
            osd = dict(osd, state={fqn: {k: self._shard(v, ["optimizer", fqn, k], dtensors) for k, v in s.items()}
                                   for fqn, s in osd["state"].items()})
        else:
            msd, osd = self.model.state_dict(), self.optimizer.state_dict()
        return {
            "step": int(step),
            "model": msd,
            "optimizer": osd,
            "dtensors": dtensors,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": rng_state(),
            "user": {name: get() for name, (get, _) in self._user.items()},
        }

    @staticmethod
    def _shard(value: Any, path: list[str], dtensors: list[list[str]]) -> Any:
        if _is_dtensor(value):
            dtensors.append(path)
            return value.to_local()
        return value

    def apply(self, state: dict) -> int:
        """Load a captured state into the live model, optimizer, scheduler, RNG and registered state."""
        if self.fsdp:
            self._apply_sharded(state)
        else:
            self.model.load_state_dict(state["model"], strict=True)
            self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        set_rng_state(state["rng"])
        for name, value in state["user"].items():
            if name not in self._user:
                raise CheckpointError(f"The snapshot holds registered state {name!r}, which this run did not "
                                      f"register (registered: {sorted(self._user)}). Call "
                                      f"Snapshotter.register before restore().")
            self._user[name][1](value)
        return int(state["step"])

    def _apply_sharded(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_state_dict
        from torch.distributed.tensor import DTensor

        live = get_model_state_dict(self.model)  # the mesh and placements each shard goes back to
        msd, osd = dict(state["model"]), dict(state["optimizer"])
        osd["state"] = {fqn: dict(s) for fqn, s in osd["state"].items()}
        for path in state["dtensors"]:
            where, key = (msd, path[1]) if path[0] == "model" else (osd["state"][path[1]], path[2])
            like = live.get(path[1])
            if not _is_dtensor(like):
                raise CheckpointError(f"restore: the snapshot holds {'/'.join(path)} as an FSDP2 shard, but this "
                                      f"run's {path[1]!r} is not sharded; restart with the layout it was taken with.")
            where[key] = DTensor.from_local(where[key], like.device_mesh, like.placements, run_check=False,
                                            shape=like.shape, stride=like.stride())
        set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd)

    def stable_tensors(self, state: dict) -> set[int] | None:
        """``data_ptr()`` of the parameters (FSDP2: their local shards) and the optimizer's
        state: only ``optimizer.step()`` changes them, so the snapshot thread copies them."""
        if not self.background:
            return None
        ptrs = {_local(p).data_ptr() for p in self.model.parameters() if p.numel()}
        collect_ptrs(state["optimizer"], ptrs)
        return ptrs

    def _module(self) -> torch.nn.Module:
        return self.model

    # ---------------------------------------------------------------------------------- hooks
    def step_end(self, step: int, loss: Any = None, grad_norm: Any = None) -> None:
        """After ``optimizer.step()`` of ``step`` (every rank): snapshot every ``memory_every``-th
        step (and every ``persist_every``-th), then send the step signal to ``robust run``
        (:func:`robust_plugins.watchdog.step_end`; a no-op outside it). The snapshot comes first:
        a rank killed after the signal finds its step in memory."""
        from robust_plugins import watchdog

        due = step % self.every == 0 or (self.persister is not None and step % self.persist_every == 0)
        if due and step != self.taken_at:
            self.taken_at = step
            t0 = time.perf_counter()  # building the state dicts is blocking too
            self._before_snapshot(step)
            state = self.capture(step)
            self.store.save(step, state, defer=self.stable_tensors(state), timeout_s=self.timeout_s,
                            replicated=self._replicated())
            self.blocking_s.append(time.perf_counter() - t0)
            self._unsettled = self._hook is not None
        watchdog.step_end(step, loss=loss, grad_norm=grad_norm)

    # -------------------------------------------------------------------------------- restore
    def restore(self, disk_step: int | None = None) -> int | None:
        """Restore the newest state every rank can: own memory snapshot -> a peer's copy -> the
        newest verified disk checkpoint in ``dir`` (``persist_every``) -> older ones; never a step
        newer than ``robust run``'s rollback bound. Returns the step restored (the loop goes on at
        the next one), or None: nothing restored (a fresh start, or the script loads its own disk
        checkpoint). ``disk_step``: the step of the script's own newest disk checkpoint, when it
        keeps one: memory snapshots older than it are skipped. Collective."""
        from robust_plugins.checkpoint import scan

        t0 = time.perf_counter()
        self.settle()  # a snapshot still copying reads the tensors apply() overwrites
        bound = rollback_bound()
        if self.disk is not None:
            steps = [e.manifest.step for e in scan(self.config.dir)
                     if e.manifest is not None and (bound is None or e.manifest.step <= bound)]
            disk_step = max([*steps, *([disk_step] if disk_step is not None else [])], default=None)
        found = restore_from_memory(self.store, self.peers, self.timeout_s, disk_step=disk_step, max_step=bound)
        if found is not None:
            step, state, source = found
        else:
            tag = self.disk.select(self.config.dir, max_step=bound) if self.disk is not None else None
            if tag is None:
                return None
            if not is_snapshot_checkpoint(self.config.dir, tag):
                raise CheckpointError(f"Checkpoint {os.path.join(self.config.dir, tag)} was not written by a "
                                      f"Snapshotter (persist_every); it was not loaded. Point checkpoint.dir at "
                                      f"the Snapshotter's own directory.")
            step, state = load_snapshot_checkpoint(self.config.dir, tag, self.rank, self.job, self.world)
            source = f"disk:{tag}"
        if self.apply(state) != step:
            raise CheckpointError(f"restore: the snapshot of step {step} on rank {self.rank} holds another step")
        self.taken_at = step
        self.restored = {"step": step, "source": source, "seconds": time.perf_counter() - t0}
        record_restore(step, source, self.restored["seconds"])
        return step

    def close(self, remove: bool | None = None) -> None:
        """Remove the optimizer hook, finish pending hand-offs and unmap (also at interpreter exit).
        ``remove``: delete this rank's shared-memory files; None: outside ``robust run`` (which
        removes a completed job's files itself) unless an unhandled exception was seen."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if remove is None:  # the rule of SnapshotBinding._at_exit
            remove = not binding._CRASHED and not os.environ.get("ROBUST_RUN_DIR")
        super().close(remove)

"""megatron-core binding of the in-memory snapshots (``checkpoint.memory_every`` / ``peer_backup``).

Used by :class:`robust_plugins.megatron.MegatronCheckpointer` when its checkpoint block sets
``memory_every``: :meth:`MegatronMemory.on_step` (called from ``step_end``, before the step signal
reaches ``robust run``) copies the training state into this rank's shared-memory slot, and
``MegatronCheckpointer.load()`` restores in the order own memory snapshot -> a peer's copy ->
newest verified ``dist_checkpointing`` checkpoint -> older ones, as the DeepSpeed binding does.

What one snapshot holds, so that a restored loop continues bitwise as if never stopped (same
world size and parallel layout):

* the step, every model chunk's ``module.state_dict()`` (this rank's shards of parameters and
  buffers; several chunks with virtual pipeline stages),
* the optimizer: megatron-core's own (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
  ``DistributedOptimizer``, chained; :mod:`robust_plugins.patches.megatron_optim`: this rank's
  shard of the optimizer state, its fp32 main parameters and the grad scaler, no gather) or a
  ``torch.optim`` optimizer's ``state_dict()``; others are refused,
* each chunk's plugin state (error-feedback residuals, sync count),
* RNG states: torch CPU (and CUDA where initialized), numpy, Python, and megatron's
  tensor-parallel tracker (``get_cuda_rng_tracker().get_states()``, the model-parallel streams),
* whatever the script registers with :meth:`MegatronMemory.register` (a data position).

The core (``robust_plugins.checkpoint.memory``, ``peer``, ``restore``) is shared with DeepSpeed.

With ``memory_copy: background`` (the default) parameters and optimizer state are copied on the
snapshot thread, overlapped with the next forward and backward; a step pre-hook on the torch
optimizer (``register_step_pre_hook``, torch's public API; for megatron's optimizers on each torch
optimizer they wrap, which steps before any parameter, main parameter or moment changes) makes
the next ``optimizer.step()`` wait until the snapshot is committed, and that wait is counted in
``blocking_s``. A restore waits too before it overwrites the state.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from robust_plugins._logging import get_logger
from robust_plugins.checkpoint import memory
from robust_plugins.checkpoint.peer import PeerBackup, plan_peers
from robust_plugins.checkpoint.restore import restore_from_memory, rollback_bound
from robust_plugins.errors import CheckpointError, UnsupportedError
from robust_plugins.patches import megatron_optim
from robust_plugins.watchdog import snapshot_check
from robust_plugins.checkpoint.binding import SnapshotBinding, rng_state, set_rng_state
from robust_plugins.patches.deepspeed_memory import _finish_before_destroy, record_restore

log = get_logger(__name__)


def _replica_ranks() -> list[int]:
    """Global ranks holding this rank's parameters: its data-parallel group with context
    parallelism (context-parallel ranks hold the same weights)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))


def _allowed() -> dict[str, type]:
    # Snapshots hold tensors and plain data only: no class needs to be allowed.
    return {}


def plugin_states(plugins: list) -> Any:
    """The chunks' plugin states as a checkpoint stores them: one chunk's state (or None), a list
    of them with several chunks (virtual pipeline stages)."""
    states = [None if p is None else p.state_dict() for p in plugins]
    return states[0] if len(states) == 1 else states


def load_plugin_states(plugins: list, saved: Any, where: str) -> None:
    """Restore :func:`plugin_states`' output into ``plugins`` (same chunks, same plugin configs);
    CheckpointError naming ``where`` when the saved states do not fit."""
    saved = saved if isinstance(saved, list) else [saved]
    if len(saved) != len(plugins):
        raise CheckpointError(f"{where} holds robust_plugins state of {len(saved)} model chunk(s), this job has "
                              f"{len(plugins)}; load it with the virtual pipeline size it was saved with.")
    for i, (plugin, state) in enumerate(zip(plugins, saved)):
        if plugin is None:
            continue
        if state is None:
            raise CheckpointError(f"{where} holds no robust_plugins state for model chunk {i}, but this job has "
                                  f"the plugin enabled there; load it with the plugin config it was saved with.")
        plugin.load_state_dict(state)


class MegatronMemory(SnapshotBinding):
    """Snapshots of one megatron-core training loop (``MegatronCheckpointer.memory``): ``chunks``
    (the model's DDP chunks, one without virtual pipeline stages), the optimizer over all of them,
    ``plugins`` (one or None per chunk) and the ``checkpoint`` block."""

    def __init__(self, chunks: list, optimizer, plugins: list, config) -> None:
        import torch.distributed as dist

        self.megatron_optimizer = optimizer is not None and megatron_optim.is_megatron_optimizer(optimizer)
        if self.megatron_optimizer:
            megatron_optim.check(optimizer, "checkpoint.memory_every")
        elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise UnsupportedError(
                f"checkpoint.memory_every with megatron-core supports megatron's optimizers "
                f"({megatron_optim.SERVED}) and torch.optim optimizers; this loop has {type(optimizer).__name__}, "
                f"whose state is never captured here. Remove memory_every (disk checkpoints work) or use one of those.")
        self.chunks, self.optimizer, self.plugins = list(chunks), optimizer, list(plugins)
        self._modules = torch.nn.ModuleList([c.module for c in self.chunks])
        self.every, self.timeout_s = config.memory_every, config.timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.job = memory.job_key()
        self._user: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.peers: PeerBackup | None = None
        if config.peer_backup:
            from megatron.core import parallel_state as ps

            from robust_plugins.topology import discover

            # A separate gloo group: the snapshot thread sends on it while training runs.
            group = dist.new_group(backend="gloo")
            hosts = [r.host for r in sorted(discover().records, key=lambda r: r.rank)]
            groups = [dist.get_process_group_ranks(ps.get_model_parallel_group()),
                      dist.get_process_group_ranks(ps.get_data_parallel_group())]
            holders = plan_peers(hosts, groups)
            self.peers = PeerBackup(self.job, self.rank, holders, group, timeout_s=self.timeout_s)
            if self.rank == 0:
                log.info("robust_plugins: peer backup holders %s (hosts %s)", holders, sorted(set(hosts)))
        # A third slot with a peer backup: the snapshot whose copy every rank holds stays while
        # newer copies are in flight (checkpoint/peer.py).
        self.store = memory.SnapshotStore(self.job, self.rank, self.world, allowed=_allowed(),
                                          after_commit=self._after_commit if self.peers is not None else None,
                                          n_slots=3 if self.peers is not None else 2)
        self.sdc = snapshot_check.build(self.store, config.verify_replicas, _replica_ranks(), self.every,
                                        self.timeout_s)
        """The replica check of every snapshot under robust run (``verify_replicas``), or None."""
        self.background = config.memory_copy == "background" and optimizer is not None
        """Parameters and optimizer state copied on the snapshot thread (``memory_copy``)."""
        self.taken_at: int | None = None
        self.blocking_s: list[float] = []
        """Seconds each snapshot of this process blocked the training loop: its part in the step
        plus, with ``memory_copy: background``, the wait at the next ``optimizer.step()``."""
        self.wait_s: list[float] = []
        """Of that, the waits at the optimizer step for the background copy (one a snapshot)."""
        self._unsettled = False
        waits = self.background or (self.sdc is not None and optimizer is not None)
        stepped = (megatron_optim.inner_optimizers(optimizer) if self.megatron_optimizer
                   else [optimizer] if optimizer is not None else [])
        self._hooks = [o.register_step_pre_hook(self._settle_in_step) for o in stepped] if waits else []
        self.restored: dict | None = None
        """What the last restore used: ``{"step", "source", "seconds"}``."""
        self._track()
        _finish_before_destroy()

    # ------------------------------------------------------------------------------- capture
    def capture(self, step: int) -> dict:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        rng = rng_state()
        rng["tracker"] = get_cuda_rng_tracker().get_states()
        return {
            "step": int(step),
            "modules": [c.module.state_dict() for c in self.chunks],
            "optimizer": self._optimizer_state(),
            "plugins": [None if p is None else p.state_dict() for p in self.plugins],
            "rng": rng,
            "user": {name: get() for name, (get, _) in self._user.items()},
        }

    def apply(self, state: dict) -> int:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if len(state["modules"]) != len(self.chunks):
            raise CheckpointError(f"restore: the snapshot holds {len(state['modules'])} model chunk(s), this job "
                                  f"{len(self.chunks)}; restart with the virtual pipeline size it was taken with.")
        for chunk, saved in zip(self.chunks, state["modules"]):
            chunk.module.load_state_dict(saved, strict=True)
        if self.megatron_optimizer:
            megatron_optim.apply(self.optimizer, state["optimizer"])
        elif self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        load_plugin_states(self.plugins, state["plugins"], "The in-memory snapshot")
        rng = dict(state["rng"])
        get_cuda_rng_tracker().set_states(rng.pop("tracker"))
        set_rng_state(rng)
        for name, value in state["user"].items():
            if name not in self._user:
                raise CheckpointError(f"The snapshot holds registered state {name!r}, which this run did not "
                                      f"register (registered: {sorted(self._user)}). Register it before loading.")
            self._user[name][1](value)
        return int(state["step"])

    def _optimizer_state(self):
        if self.optimizer is None:
            return None
        return megatron_optim.capture(self.optimizer) if self.megatron_optimizer else self.optimizer.state_dict()

    def _module(self):
        return self._modules

    def _replica_params(self) -> list:
        # Expert parameters (megatron marks them allreduce=False) are replicated over the expert
        # data-parallel group, not the data-parallel one: they are not compared.
        return [p for p in self._modules.parameters() if getattr(p, "allreduce", True)]

    # ---------------------------------------------------------------------------------- hooks
    def on_step(self, step: int) -> None:
        """After the optimizer step ``step`` (every rank): snapshot every ``memory_every``-th."""
        if step % self.every == 0 and step != self.taken_at:
            self.taken_at = step
            t0 = time.perf_counter()  # building the state dicts is blocking too
            self._before_snapshot(step)
            state = self.capture(step)
            self.store.save(step, state, defer=self.stable_tensors(state), timeout_s=self.timeout_s,
                            replicated=self._replicated())
            self.blocking_s.append(time.perf_counter() - t0)
            self._unsettled = bool(self._hooks)

    def close(self, remove: bool) -> None:
        """Remove the optimizer hook, then finish and close as :meth:`SnapshotBinding.close`."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        super().close(remove)

    def restore(self, disk_step: int | None) -> int | None:
        """Own memory, then a peer's copy, on every rank (a collective); the step or None."""
        t0 = time.perf_counter()
        self.settle()  # a snapshot still copying reads the tensors apply() overwrites
        found = restore_from_memory(self.store, self.peers, self.timeout_s, disk_step=disk_step,
                                    max_step=rollback_bound())
        if found is None:
            return None
        step, state, source = found
        if self.apply(state) != step:
            raise CheckpointError(f"restore: the snapshot of step {step} on rank {self.rank} holds another step")
        self.taken_at = step
        self.restored = {"step": step, "source": source, "seconds": time.perf_counter() - t0}
        record_restore(step, source, self.restored["seconds"])
        return step

    def restored_from_disk(self, step: int, tag: str, seconds: float) -> None:
        """Note that the disk checkpoint ``tag`` restored ``step`` (the next snapshot is the one
        after it) and append it to ``restores.jsonl``."""
        self.taken_at = step
        record_restore(step, f"disk:{tag}", seconds)

"""megatron-core users' entry points: one call to route gradient sync, plus loop hooks.

::

    import robust_plugins.megatron as rpm

    ddp = DistributedDataParallel(config, ddp_config, gpt_model)
    plugin = rpm.enable(ddp, {"compression": {"codec": "int8"}})      # patches/megatron.py
    ckpt = rpm.MegatronCheckpointer(ddp, optimizer, {"dir": "ckpt", "keep": 3}, plugin=plugin,
                                    global_batch=64, micro_batch=4)   # optional: elastic resume
    start = ckpt.load()                       # newest checkpoint that verifies, or None
    for step in range((start or 0) + 1, total + 1):
        loss = train_step(step, ckpt.gradient_accumulation_steps)   # may change after a reshard
        ckpt.step_end(step, loss=loss)        # watchdog signal; emergency save + exit on SIGTERM
        if step % save_every == 0:
            ckpt.save(step)

This module never imports megatron-core itself: every call into it is in ``patches/``
(``megatron.py``: gradient sync; ``megatron_checkpoint.py``: the layout, sharded state dicts,
``dist_checkpointing`` save and load; ``megatron_memory.py``: snapshots; ``megatron_cpu.py``: the
CPU shim), which import megatron-core when these functions run.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Mapping

import torch

from robust_plugins._logging import get_logger
from robust_plugins.config import CheckpointConfig, PluginConfig
from robust_plugins.device import collective_device, device_rng_state, set_device_rng_state
from robust_plugins.errors import CheckpointError, ConfigError, UnsupportedError
from robust_plugins.patches import megatron_checkpoint as mcore
from robust_plugins.watchdog.client import final_refusals
from robust_plugins.watchdog.protocol import pg_timeout

log = get_logger(__name__)

#: Per-rank file written into every checkpoint next to megatron's dist_checkpointing files.
STATE_FILE = "robust_plugins_rank{rank:05d}.pt"

#: Seconds of steps between the ranks' SIGTERM agreements: of torchrun's 30 s between SIGTERM and
#: SIGKILL, 29 s are left for the emergency save. Steps of 1 s or more agree at every step, where
#: one host sync (about a millisecond of exposed launch latency) costs under 0.1 %.
TERM_CHECK_S = 1.0

#: Most steps between two agreements (a job of 1 ms steps still agrees every 1,000 steps).
TERM_CHECK_MAX_STEPS = 1000


def term_check_interval(step_s: float | None) -> int:
    """Steps until the next SIGTERM agreement at ``step_s`` seconds a step (pure): as many as fit
    in :data:`TERM_CHECK_S`, 1 to :data:`TERM_CHECK_MAX_STEPS`; 1 while the pace is unknown."""
    if step_s is None or step_s <= 0:
        return 1
    return max(1, min(TERM_CHECK_MAX_STEPS, int(TERM_CHECK_S / step_s)))


def enable(ddp, config: Any = None):
    """Route ``ddp``'s gradient sync through robust_plugins; see :func:`robust_plugins.patches.megatron.enable`."""
    from robust_plugins.patches import megatron as patch

    with final_refusals():  # under robust run a refusal ends the job instead of a restart
        return patch.enable(ddp, config)


def disable(ddp) -> None:
    """Undo :func:`enable`."""
    from robust_plugins.patches import megatron as patch

    patch.disable(ddp)


def name_pipeline_stage() -> None:
    """Have ``robust run``'s straggler detector compare this rank with the ranks of its pipeline
    stage only, for a loop with neither :func:`enable` nor :class:`MegatronCheckpointer` (both do
    it); see :func:`robust_plugins.patches.megatron.name_pipeline_stage`."""
    from robust_plugins.patches import megatron as patch

    patch.name_pipeline_stage()


def shutdown() -> None:
    """End of a megatron-core job: destroy megatron's groups and the default group, and free them
    now, while the interpreter is alive (call it once, last, on every rank).

    A process group that outlives ``destroy_process_group`` is freed during interpreter shutdown
    with its gloo threads running, and the rank then sometimes aborts after its work is done
    (``terminate called without an active exception``, exit -6); megatron-core's own
    ``destroy_model_parallel`` leaves two of its groups set
    (:func:`robust_plugins.patches.megatron.destroy_parallel_state`).
    """
    import gc

    import torch.distributed as dist

    from robust_plugins.patches import megatron as patch

    left = patch.destroy_parallel_state()
    if left:
        log.debug("megatron-core's teardown left %s set; dropped", ", ".join(left))
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # group objects in reference cycles (modules, DDP buffers) go now, not at exit


def apply_rank_order(*, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, topology_file: str | None = None,
                     timeout: Any = None) -> dict[str, Any]:
    """Renumber this job's ranks so that megatron-core's groups follow the topology (collective).

    Call on every rank after ``torch.distributed.init_process_group`` and before megatron's
    ``initialize_model_parallel``. Discovers the topology (:func:`robust_plugins.topology.discover`:
    ``topology_file``, ``ROBUST_TOPOLOGY_SIM``, SLURM, host names...), computes
    :func:`robust_plugins.topology.megatron_rank_order` for these sizes and, unless every process
    already has its rank, re-creates the default process group with each process at its new rank
    (same backend and store, a fresh key prefix). Then megatron's default order puts every TP
    group inside one node (NVLink domain) and DP peers on rails. ``RANK`` in the environment keeps
    the launcher's number (``robust run`` names processes by it).

    Returns ``{"rank": new, "launcher_rank": old, "order": order, "source": ...}``.
    """
    import datetime

    import torch.distributed as dist

    from robust_plugins.topology import discover, inverse, megatron_rank_order

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("apply_rank_order needs an initialized default process group: call "
                          "torch.distributed.init_process_group first.")
    topo = discover(topology_file)
    order = megatron_rank_order(topo.records, tp=tp, pp=pp, cp=cp, ep=ep)
    old, world = dist.get_rank(), dist.get_world_size()
    new = inverse(order)[old]
    out = {"rank": new, "launcher_rank": old, "order": list(order), "source": topo.source}
    if list(order) == list(range(world)):
        return out
    from robust_plugins.patches.torch_c10d import default_store

    store = default_store()  # our reference keeps it alive across the re-init
    if store is None:
        raise ConfigError(f"apply_rank_order: torch {torch.__version__} has no "
                          f"distributed_c10d._get_default_store; launch the processes in the order "
                          f"{list(order)} instead (RANK = position in that list).")
    backend = dist.get_backend()
    dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.PrefixStore("robust_plugins/rank_order/", store), rank=new,
                            world_size=world, timeout=timeout or pg_timeout(600))
    if new == 0:
        log.info("robust_plugins: megatron rank order from %s: process %s -> megatron ranks 0..%d",
                 topo.source, list(order), world - 1)
    return out


def _checkpoint_config(config: Any) -> CheckpointConfig:
    if isinstance(config, CheckpointConfig):
        return config
    if isinstance(config, PluginConfig):
        if config.checkpoint is None:
            raise ConfigError("MegatronCheckpointer: the PluginConfig has no checkpoint sub-block; add "
                              "{'checkpoint': {'dir': ...}} to the robust_plugins block.")
        return config.checkpoint
    if isinstance(config, Mapping):
        return PluginConfig.from_dict({"checkpoint": dict(config)}).checkpoint
    raise ConfigError(f"MegatronCheckpointer: config must be a CheckpointConfig, a PluginConfig or the "
                      f"checkpoint sub-block as a dict, got {type(config).__name__}.")


def _accumulation(global_batch: Any, micro_batch: Any, dp: int) -> int | None:
    """``global_batch / (micro_batch * dp)``, or ConfigError saying which value is wrong."""
    if global_batch is None and micro_batch is None:
        return None
    for name, v in (("global_batch", global_batch), ("micro_batch", micro_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"MegatronCheckpointer: {name} must be an int >= 1 (given together with "
                              f"{'micro_batch' if name == 'global_batch' else 'global_batch'}), got {v!r}.")
    if global_batch % (micro_batch * dp):
        raise ConfigError(f"MegatronCheckpointer: global_batch {global_batch} is not a multiple of micro_batch "
                          f"{micro_batch} x data-parallel size {dp}; no gradient accumulation makes it.")
    return global_batch // (micro_batch * dp)


def _optimizer_kind(opt) -> str | None:
    """``DistributedOptimizer``, ``FP32Optimizer+FP32Optimizer`` (chained), ``AdamW``...; None."""
    if opt is None:
        return None
    chain = getattr(opt, "chained_optimizers", None)
    return "+".join(type(p).__name__ for p in chain) if chain is not None else type(opt).__name__


def _chunks(ddp: Any, vpp: int | None) -> list:
    """The model chunks as a list, checked against megatron's virtual pipeline size."""
    chunks = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
    if len(chunks) != (vpp or 1):
        raise ConfigError(
            f"MegatronCheckpointer: got {len(chunks)} model chunk(s), but this job has "
            f"virtual_pipeline_model_parallel_size = {vpp}; pass {vpp or 1}: every chunk of this rank "
            f"(Megatron-LM's model list, in virtual-stage order), each a megatron DistributedDataParallel.")
    return chunks


def _chunk_plugins(chunks: list, plugin: Any) -> list:
    """One plugin (or None) per chunk: ``plugin`` as given, else each chunk's ``robust_plugins``."""
    if plugin is None:
        return [c.__dict__.get("robust_plugins") for c in chunks]
    plugins = list(plugin) if isinstance(plugin, (list, tuple)) else [plugin]
    if len(plugins) != len(chunks):
        raise ConfigError(f"MegatronCheckpointer: got {len(plugins)} plugin(s) for {len(chunks)} model chunks; "
                          f"pass one per chunk (the list rpm.enable returned for each), or none to use "
                          f"each chunk's own.")
    return plugins


class MegatronCheckpointer:
    """Verified, atomic ``dist_checkpointing`` saves and newest-valid resume for a megatron-core loop.

    A save writes megatron-core's sharded checkpoint (model and optimizer, every rank its shards)
    and one small file per rank (:data:`STATE_FILE`: the step, the plugin's error-feedback
    residuals, the CPU and model-parallel RNG states, and ``extra``) into ``<dir>/.tmp-<tag>``,
    hashes every file, writes ``robust_manifest.json`` and renames the directory to ``<tag>``
    (``robust_plugins.checkpoint``, the same protocol as the DeepSpeed integration). ``load``
    picks the newest checkpoint that verifies, skipping corrupt, truncated or partial ones.

    Args:
        ddp: the megatron-core ``DistributedDataParallel`` model (its ``module`` provides
            ``sharded_state_dict``), or the list of them with virtual pipeline stages (Megatron-LM's
            ``model``: one chunk per virtual stage of this rank, in order; every chunk is saved).
        optimizer: megatron-core's own (``get_megatron_optimizer``: FP32Optimizer,
            Float16OptimizerWithFloat16Params, DistributedOptimizer, chained; others refused,
            :mod:`robust_plugins.patches.megatron_optim`), a ``torch.optim`` optimizer over
            ``ddp.parameters()``, or anything with ``sharded_state_dict``; None saves the model only.
        config: the ``checkpoint`` sub-block (dict / CheckpointConfig) or a PluginConfig holding one.
        plugin: the :class:`~robust_plugins.patches.megatron.MegatronPlugin` from :func:`enable`
            whose residuals are saved, or one per chunk (default: each chunk's ``robust_plugins``).
        emergency_save: install a SIGTERM handler; :meth:`step_end` then saves and exits when
            any rank was asked to stop. Under ``robust run`` also register with
            :func:`robust_plugins.watchdog.on_emergency`: when a peer rank dies no save is possible
            (``dist_checkpointing.save`` needs every rank), and the saver records why in
            ``faults.jsonl``; in-memory snapshots (``memory_every``) restore such a crash.
        global_batch, micro_batch: the loop's global batch (samples per optimizer step) and
            micro batch (per rank and forward pass), both or neither. Recorded in every manifest;
            they make a checkpoint resumable at another data-parallel size (:meth:`load`), which
            keeps the checkpoint's global batch and sets :attr:`gradient_accumulation_steps`.

    Elastic resume: a checkpoint saved at another data-parallel size (same tensor and pipeline
    sizes) is loaded by ``dist_checkpointing``, which reshards model and optimizer state (the
    optimizer must be checkpointed in model space: ``torch.optim`` optimizers, the recipe's
    ``ShardedAdamW``; megatron's ``DistributedOptimizer`` is asked for its ``fully_reshardable``
    format). Compression residuals restart from zero (logged); RNG states and ``extra`` come from
    the saved rank at data-parallel rank 0 with this rank's tensor/pipeline position.

    Virtual pipeline stages: every chunk's parameters, the optimizer over all of them (megatron's
    optimizers take the chunk list) and each chunk's residuals are saved, on disk under
    Megatron-LM's keys ``model0``, ``model1``... and in snapshots as a list; the manifest records
    ``vpp``, and a checkpoint loads only into the same virtual size (megatron's sharded keys
    number layers globally, but the chunk keys differ). Refused: disk checkpoints of such a loop
    with megatron's ``DistributedOptimizer`` and tied embeddings (``save`` and a disk ``load``
    raise UnsupportedError; megatron-core 0.16 does not restore the tied embedding's optimizer
    state there); its snapshots are served.
    """

    def __init__(self, ddp, optimizer=None, config: Any = None, plugin=None, emergency_save: bool = True,
                 global_batch: int | None = None, micro_batch: int | None = None):
        import torch.distributed as dist

        from robust_plugins.checkpoint import DiskCheckpointer
        from robust_plugins.patches.megatron import (check_megatron_version, megatron_version, name_pipeline_stage,
                                                     refuse_moe)

        with final_refusals():
            check_megatron_version()
        name_pipeline_stage()  # robust run's straggler detector compares each stage with itself
        self.chunks = _chunks(ddp, mcore.virtual_pipeline_size())
        """The model chunks saved (one DDP each; several with virtual pipeline stages)."""
        for chunk in self.chunks:
            refuse_moe(getattr(chunk, "config", None), "robust_plugins.megatron.MegatronCheckpointer")
        self.plugins = _chunk_plugins(self.chunks, plugin)
        """Each chunk's plugin (None where a chunk has none), in chunk order."""
        self._dist = mcore.DistCheckpoint(self.chunks, optimizer)  # refuses optimizers it cannot save
        self.ddp = self.chunks[0]
        """The first chunk (the only one without virtual pipeline stages)."""
        self.optimizer = optimizer
        self.config = _checkpoint_config(config)
        self.plugin = self.plugins[0]
        """The first chunk's plugin: the step signal and telemetry go through it."""
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        layout = mcore.layout()
        if len(self.chunks) > 1:  # older manifests have no vpp: a 1F1B checkpoint loads as before
            layout["vpp"] = len(self.chunks)
        self.gradient_accumulation_steps: int | None = _accumulation(global_batch, micro_batch, layout["dp"])
        """Micro-batches per rank and optimizer step that make ``global_batch`` (None without it).
        :meth:`load` changes it when it reshards a checkpoint of another data-parallel size."""
        # The optimizer's kind must match on load: megatron's optimizers save different formats
        # (the distributed optimizer's vs Float16Optimizer's), and the recipe's default changes
        # with the data-parallel size.
        layout["optimizer"] = _optimizer_kind(optimizer)
        if global_batch is not None:
            layout.update(global_batch=global_batch, micro_batch=micro_batch,
                          gradient_accumulation_steps=self.gradient_accumulation_steps)
        self.disk = DiskCheckpointer(
            self.config, rank=self.rank, world_size=self.world_size, layout=layout,
            versions={"megatron-core": megatron_version(), "torch": torch.__version__},
        )  # device: the default group's (CUDA on NCCL, CPU on gloo), looked up at each agreement
        # Checked by plan_megatron_reshard after the tag is chosen, not by the manifest match.
        self.disk.reshardable = ("world_size", "dp", "global_batch", "micro_batch", "gradient_accumulation_steps")
        self.resharded: str | None = None
        """The log line of the reshard the last :meth:`load` did (None: same data-parallel size)."""
        self._term = False
        self._next_term_check: int | None = None
        """The next step at which the ranks agree on SIGTERM (None: the first step_end)."""
        self._last_term_check: tuple[int, float] | None = None
        """(step, monotonic time) of the last agreement."""
        self._previous_handler = None
        if emergency_save:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            if self._previous_handler is None:  # installed from C: restore the default on close
                self._previous_handler = signal.SIG_DFL
        if emergency_save and self.config.memory_every is None:  # with snapshots, those restore a crash
            self._register_emergency()
        self.emergency_tag: str | None = None
        """Tag of the emergency checkpoint written after SIGTERM (None before)."""
        self.extra: Any = None
        """``extra`` of the checkpoint :meth:`load` restored (this rank's), None before."""
        self.memory = None
        """In-memory snapshots (``memory_every`` in the block; ``patches/megatron_memory.py``), or None."""
        if self.config.memory_every is not None:
            from robust_plugins.patches.megatron_memory import MegatronMemory

            self.memory = MegatronMemory(self.chunks, optimizer, self.plugins, self.config)

    # ----------------------------------------------------------------------------- state
    def sharded_state_dict(self, is_loading: bool = False) -> dict:
        """megatron-core sharded state dict of the model chunks (and optimizer) this checkpointer saves."""
        return self._dist.sharded_state_dict(is_loading)

    def _rank_state(self, step: int, extra: Any) -> dict:
        from robust_plugins.patches.megatron_memory import plugin_states

        return {"format": 1, "step": int(step), "extra": extra, "plugin": plugin_states(self.plugins),
                "cpu_rng": torch.get_rng_state(), "tracker_rng": mcore.tracker_rng_states(),
                **({"cuda_rng": rng} if (rng := device_rng_state()) is not None else {})}

    # ------------------------------------------------------------------------------ save
    def _root(self, root: str | os.PathLike | None) -> str:
        if root is not None:
            return os.fspath(root)
        if self.config.dir is None:
            raise CheckpointError("MegatronCheckpointer: no directory given and checkpoint.dir is not set; pass "
                                  "root= or set dir in the checkpoint sub-block.")
        return self.config.dir

    def save(self, step: int, root: str | os.PathLike | None = None, tag: str | None = None, extra: Any = None):
        """Save on every rank (collective); returns the committed :class:`~robust_plugins.checkpoint.Manifest`.

        ``tag`` defaults to ``iter_<step, 7 digits>`` (megatron's naming). ``extra`` (plain data:
        dicts, lists, numbers, strings, tensors) is stored per rank and returned by :meth:`load`.
        A failure on any rank leaves the previous checkpoints and ``latest`` untouched and raises
        CheckpointError on every rank.
        """
        if self._dist.disk_refusal is not None:
            raise UnsupportedError(self._dist.disk_refusal)
        root = self._root(root)
        tag = f"iter_{int(step):07d}" if tag is None else str(tag)
        staging = self.disk.begin(root, tag)
        try:
            self._dist.save(staging)
        except Exception as exc:  # reported by every rank's finish(), which cleans up and raises
            log.exception("robust_plugins: rank %d: dist_checkpointing.save of %s failed", self.rank, tag)
            self.disk.fail(exc)
        path = os.path.join(staging, STATE_FILE.format(rank=self.rank))
        if not self.disk.failed:
            try:
                torch.save(self._rank_state(step, extra), path)
                self.disk.record(path)
            except Exception as exc:
                self.disk.fail(exc, path)
        return self.disk.finish(root, tag, int(step))

    # ------------------------------------------------------------------------------ load
    def load(self, root: str | os.PathLike | None = None, tag: str | None = None) -> int | None:
        """Restore the newest checkpoint that verifies (or ``tag``); return its step, None if none.

        Model, optimizer, plugin residuals and step count, RNG states. Corrupt, truncated or
        partial checkpoints are skipped with one log line each; an explicit ``tag`` that fails
        verification raises CheckpointError naming the file. Nothing in the files can run code:
        per-rank files and megatron's ``common.pt`` are read with ``torch.load(weights_only=True)``,
        and torch's ``.metadata`` pickle is checked to hold only its metadata classes
        (:mod:`robust_plugins.checkpoint.safe_pickle`) before megatron reads it.
        """
        import time

        from robust_plugins.checkpoint import scan
        from robust_plugins.checkpoint.restore import rollback_bound
        from robust_plugins.checkpoint.safe_pickle import check_dist_checkpoint

        t0 = time.perf_counter()
        root = self._root(root)
        # After a robust run rollback nothing newer than its last good step loads.
        bound = rollback_bound() if tag is None else None
        if self.memory is not None and tag is None:
            # Restore order: own memory snapshot -> a peer's copy -> newest verified disk -> older.
            steps = [e.manifest.step for e in scan(root)
                     if e.manifest is not None and (bound is None or e.manifest.step <= bound)]
            step = self.memory.restore(disk_step=max(steps, default=None))
            if step is not None:
                return step
        if self._dist.disk_refusal is not None:
            if tag is not None or scan(root):
                raise UnsupportedError(self._dist.disk_refusal)
            return None
        tag = self.disk.select(root, tag, max_step=bound)
        if tag is None:
            return None
        directory = os.path.join(root, tag)
        check_dist_checkpoint(directory)  # torch unpickles .metadata with plain pickle.load
        plan = self._plan_reshard(directory)
        self._dist.load(directory)
        path = os.path.join(directory, STATE_FILE.format(rank=self.rank if plan is None else plan[1]))
        if not os.path.isfile(path):
            raise CheckpointError(f"Checkpoint {directory} has no {os.path.basename(path)}: it was written by "
                                  f"{self.disk.world_size} ranks' layout but not for rank {self.rank}.")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if plan is not None:
            if any(p is not None for p in self.plugins) and state["plugin"] is not None and self.rank == 0:
                # Residuals are each rank's error of its share of the old layout: no rank owns them now.
                log.warning("robust_plugins: compression residuals start from zero after resharding "
                            "(they belong to the old data-parallel layout)")
        else:
            from robust_plugins.patches.megatron_memory import load_plugin_states

            load_plugin_states(self.plugins, state["plugin"], f"Checkpoint {directory}")
        torch.set_rng_state(state["cpu_rng"])
        mcore.set_tracker_rng_states(state["tracker_rng"])
        set_device_rng_state(state.get("cuda_rng"))
        self.extra = state["extra"]
        if self.memory is not None:
            self.memory.restored_from_disk(int(state["step"]), tag, time.perf_counter() - t0)
        return int(state["step"])

    def _plan_reshard(self, directory: str) -> tuple[Any, int] | None:
        """(plan, saved rank whose per-rank file this rank reads) for a checkpoint of another
        data-parallel size, after adopting the plan's accumulation; None at the same size."""
        from robust_plugins.checkpoint.elastic import plan_megatron_reshard
        from robust_plugins.checkpoint.manifest import read_manifest

        m = read_manifest(directory)
        now = {**mcore.layout(), "world_size": self.world_size, "micro_batch": self.disk.layout.get("micro_batch")}
        plan = plan_megatron_reshard({"where": f"checkpoint {directory}", "world_size": m.world_size, **m.layout},
                                     now)
        self.resharded = None
        if plan is None:
            return None
        extra_dims = mcore.extra_parallel_sizes()
        if any(v != 1 for v in extra_dims.values()):
            raise CheckpointError(f"Resharding {directory} to dp {now['dp']} supports context- and expert-parallel "
                                  f"size 1 only, this job has {extra_dims}; resume at dp {m.layout.get('dp')}.")
        source = mcore.saved_rank_of_this_position(m.layout["tp"], m.layout["dp"])
        self.gradient_accumulation_steps = plan.gradient_accumulation_steps
        self.disk.layout.update(global_batch=plan.train_batch_size,
                                gradient_accumulation_steps=plan.gradient_accumulation_steps)
        self.resharded = plan.message
        if self.rank == 0:
            log.warning("robust_plugins: %s", plan.message)
        return plan, source

    def _register_emergency(self) -> None:
        # robust run's monitor-triggered path (a peer died, this rank's collective failed): the
        # saver runs and reports why it cannot save, so faults.jsonl says so per rank. A
        # dist_checkpointing.save gathers sharding metadata from every rank, the dead one included;
        # the SIGTERM path above covers a job stopped while every rank is alive.
        from robust_plugins import watchdog
        from robust_plugins.checkpoint import emergency

        layout = mcore.layout()
        why = emergency.plan(zero_stage=1 if hasattr(self.optimizer, "sharded_state_dict") else 0,
                             model_parallel=layout["tp"] * layout["pp"], host="megatron-core",
                             has_residuals=any(p is not None for p in self.plugins))
        reason = why or ("megatron-core's dist_checkpointing.save is collective over every rank; with "
                         "a dead peer no rank can write it alone")

        def save(step: int) -> None:
            raise emergency.EmergencySkip(f"no emergency save on rank {self.rank}: {reason} (checkpoint."
                                          f"memory_every snapshots survive a rank's death and restore it)")

        watchdog.on_emergency(save)

    # ------------------------------------------------------------------------ loop hooks
    def _on_sigterm(self, signum, frame) -> None:
        # Only a flag: saving here could start collectives in the middle of another one. Repeats
        # are expected (SLURM signals every process of a step and torchrun forwards its own copy);
        # a rank stuck where step_end is never reached is SIGKILLed by the launcher after its grace
        # period (torchrun: 30 s).
        self._term = True

    def step_end(self, step: int, loss: Any = None, grad_norm: Any = None, root=None) -> None:
        """Call once per step on every rank, after the optimizer step.

        Sends the step signal to ``robust run`` (:func:`robust_plugins.watchdog.step_end`; a no-op
        outside it) and feeds telemetry (through ``plugin.step_end`` when there is a plugin), then,
        about every :data:`TERM_CHECK_S` seconds of steps, agrees with the other ranks (one tiny
        all-reduce) on whether any rank received SIGTERM (:meth:`_term_agreed`). If one did, every
        rank writes an emergency checkpoint of ``step`` and raises ``SystemExit(143)`` (128 +
        SIGTERM), so the launcher sees the usual exit code.
        """
        from robust_plugins import watchdog

        if self.memory is not None:  # before the step signal: a fault injected there finds it taken
            self.memory.on_step(step)
        if self.plugin is not None:  # step signal and telemetry
            self.plugin.step_end(step, loss=loss, grad_norm=grad_norm)
        else:
            watchdog.step_end(step, loss=loss, grad_norm=grad_norm)
        if self._term_agreed(step):
            log.warning("robust_plugins: SIGTERM received; writing an emergency checkpoint of step %d", step)
            self.save(step, root=root)
            self.emergency_tag = f"iter_{int(step):07d}"
            raise SystemExit(128 + signal.SIGTERM)

    def _term_agreed(self, step: int) -> bool:
        """Whether any rank received SIGTERM, asked at agreed steps only: a world all-reduce and
        its ``.item()`` at every step would stall the host behind each step's device work.

        Each agreement also fixes the next: every rank proposes the steps that fit in
        :data:`TERM_CHECK_S` at its own pace since the last one (:func:`term_check_interval`)
        and the smallest wins (one all-reduce of ``[flag, -steps]`` with MAX), so every rank
        asks at the same steps."""
        import torch.distributed as dist

        if self._next_term_check is not None and step < self._next_term_check:
            return False
        now = time.monotonic()
        step_s = None
        if self._last_term_check is not None and step > self._last_term_check[0]:
            step_s = (now - self._last_term_check[1]) / (step - self._last_term_check[0])
        # On the default group's device: NCCL moves CUDA tensors only.
        flag = torch.tensor([1 if self._term else 0, -term_check_interval(step_s)], dtype=torch.int32,
                            device=collective_device())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        term, interval = flag.tolist()
        self._next_term_check = step + max(1, -interval)
        self._last_term_check = (step, now)
        return bool(term)

    def close(self) -> None:
        """Restore the SIGTERM handler that was in place before."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

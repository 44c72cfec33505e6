"""DeepSpeed emergency saves and resume inside ``deepspeed.initialize`` (``checkpoint`` sub-block).

**Emergency save** (``checkpoint.emergency_save``, on by default; only under ``robust run``):
the engine registers a saver with :func:`robust_plugins.watchdog.on_emergency`. When a peer rank
dies, the saver runs with the last step the engine reported, bounded by
``watchdog.emergency_save_timeout_s``: on gloo from the uncaught error of this rank's failing
collective ("Connection closed by peer"), on NCCL (no Python exception comes) when the node
monitor asks, on a stream of its own (``robust_plugins.watchdog.emergency_rank``). ``engine.save_checkpoint`` cannot run then: it starts with
``dist.barrier()`` and every step of the verified save waits for all ranks, the dead one included.
So the saver writes alone (``robust_plugins.checkpoint.emergency``):

- ZeRO 0 without compression residuals: every rank holds the whole model and optimizer, and the
  one file DeepSpeed writes for them (``mp_rank_00_model_states.pt``, written by DeepSpeed's own
  ``_save_checkpoint`` with ``save_non_zero_checkpoint`` set on this rank for the call) restores
  every rank. The first live rank to create the staging directory writes and commits it with the
  same manifest (world size, layout, sha256) as a normal save of this job; the others log that it
  does. The restarted job loads it like any checkpoint.
- ZeRO 1/2 (the optimizer state is sharded and the dead rank's shard is gone), model
  parallelism, and compression residuals (per rank): skipped; the saver raises with the reason,
  which ``faults.jsonl`` records in ``detail.emergency_save``. ``checkpoint.memory_every``
  snapshots outlive a rank's death and restore those cases; with them no saver is registered.

The state saved is the one of ``step`` only if the failing collective came before that rank's next
optimizer step: with ZeRO 0 the gradient all-reduce (in ``engine.backward``) and the save's own
collectives do; a rank whose ``global_steps`` differs from the last reported step is skipped.

**Resume** (``checkpoint.resume``, on by default under ``robust run``) is in
``patches/deepspeed_resume.py``: the restarted job loads the emergency checkpoint inside
``deepspeed.initialize``.
"""

from __future__ import annotations

import os
import sys

from robust_plugins._logging import current_rank, get_logger
from robust_plugins.patches import _guard

log = get_logger(__name__)

_SAVE_SIGNATURE = ["self", "save_dir", "tag", "client_state", "exclude_frozen_parameters"]


def attach_emergency(engine, plugin) -> bool:
    """Register this engine's emergency saver under ``robust run``; True if registered."""
    from robust_plugins import watchdog
    from robust_plugins.watchdog import client

    cfg = plugin.config.checkpoint
    if cfg is None or not cfg.emergency_save or client.get_client() is None:
        return False
    if cfg.memory_every is not None:
        # The snapshots outlive the dead rank (its own in /dev/shm, or a peer's copy) and restore
        # every stage at most memory_every steps back; a disk save of a newer step would only
        # override them with a slower load.
        if current_rank() == 0:
            log.info("robust_plugins: no emergency saves: checkpoint.memory_every snapshots restore a crash")
        return False
    if cfg.dir is None:
        if current_rank() == 0:
            log.warning("robust_plugins: no emergency saves: checkpoint.dir is not set (the saver "
                        "needs a directory without a save_checkpoint call to name one)")
        return False
    from deepspeed.runtime.engine import DeepSpeedEngine

    from robust_plugins.checkpoint import emergency
    from robust_plugins.patches.deepspeed import SUPPORTED
    from robust_plugins.patches.deepspeed_watchdog import CLIENT_STATE_KEY

    _guard.check_signature("deepspeed", DeepSpeedEngine._save_checkpoint, _SAVE_SIGNATURE, SUPPORTED)
    reason = emergency.plan(zero_stage=engine.zero_optimization_stage(), model_parallel=engine.mp_world_size,
                            has_residuals=plugin.has_state)
    disk = plugin.disk

    def write(staging: str) -> None:
        state = {CLIENT_STATE_KEY: client.state_dict()}
        saved = engine.save_non_zero_checkpoint
        engine.save_non_zero_checkpoint = True  # DeepSpeed sets it on data-parallel rank 0 only
        try:
            engine._save_checkpoint(os.path.dirname(staging), os.path.basename(staging), client_state=state)
        finally:
            engine.save_non_zero_checkpoint = saved

    def save(step: int) -> None:
        rank = current_rank()
        if reason is not None:
            raise emergency.EmergencySkip(f"no emergency save on rank {rank}: {reason}")
        if engine.global_steps != step:
            raise emergency.EmergencySkip(
                f"no emergency save on rank {rank}: the engine is at step {engine.global_steps} but the "
                f"last reported step is {step} (the collective failed inside a step)")
        msg = emergency.commit_alone(cfg.dir, f"global_step{step}", step, world_size=disk.world_size,
                                     layout=disk.layout, versions=disk.versions, rank=rank, write=write,
                                     check_hash=disk.check_hash)
        print(f"robust_plugins: rank {rank} emergency checkpoint: {msg}", file=sys.stderr, flush=True)

    watchdog.on_emergency(save)
    if current_rank() == 0:
        log.info("robust_plugins: emergency saves %s", "on (ZeRO 0: one live rank writes the whole state)"
                 if reason is None else f"skipped: {reason}")
    return True

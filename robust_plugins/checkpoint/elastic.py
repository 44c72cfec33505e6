"""Elastic restart: what to do when a checkpoint was saved at another data-parallel size.

A pure planner (no I/O, no framework): :func:`plan_reshard` takes what the checkpoint's manifest
recorded and what the resuming job has, and returns how to load (``direct`` for replicated state,
``universal`` for ZeRO 1-3 partitions, which DeepSpeed's universal checkpoint re-partitions) and the
gradient accumulation that keeps the global batch, or raises :class:`CheckpointError` saying why it
cannot and what would work. Hosts (``patches/deepspeed.py``) carry the plan out.
:func:`plan_megatron_reshard` is the same decision for megatron-core checkpoints
(``robust_plugins.megatron.MegatronCheckpointer``), whose ``dist_checkpointing`` loads any
data-parallel size itself (method ``dist_checkpointing``).

Why keep the global batch: the learning-rate schedule, Adam's statistics and the data position
are all per *global* step; the same samples per step on fewer ranks need more micro-batches per
step, not a smaller batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from robust_plugins.errors import CheckpointError

DIRECT, UNIVERSAL, DIST_CHECKPOINTING = "direct", "universal", "dist_checkpointing"


@dataclass(frozen=True)
class Reshard:
    """How to load a checkpoint saved at another data-parallel size."""

    method: str
    """``direct`` (the state is replicated on every DP rank: ZeRO 0) or ``universal`` (ZeRO 1-3)."""
    gradient_accumulation_steps: int
    """New accumulation: ``train_batch_size / (micro_batch * dp_world_size)``."""
    train_batch_size: int
    """The global batch, as saved (kept)."""
    message: str
    """One log line saying what changes."""


def plan_reshard(saved: Mapping[str, Any], now: Mapping[str, Any]) -> Reshard | None:
    """None when nothing changes; else the plan (or CheckpointError).

    ``saved``: the manifest's ``world_size`` plus its layout (``zero_stage``, ``dp_world_size``,
    ``train_batch_size``, ``gradient_accumulation_steps``). ``now``: the same keys for the resuming
    job plus ``micro_batch``.
    """
    where = saved.get("where", "the checkpoint")
    s_dp, n_dp = saved.get("dp_world_size"), now["dp_world_size"]
    if s_dp is None:
        raise CheckpointError(f"{where} records no dp_world_size in its manifest; it cannot be checked "
                              f"against this job (dp_world_size={n_dp}). Load it with the same launch it "
                              f"was saved with.")
    if s_dp == n_dp:
        return None
    if saved.get("zero_stage") != now["zero_stage"]:
        raise CheckpointError(f"{where} was saved with ZeRO stage {saved.get('zero_stage')}, this job runs "
                              f"stage {now['zero_stage']}; resharding keeps the stage. Use stage "
                              f"{saved.get('zero_stage')}.")
    s_mp = saved["world_size"] // s_dp if saved.get("world_size") else None
    n_mp = now["world_size"] // n_dp
    if s_mp != n_mp:
        raise CheckpointError(f"{where} was saved with {s_mp} model-parallel rank(s) per data-parallel replica "
                              f"(world {saved.get('world_size')}, dp {s_dp}), this job has {n_mp} (world "
                              f"{now['world_size']}, dp {n_dp}). Only the data-parallel size may change on "
                              f"resume.")
    batch = saved.get("train_batch_size")
    if not isinstance(batch, int) or batch < 1:
        raise CheckpointError(f"{where} was saved at dp_world_size={s_dp} without a recorded global batch "
                              f"(written by an older robust_plugins), so resuming at dp_world_size={n_dp} "
                              f"cannot keep it. Resume with {s_dp} data-parallel ranks.")
    micro = now["micro_batch"]
    if batch % (micro * n_dp):
        allowed = sorted(d for d in range(1, batch + 1) if batch % (micro * d) == 0)
        raise CheckpointError(f"{where}: global batch {batch} (saved at dp_world_size={s_dp}) is not a "
                              f"multiple of micro batch {micro} x dp_world_size {n_dp}, so no gradient "
                              f"accumulation keeps it. With micro batch {micro}, dp_world_size may be one of "
                              f"{allowed}; or change train_micro_batch_size_per_gpu.")
    gas = batch // (micro * n_dp)
    method = DIRECT if now["zero_stage"] == 0 else UNIVERSAL
    if now["zero_stage"] not in (0, 1, 2, 3):
        raise CheckpointError(f"{where}: resharding supports ZeRO stages 0-3, not {now['zero_stage']}.")
    message = (f"resharding {where} from dp_world_size {s_dp} to {n_dp} ({method}); global batch {batch} "
               f"kept: gradient_accumulation_steps {saved.get('gradient_accumulation_steps', '?')} -> {gas} "
               f"(micro batch {micro})")
    return Reshard(method, gas, batch, message)


def plan_megatron_reshard(saved: Mapping[str, Any], now: Mapping[str, Any]) -> Reshard | None:
    """None when the data-parallel size is unchanged; else the plan (or CheckpointError).

    ``saved``: the manifest's ``world_size`` and layout (``tp``, ``pp``, ``dp`` and, when the
    checkpointer was told them, ``global_batch`` and ``micro_batch``). ``now``: ``tp``, ``pp``,
    ``dp``, ``world_size`` and ``micro_batch`` (None if the job did not say) of the resuming job.
    """
    where = saved.get("where", "the checkpoint")
    s_dp, n_dp = saved.get("dp"), now["dp"]
    if s_dp is None:
        raise CheckpointError(f"{where} records no dp in its manifest; it cannot be checked against this job "
                              f"(dp={n_dp}). Load it with the same launch it was saved with.")
    if s_dp == n_dp:
        return None
    for key, name in (("tp", "tensor"), ("pp", "pipeline")):
        if saved.get(key) != now[key]:
            raise CheckpointError(f"{where} was saved with {name}-parallel size {saved.get(key)}, this job has "
                                  f"{now[key]}. Only the data-parallel size may change on resume (dp "
                                  f"{s_dp} -> {n_dp}); launch with {key}={saved.get(key)}.")
    batch, micro = saved.get("global_batch"), now.get("micro_batch")
    fix = ("pass global_batch= and micro_batch= to MegatronCheckpointer (the recipe: --global-batch), or "
           f"resume with {s_dp} data-parallel ranks")
    if not isinstance(batch, int) or batch < 1:
        raise CheckpointError(f"{where} was saved at dp={s_dp} without a recorded global batch, so resuming at "
                              f"dp={n_dp} cannot keep it: {fix}.")
    if not isinstance(micro, int) or micro < 1:
        raise CheckpointError(f"{where} was saved at dp={s_dp} with global batch {batch}; this job (dp={n_dp}) "
                              f"did not give its micro batch, so no gradient accumulation can be chosen: {fix}.")
    if batch % (micro * n_dp):
        allowed = sorted(d for d in range(1, batch + 1) if batch % (micro * d) == 0)
        raise CheckpointError(f"{where}: global batch {batch} (saved at dp={s_dp}) is not a multiple of micro "
                              f"batch {micro} x dp {n_dp}, so no gradient accumulation keeps it. With micro "
                              f"batch {micro}, dp may be one of {allowed}; or change the micro batch.")
    gas = batch // (micro * n_dp)
    before = saved.get("gradient_accumulation_steps", "?")
    message = (f"resharding {where} from dp {s_dp} to {n_dp} ({DIST_CHECKPOINTING}); global batch {batch} "
               f"kept: gradient_accumulation_steps {before} -> {gas} (micro batch {micro})")
    return Reshard(DIST_CHECKPOINTING, gas, batch, message)

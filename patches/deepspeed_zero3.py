"""DeepSpeed ZeRO-3: what an in-memory snapshot of one rank holds, and how it goes back.

ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``, DeepSpeed 0.19) partitions the parameters themselves:
``engine.module``'s parameters are empty (or, below ``stage3_param_persistence_threshold``, full
copies gathered after every step), and each rank owns one partition of every parameter. A
snapshot therefore takes this rank's partitions only, with no gather and no collective:

* ``optimizer``: the optimizer's own ``state_dict()`` (loss scaler, fp32 master partition
  ``fp32_flat_groups``, the base optimizer's state over it), as DeepSpeed saves it per rank;
* ``partitions``: the low-precision parameter partitions (``fp16_partitioned_groups_flat``, bf16 /
  fp16 / fp32 as trained) and the partitions of frozen parameters (no optimizer holds them);
* ``module``: the module's buffers (ZeRO-3 does not partition buffers).

:func:`apply` puts them back in DeepSpeed's own load order (``engine.load_checkpoint``):
``checkpoint_event_prologue`` (every parameter partitioned), the optimizer's ``load_state_dict``
from the fp32 masters, the low-precision partitions copied as they were (not recast), then
``checkpoint_event_epilogue``, which all-gathers the persistent parameters: the one collective,
over the data-parallel group, that every rank of a restore reaches together.

What is refused (:func:`check_engine`), because its capture was not verified: parameter or
optimizer offload (``offload_param`` / ``offload_optimizer``), ZeRO++'s secondary partition
(``zero_hpz_partition_size`` > 1) and MoE engines.

Silent data corruption is not detected on ZeRO-3 (:data:`NO_REPLICA`): the checks compare
data-parallel replicas, and a ZeRO-3 partition has none (the gathered parameters all come from
the one owner's partition, so comparing them finds nothing). Under ``robust run`` the snapshot
check says so on rank 0; :func:`refuse_sdc` refuses ``checkpoint.verify_replicas: true`` set
explicitly, and ``patches/deepspeed_watchdog.py`` refuses ``watchdog.check_params`` and the
``bitflip`` / ``stuckbit`` injections on a ZeRO-3 engine.
"""

from __future__ import annotations

from typing import Any

import torch

from robust_plugins.errors import UnsupportedError


def is_zero3(engine) -> bool:
    """True for an engine whose optimizer is DeepSpeed's ZeRO-3 optimizer."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)


#: Why no silent-data-corruption check serves ZeRO-3 (quoted by every refusal and statement).
NO_REPLICA = ("DeepSpeed ZeRO-3 partitions the parameters and the optimizer state, so no rank holds a replica "
              "of another rank's partition to compare with: silent data corruption is not detected on ZeRO-3 "
              "(the replica checks need ZeRO stage 0, 1 or 2, or the pipeline engine's data-parallel replicas)")


def refuse_sdc(checkpoint_cfg) -> None:
    """Refuse ``checkpoint.verify_replicas: true`` given explicitly with ZeRO-3 (the default
    ``true`` is announced as off under ``robust run`` instead: it was not asked for)."""
    if checkpoint_cfg.verify_replicas and "verify_replicas" in checkpoint_cfg.model_fields_set:
        raise UnsupportedError(
            f"robust_plugins.checkpoint.verify_replicas = true with ZeRO-3: {NO_REPLICA}. Allowed with "
            f"ZeRO-3: false or unset.")


def check_engine(engine, what: str) -> None:
    """Refuse ZeRO-3 settings whose exact capture was not verified (``what``: the config key)."""
    zero = engine._config.zero_config
    refusals = (
        ("offload_param", _device(zero.offload_param)),
        ("offload_optimizer", _device(zero.offload_optimizer)),
    )
    for key, device in refusals:
        if device != "none":
            raise UnsupportedError(
                f"robust_plugins.{what} with ZeRO-3 does not support zero_optimization.{key}.device = {device!r} "
                f"(the partitions then live outside the optimizer state a snapshot takes, and restoring them was "
                f"not verified); allowed: {key} unset or device 'none'. Remove {key} or remove {what}.")
    if zero.zero_hpz_partition_size > 1:
        raise UnsupportedError(
            f"robust_plugins.{what} with ZeRO-3 does not support zero_optimization.zero_hpz_partition_size = "
            f"{zero.zero_hpz_partition_size} (ZeRO++'s secondary partition was not verified); allowed: 1. Remove "
            f"zero_hpz_partition_size or remove {what}.")
    if engine.has_moe_layers:
        raise UnsupportedError(f"robust_plugins.{what} with ZeRO-3 does not support MoE engines (expert partitions "
                               f"are placed by their own groups). Remove {what}.")


def capture(engine) -> dict[str, Any]:
    """This rank's ZeRO-3 state: ``module`` (buffers), ``optimizer``, ``partitions`` (live tensors)."""
    opt = engine.optimizer
    return {
        "module": dict(engine.module.named_buffers()),
        "optimizer": opt.state_dict(),
        "partitions": {"bit16": list(opt.fp16_partitioned_groups_flat),
                       "frozen": [p.ds_tensor for p in _frozen(engine.module)]},
    }


def apply(engine, state: dict[str, Any]) -> None:
    """Put a :func:`capture` back into an engine of the same layout (collective, see module doc)."""
    from deepspeed import comm as dist

    opt = engine.optimizer
    opt.checkpoint_event_prologue()
    buffers = dict(engine.module.named_buffers())
    if sorted(buffers) != sorted(state["module"]):
        raise UnsupportedError(f"the snapshot's module buffers {sorted(state['module'])} differ from this model's "
                               f"{sorted(buffers)}: it was taken of another model.")
    with torch.no_grad():
        for name, value in state["module"].items():
            buffers[name].copy_(value)
        sd_list = [None] * dist.get_world_size(group=opt.dp_process_group)
        sd_list[dist.get_rank(group=opt.dp_process_group)] = state["optimizer"]
        opt.load_state_dict(sd_list, load_optimizer_states=True, load_from_fp32_weights=True)
        parts = state["partitions"]
        _copy_all(opt.fp16_partitioned_groups_flat, parts["bit16"], "low-precision parameter partitions")
        _copy_all([p.ds_tensor for p in _frozen(engine.module)], parts["frozen"], "frozen parameter partitions")
    opt.checkpoint_event_epilogue()


def _device(offload) -> str:
    """``"none"``, ``"cpu"`` or ``"nvme"`` for an offload config (None: not configured)."""
    if offload is None:
        return "none"
    return str(getattr(offload.device, "value", offload.device))


def _frozen(module) -> list:
    return [p for p in module.parameters() if not p.requires_grad and hasattr(p, "ds_tensor")]


def _copy_all(live: list, saved: list, what: str) -> None:
    if len(live) != len(saved) or any(a.shape != b.shape for a, b in zip(live, saved)):
        raise UnsupportedError(f"the snapshot's {what} ({[tuple(t.shape) for t in saved]}) do not match this "
                               f"engine's ({[tuple(t.shape) for t in live]}): another layout or data-parallel size.")
    for dst, src in zip(live, saved):
        dst.copy_(src)

"""DeepSpeed binding of 1-bit Adam (``compression: {"codec": "sign", "sign_mode": "momentum"}``).

The algorithm lives in :mod:`robust_plugins.comm.momentum`; this file only switches DeepSpeed over
at the freeze step. On the engine instance (DeepSpeed 0.19, ``deepspeed/runtime/engine.py``):

* ``engine.allreduce_gradients`` (called from ``_backward_epilogue`` and, in unmanaged
  accumulation, from ``step``) is shadowed to do nothing once ``engine.global_steps`` reaches
  ``freeze_steps``: from then on each rank keeps its own gradient, as DeepSpeed's own OnebitAdam
  does by setting ``enable_backward_allreduce = False``. Deciding from ``global_steps`` at every
  call, instead of flipping that flag once, keeps a resumed run (disk or memory snapshot) right
  without any hook on the load path.
* ``engine.optimizer.step`` (the user's ``torch.optim.Adam``/``AdamW``; ZeRO 0 in fp32 calls it
  directly from ``_take_model_step``) is shadowed to run
  :meth:`~robust_plugins.comm.momentum.SignMomentumAdam.step` after the freeze.

Before the freeze both fall through to DeepSpeed, so those steps are bitwise vanilla DeepSpeed.
Gradient clipping (``gradient_clipping``) then applies to each rank's local gradient, before its
momentum is formed (``clip_fp32_gradients`` runs before the optimizer step; with no ``mpu`` it
communicates nothing).

DeepSpeed ships ``OnebitAdam`` too, but only over NCCL/MPI/HCCL compressed backends, so not on
gloo or CPU; this mode uses the project's two-phase ``sign`` all-reduce over any backend.
"""

from __future__ import annotations

from robust_plugins._logging import get_logger
from robust_plugins.errors import UnsupportedError
from robust_plugins.patches import _guard

log = get_logger(__name__)

_ALLREDUCE_GRADIENTS_SIGNATURE = ["self", "bucket_size"]


def _undecorated(fn):
    """The function under DeepSpeed's ``instrument_w_nvtx`` decorator, which keeps it only in its
    closure (no ``__wrapped__``), so that the signature check sees the real parameters."""
    for cell in getattr(fn, "__closure__", None) or ():
        inner = cell.cell_contents
        if callable(inner) and getattr(inner, "__name__", None) == "allreduce_gradients":
            return inner
    return fn


def refuse(engine) -> None:
    """Raise :class:`UnsupportedError` for engines the 1-bit momentum mode cannot serve."""
    from deepspeed import comm as dist

    from robust_plugins.comm.momentum import check_optimizer

    what = "robust_plugins.compression.sign_mode = 'momentum' (1-bit Adam)"
    stage = engine.zero_optimization_stage()
    if stage != 0:
        raise UnsupportedError(
            f"{what} needs ZeRO stage 0; this engine runs stage {stage}. Under ZeRO 1/2 each rank holds only "
            f"its partition of Adam's state and DeepSpeed's ZeRO optimizer owns the step, while the 1-bit "
            f"momentum is averaged whole on every rank (DeepSpeed's own OnebitAdam is ZeRO 0 only for the "
            f"same reason). Set zero_optimization.stage to 0 or use sign_mode 'gradient'."
        )
    if engine.fp16_enabled() or engine.bfloat16_enabled() or engine.torch_autocast_z0_gradscaler is not None:
        raise UnsupportedError(
            f"{what} needs fp32 training: with fp16/bf16 DeepSpeed wraps the optimizer (loss scaling, master "
            f"weights) and the momentum step would bypass the wrapper. Remove the fp16/bf16/autocast sections "
            f"or use sign_mode 'gradient'."
        )
    if engine.mpu is not None or engine.has_moe_layers or engine.dp_world_size != dist.get_world_size():
        raise UnsupportedError(
            f"{what} averages the momentum over the whole job, so data parallelism must be the only "
            f"parallelism (dp_world_size {engine.dp_world_size} of {dist.get_world_size()} ranks, "
            f"mpu={'set' if engine.mpu is not None else 'none'}, MoE={bool(engine.has_moe_layers)}). "
            f"Use sign_mode 'gradient' here."
        )
    check_optimizer(engine.optimizer)


def attach_onebit(engine, plugin) -> None:
    """Install the freeze-step switch on ``engine`` (see the module docstring); sets ``plugin.onebit``."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from robust_plugins.comm.momentum import SignMomentumAdam
    from robust_plugins.patches.deepspeed import SUPPORTED

    _guard.check_signature("deepspeed", _undecorated(DeepSpeedEngine.allreduce_gradients),
                           _ALLREDUCE_GRADIENTS_SIGNATURE, SUPPORTED)
    refuse(engine)
    cfg = plugin.config.compression
    freeze = cfg.freeze_steps
    optimizer = engine.optimizer
    onebit = SignMomentumAdam(optimizer, freeze, block_size=cfg.block_size, group=None)
    plugin.onebit = onebit
    allreduce_gradients, optimizer_step = engine.allreduce_gradients, optimizer.step

    def allreduce_gradients_until_freeze(bucket_size=None):
        if engine.global_steps >= freeze:
            return None  # each rank keeps its local gradient: the momentum is averaged instead
        return allreduce_gradients() if bucket_size is None else allreduce_gradients(bucket_size)

    def step_after_freeze(*args, **kwargs):
        if engine.global_steps < freeze:
            return optimizer_step(*args, **kwargs)
        if args or kwargs:
            raise UnsupportedError("1-bit Adam's step takes no closure; DeepSpeed calls optimizer.step() without one.")
        onebit.step()
        return None

    _guard.bind_instance(engine, "allreduce_gradients", allreduce_gradients_until_freeze)
    _guard.bind_instance(optimizer, "step", step_after_freeze)


def detach_onebit(engine) -> None:
    """Undo :func:`attach_onebit`: DeepSpeed's all-reduce and the optimizer's own step return."""
    _guard.unbind_instance(engine, "allreduce_gradients")
    if engine.optimizer is not None:
        _guard.unbind_instance(engine.optimizer, "step")

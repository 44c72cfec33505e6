"""megatron-core's own optimizers as robust_plugins' snapshots and checkpoints handle them.

Served (megatron-core 0.16): ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer`` and a ``ChainedOptimizer`` of them (what ``get_megatron_optimizer``
returns), over torch's Adam/AdamW/SGD, TE's or apex's FusedAdam. Refused, naming the optimizer
(:func:`check`): megatron's layer-wise optimizer, CPU offloading (``HybridDeviceOptimizer``), the
precision-aware optimizer (main parameters and moments inside TE's FusedAdam, never captured
here) and ``num_distributed_optimizer_instances > 1``.

**A snapshot** (:func:`capture` / :func:`apply`) holds, per chained optimizer, this rank's part
only, no gather: the wrapped torch optimizer's ``state_dict()`` (for the distributed optimizer
the moments and step of this rank's shard), the fp32 main parameters (``Float16Optimizer``'s
``fp32_from_float16_groups``; ``DistributedOptimizer``'s ``shard_fp32_from_float16_groups``,
this rank's shard; fp32 models step their parameters, which the model's state dict holds) and
the grad scaler's state. :func:`apply` copies them back in place: the loop continues bitwise.

**Disk checkpoints** go through megatron's ``sharded_state_dict`` (``fully_reshardable`` for
the distributed optimizer). Without TE and apex megatron steps torch's Adam, which keeps a
per-parameter ``step`` tensor that megatron's distributed-optimizer checkpoint code does not
expect; :func:`install` fixes what that breaks on ``DistributedOptimizer``. :func:`prepare_load`
creates the empty torch-Adam state a fresh process lacks before
``sharded_state_dict(is_loading=True)`` (megatron's ``state_dict()`` reads every ``step``).
:func:`interleaved_disk_refusal` names the one layout whose disk checkpoint is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from robust_plugins._logging import get_logger
from robust_plugins.errors import CheckpointError, UnsupportedError
from robust_plugins.patches import _guard

log = get_logger(__name__)

_SET_SIGNATURE = ["self", "model_param", "tensors"]
_LOAD_SIGNATURE = ["self", "state_dict"]
_installed: list[tuple[type, str, Any]] = []

SERVED = "FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer or a ChainedOptimizer of them"


def is_megatron_optimizer(opt: Any) -> bool:
    """True for megatron-core's ``MegatronOptimizer`` family (not a torch optimizer)."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    return isinstance(opt, MegatronOptimizer)


def parts(opt) -> list:
    """The optimizers inside ``opt``: a ``ChainedOptimizer``'s chain, else ``[opt]``."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    return list(opt.chained_optimizers) if isinstance(opt, ChainedOptimizer) else [opt]


def check(opt, what: str) -> None:
    """Raise UnsupportedError (naming ``what`` and the optimizer) unless :data:`SERVED`."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    if isinstance(opt, LayerWiseDistributedOptimizer):
        raise UnsupportedError(f"{what}: megatron's LayerWiseDistributedOptimizer is not supported; use {SERVED}.")
    for part in parts(opt):
        name = type(part).__name__
        if not isinstance(part, (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer)):
            raise UnsupportedError(f"{what}: megatron optimizer {name} is not supported; use {SERVED}.")
        if isinstance(part.optimizer, HybridDeviceOptimizer):
            raise UnsupportedError(f"{what}: optimizer CPU offloading (optimizer_cpu_offload = True, "
                                   f"HybridDeviceOptimizer) is not supported; set it to False.")
        if getattr(part.config, "use_precision_aware_optimizer", False):
            raise UnsupportedError(f"{what}: use_precision_aware_optimizer = True keeps main parameters and "
                                   f"moments inside TE's FusedAdam, which this does not capture; set it to False.")
        if isinstance(part, DistributedOptimizer) and getattr(part.ddp_config, "overlap_param_gather", False):
            # After the step each rank holds only its own shard updated; the rest arrives with the
            # next forward's all-gather. A capture between the two holds parameters that differ
            # between the replicas (the replica check then rolls back at every snapshot) and, for
            # the shards of others, stale ones.
            raise UnsupportedError(
                f"{what}: overlap_param_gather = True with megatron's DistributedOptimizer is not supported "
                f"(allowed: False): the parameters are whole only after the next forward's all-gather, so a "
                f"snapshot or save taken after the step captures stale shards. Set overlap_param_gather = False "
                f"in DistributedDataParallelConfig, or drop {what}.")
        instances = getattr(getattr(part, "ddp_config", None), "num_distributed_optimizer_instances", 1)
        if instances != 1:
            raise UnsupportedError(f"{what}: num_distributed_optimizer_instances = {instances} is not supported "
                                   f"(allowed: 1).")


def interleaved_disk_refusal(opt, chunks: int) -> str | None:
    """Why disk checkpoints cannot serve an interleaved loop with tied embeddings and ``opt``
    (None: they can).

    With virtual pipeline stages (``chunks`` > 1), megatron's ``DistributedOptimizer`` and tied
    embeddings, megatron-core 0.16's ``fully_reshardable`` state of the shared embedding comes back
    wrong (the loaded main parameter and moments are not the saved rank's), so a resumed run would
    silently diverge. Snapshots (:func:`capture` / :func:`apply`) do not go through that code."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if chunks < 2 or opt is None or not is_megatron_optimizer(opt):
        return None
    if not any(isinstance(p, DistributedOptimizer) for p in parts(opt)):
        return None
    return (f"MegatronCheckpointer: disk checkpoints with virtual_pipeline_model_parallel_size = {chunks}, "
            f"megatron's DistributedOptimizer and share_embeddings_and_output_weights = True are refused: "
            f"megatron-core 0.16's distributed-optimizer checkpoint does not restore the tied embedding's "
            f"optimizer state there, and the resumed run would diverge. Allowed: in-memory snapshots "
            f"(checkpoint.memory_every, restored by load()), or untie the embeddings, or use "
            f"use_distributed_optimizer = False, or no virtual pipeline stages.")


def inner_optimizers(opt) -> list[torch.optim.Optimizer]:
    """The torch optimizers megatron steps (their ``step()`` runs before any parameter changes)."""
    return [p.optimizer for p in parts(opt) if getattr(p, "optimizer", None) is not None]


def _main_params(part) -> list[torch.Tensor]:
    """fp32 main copies the optimizer owns (not views of model parameters), this rank's shard."""
    groups = getattr(part, "shard_fp32_from_float16_groups", None)
    if groups is None:
        groups = getattr(part, "fp32_from_float16_groups", [])
    return [p for g in groups for p in g if p is not None]


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def capture(opt) -> dict:
    """This rank's optimizer state (see the module docstring); tensors are the live ones except
    the grad scaler's (cloned: a dynamic scaler changes before the wrapped optimizer steps)."""
    out = []
    for part in parts(opt):
        scaler = getattr(part, "grad_scaler", None)
        inner = getattr(part, "optimizer", None)
        out.append({"inner": inner.state_dict() if inner is not None else None, "main": _main_params(part),
                    "scaler": _clone(scaler.state_dict()) if scaler is not None else None})
    return {"format": 1, "parts": out}


def apply(opt, state: dict) -> None:
    """Copy :func:`capture`'s state back into ``opt`` (same layout), in place."""
    mine = parts(opt)
    if state.get("format") != 1 or len(state["parts"]) != len(mine):
        raise CheckpointError(f"restore: the snapshot holds {len(state.get('parts', []))} megatron optimizer "
                              f"parts, this job {len(mine)}; restart with the layout it was taken with.")
    for part, saved in zip(mine, state["parts"]):
        main = _main_params(part)
        if len(main) != len(saved["main"]):
            raise CheckpointError(f"restore: {type(part).__name__} has {len(main)} main parameters here, the "
                                  f"snapshot {len(saved['main'])}.")
        if saved["inner"] is not None:
            part.optimizer.load_state_dict(saved["inner"])
        with torch.no_grad():
            for dst, src in zip(main, saved["main"]):
                dst.copy_(src)
        if saved["scaler"] is not None:
            part.grad_scaler.load_state_dict(saved["scaler"])


def prepare_load(opt) -> None:
    """Give a distributed optimizer's torch Adam/AdamW the state a first step would create, so
    megatron's ``sharded_state_dict(is_loading=True)`` can build its template in a fresh process."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in parts(opt):
        inner = getattr(part, "optimizer", None)
        if not isinstance(part, DistributedOptimizer) or not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _set_states_keeping_step(original):
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state.get(main, {})
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}  # loaded from the param groups already
        with torch.no_grad():
            return original(self, model_param, tensors)
    return _set_main_param_and_optimizer_states


def _load_with_own_steps(original):
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        for s in self.optimizer.state.values():
            if isinstance(s.get("step"), torch.Tensor):
                s["step"] = s["step"].clone()
        return out
    return load_state_dict


def install() -> None:
    """Install two wrappers on ``DistributedOptimizer`` (idempotent, version-checked, undoable):

    * ``_set_main_param_and_optimizer_states``: loading ``fully_reshardable`` state raises
      ``KeyError: 'step'`` (the saved tensors carry no ``step``; megatron restores it from the
      param groups) and, for fp32 models, "a view of a leaf Variable that requires grad is being
      used in an in-place operation" (the main parameter is a view of the model's). The wrapper
      keeps the step already loaded and copies under ``torch.no_grad()``.
    * ``load_state_dict`` gives every parameter one shared ``step`` tensor, so AdamW would advance
      it once per parameter and step (resume not exact). The wrapper gives each its own copy.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from robust_plugins.patches.megatron import SUPPORTED, check_megatron_version

    check_megatron_version()
    if _installed:
        return
    targets = [("_set_main_param_and_optimizer_states", _SET_SIGNATURE, _set_states_keeping_step),
               ("load_state_dict", _LOAD_SIGNATURE, _load_with_own_steps)]
    for name, signature, make in targets:
        _guard.check_signature("megatron-core", getattr(DistributedOptimizer, name), signature, SUPPORTED)
    for name, _, make in targets:
        original = vars(DistributedOptimizer)[name]
        setattr(DistributedOptimizer, name, _guard.wrap(original, make(original)))
        _installed.append((DistributedOptimizer, name, original))
    log.info("robust_plugins: DistributedOptimizer._set_main_param_and_optimizer_states and load_state_dict "
             "wrapped (torch Adam's per-parameter step kept and unshared; copies under no_grad)")


#: Bytes of optimizer state copied to the host in one transfer while a disk save builds megatron's
#: ``fully_reshardable`` state: megatron's gather (``get_parameter_state_dp_zero``) calls ``.cpu()``
#: once per parameter and key, a host sync each (3 x 290 for a 1.3B GPT). 256 MiB batches bound the
#: extra device memory of the staging to that.
HOST_BATCH_BYTES = 256 << 20

#: The keys megatron's gather reads from ``_get_main_param_and_optimizer_states``.
_GATHERED = ("param", "exp_avg", "exp_avg_sq")


def host_batches(tensors: list[torch.Tensor], batch_bytes: int = HOST_BATCH_BYTES) -> list[list[int]]:
    """Indices of ``tensors`` in batches of consecutive tensors of one dtype and device, at most
    ``batch_bytes`` each (a larger tensor alone) (pure): each batch is one host copy."""
    batches: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        last = tensors[batches[-1][-1]] if batches else None
        if last is None or (last.dtype, last.device) != (t.dtype, t.device) or size + nbytes > batch_bytes:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += nbytes
    return batches


def copy_to_host(tensors: list[torch.Tensor], batch_bytes: int = HOST_BATCH_BYTES) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (same shapes), one device-to-host transfer per
    :func:`host_batches` batch instead of one per tensor."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for batch in host_batches(tensors, batch_bytes):
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in batch]).cpu()
        offset = 0
        for i in batch:
            n = tensors[i].numel()
            out[i] = flat[offset:offset + n].view(tensors[i].shape)
            offset += n
    return out


@contextlib.contextmanager
def states_on_host(opt):
    """While a disk save builds ``opt``'s sharded state: each ``DistributedOptimizer`` part answers
    megatron's gather (``_get_main_param_and_optimizer_states``, bound on the instance) with host
    copies made in batches (:func:`copy_to_host`), so its per-parameter ``.cpu()`` moves nothing.
    CPU state too: one code path, the one the CPU tests run. Unbound on exit."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    bound = []
    try:
        for part in parts(opt):
            if not isinstance(part, DistributedOptimizer):
                continue
            getter = part._get_main_param_and_optimizer_states
            _guard.check_signature("megatron-core", type(part)._get_main_param_and_optimizer_states,
                                   ["self", "model_param"], "megatron-core 0.16")
            states = {p: getter(p) for p in part.model_param_group_index_map}
            flat = [(p, k) for p, s in states.items() for k in _GATHERED if k in s]
            host = copy_to_host([states[p][k] for p, k in flat])
            for (p, k), t in zip(flat, host):
                states[p] = {**states[p], k: t}

            def staged(model_param, _states=states):
                return _states[model_param]

            _guard.bind_instance(part, "_get_main_param_and_optimizer_states", staged, layer="megatron.host_batches")
            bound.append(part)
        yield
    finally:
        for part in bound:
            _guard.unbind_instance(part, "_get_main_param_and_optimizer_states")


def undo() -> None:
    """Restore what :func:`install` replaced."""
    while _installed:
        owner, name, original = _installed.pop()
        setattr(owner, name, original)

"""The telemetry recorder fed from megatron-core's DDP model chunks (public ``torch.nn.Module`` hooks only).

One recorder per rank, whatever the number of model chunks: with virtual pipeline stages each
chunk is enabled on its own (:func:`robust_plugins.patches.megatron.enable`), and the recorder
is built when this rank's last chunk is enabled, over all of them (a small collective then, on
every rank at the same point).

Tokens: a forward hook on the chunk that embeds (the first pipeline stage, first virtual stage;
tensor-parallel rank 0: TP peers see the same tokens, later stages get hidden states) counts the
first integer tensor argument (token ids; a boolean attention mask is not one) of each training
forward. Gradient bytes and time: a hook on each chunk's output opens one
:meth:`Telemetry.grad_window` when backward first reaches any of them, and the last chunk's
``finish_grad_sync`` closes it (megatron's ``finalize_model_grads`` finishes the chunks in
order, so every chunk's bucket syncs, on the sync thread too, fall inside); collectives on
megatron's model-parallel groups (TP reductions, pipeline p2p, the tied-embedding all-reduce)
are not counted, nor, with a pipeline of 2, those on the default group (megatron's unbatched p2p
sends one direction there), nor the MoE token dispatcher's (expert model-parallel groups).
``grad_bytes_by_kind`` counts the gradient bytes handed to the sync since the start, dense and
expert apart (before compression; the expert ones reduce over the expert-data-parallel group).
Loss and grad norm come from :meth:`MegatronPlugin.step_end`; FLOPs per token
from the whole model (every stage, virtual stage and TP shard); each rank's step time is in the
record (``step_s`` by rank: per pipeline stage with the layout).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from robust_plugins._logging import current_rank, get_logger
from robust_plugins.comm.state import residuals_sq_norm
from robust_plugins.device import collective_device
from robust_plugins.errors import ConfigError

log = get_logger(__name__)

#: (virtual stage, ddp, plugin) of this rank's chunks enabled so far, waiting for the last one.
_pending: list[tuple[int, Any, Any]] = []


def _vp_stage(ddp) -> int:
    """The chunk's virtual pipeline stage (megatron's ``vp_stage`` on the GPT model), 0 if none."""
    module = ddp
    while module is not None:
        stage = getattr(module, "vp_stage", None)
        if stage is not None:
            return int(stage)
        module = getattr(module, "module", None)
    return 0


def attach(ddp, plugin) -> None:
    """Register ``ddp``'s chunk with the telemetry sub-block of ``plugin``'s config; build the
    recorder once this rank's last chunk is registered (see the module docstring)."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:  # one chunk a rank
        _pending.clear()
        _build([ddp], [plugin])
        return
    stage = _vp_stage(ddp)
    if any(s == stage for s, _, _ in _pending):
        _pending.clear()  # a new model's chunks: the earlier, incomplete set was abandoned
    if _pending and _pending[0][2].config.telemetry != plugin.config.telemetry:
        raise ConfigError(f"robust_plugins.megatron: model chunk {stage} has another telemetry sub-block than "
                          f"chunk {_pending[0][0]}; enable every chunk with the same robust_plugins block.")
    _pending.append((stage, ddp, plugin))
    if len(_pending) < vpp:
        return
    chunks = sorted(_pending, key=lambda item: item[0])
    _pending.clear()
    _build([d for _, d, _ in chunks], [p for _, _, p in chunks])


def _build(chunks: list, plugins: list) -> None:
    import torch.distributed as dist
    from megatron.core import package_info
    from megatron.core import parallel_state as ps

    from robust_plugins.telemetry.recorder import Telemetry

    model_parallel = {id(g) for g in (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
                                      ps.get_model_parallel_group(), ps.get_embedding_group(check_initialized=False),
                                      ps.get_position_embedding_group(check_initialized=False),
                                      # MoE: the token dispatcher's all-to-all / all-gather in backward
                                      ps.get_expert_model_parallel_group(check_initialized=False),
                                      ps.get_expert_tensor_parallel_group(check_initialized=False),
                                      ps.get_expert_tensor_and_model_parallel_group(check_initialized=False))
                      if g is not None}
    if dist.get_world_size(ps.get_pipeline_model_parallel_group()) == 2:
        # megatron's unbatched p2p (_p2p_ops, batch_p2p_comm = False, as interleaved runs) sends one
        # direction on the default group when the pipeline group has 2 ranks; no gradient
        # reduction uses the default group (megatron's data-parallel groups are their own).
        model_parallel.add(id(dist.group.WORLD))
    trainable = sum(p.numel() for d in chunks for p in d.module.parameters() if p.requires_grad)
    whole = torch.tensor([float(trainable)], device=collective_device(ps.get_model_parallel_group()))
    if dist.get_world_size(ps.get_model_parallel_group()) > 1:  # every stage and TP shard: the whole model
        dist.all_reduce(whole, group=ps.get_model_parallel_group())
    first, last = plugins[0], plugins[-1]
    c = chunks[0].ddp_config
    grad_dtype = torch.float32 if c.grad_reduce_in_fp32 else next(chunks[0].module.parameters()).dtype
    dp = ps.get_data_parallel_world_size()
    syncs = [p.sync for p in plugins if p.sync is not None]
    element_size = torch.finfo(grad_dtype).bits // 8
    states = tuple(st for s in syncs for st in s.states.values())  # every codec's under auto

    def sync_info() -> dict[str, Any]:
        by_codec: dict[str, int] = {}
        for s in syncs:
            for k, v in s.stats.by_codec.items():
                by_codec[k] = by_codec.get(k, 0) + v
        total = sum(by_codec.values())
        decisions = [d for s in syncs for d in s.stats.auto_decisions]
        # Sites are "mcore.dense<g>.b<i>" / "mcore.expert<g>.b<i>" (patches/megatron.py).
        by_kind = {"dense": 0, "expert": 0}
        for s in syncs:
            for site, n in s.stats.by_site.items():
                by_kind["expert" if site.startswith("mcore.expert") else "dense"] += n
        return {"codec_share": {k: v / total for k, v in by_codec.items()} if total else {},
                "grad_bytes_by_kind": {k: n * element_size for k, n in by_kind.items()},
                "auto_decisions": [d.to_dict() if hasattr(d, "to_dict") else d for d in decisions]}

    run_config = {"robust_plugins": dict(first.config.raw),
                  "host": {"megatron-core": package_info.__version__, "torch": torch.__version__,
                           "use_distributed_optimizer": c.use_distributed_optimizer,
                           "overlap_grad_reduce": c.overlap_grad_reduce, "dp_world_size": dp,
                           "grad_dtype": str(grad_dtype), "trainable_params": trainable,
                           "model_chunks": len(chunks)}}
    tel = Telemetry(first.config.telemetry, run_config=run_config, n_grad_elements=trainable,
                    grad_element_size=torch.finfo(grad_dtype).bits // 8, dp_world_size=dp,
                    device=next(chunks[0].module.parameters()).device, flops_per_token=6.0 * float(whole),
                    wire_filter=lambda group: id(group) not in model_parallel,
                    residual_sq_fn=partial(residuals_sq_norm, states) if states else None,
                    grad_norm_fn=lambda: next((p._grad_norm for p in plugins if p._grad_norm is not None), None),
                    info_fn=sync_info if syncs else None)
    for p in plugins:
        p.telemetry = tel

    def open_window(grad):
        # The last chunk's finish_grad_sync (MegatronPlugin's, patches/megatron.py) closes it.
        if last._window is None:
            last._window = tel.grad_window(None)
            last._window.__enter__()
        return grad

    for vp, ddp in enumerate(chunks):
        stage = vp if len(chunks) > 1 else None
        # Token ids enter the first stage's first chunk only; its TP peers see the same ones.
        counts = ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_first_stage(ignore_virtual=False,
                                                                                           vp_stage=stage)
        tel.hook_handles.append(ddp.module.register_forward_hook(_on_forward(tel, counts, open_window),
                                                                 with_kwargs=True))
    if current_rank() == 0:
        log.info("robust_plugins telemetry: %s -> %s (%d model chunk(s) a rank)", first.config.telemetry.describe(),
                 tel.dir, len(chunks))


def _on_forward(tel, count_tokens: bool, open_window):
    def on_forward(module, args, kwargs, output):
        if module.training and torch.is_grad_enabled():
            ids = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)
                        and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool), None)
            if ids is not None and count_tokens:
                tel.count_tokens(ids.numel())
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(open_window)
    return on_forward

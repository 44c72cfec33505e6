"""Rank functions of the MoE tests: megatron-core GPT with mixture-of-experts layers, EP over gloo.

Each variant builds the ``megatron_gpt`` recipe's model with MoE (4 experts, top-2), takes one
step on the same batch and weights, and returns the reduced gradients of the dense and the expert
bucket groups (the local shard of each bucket with the distributed optimizer), the largest local
gradient of each kind before the sync (the codec's error bound scales with it), and the plugin's
counters.
"""

from __future__ import annotations

import time

import torch


def reduced(parts, kind: str) -> torch.Tensor:
    """This rank's reduced gradients of ``kind`` (``dense`` or ``expert``) bucket groups, in bucket
    order: whole buckets (all-reduce) or this rank's shard of each (distributed optimizer, sharded
    over the group the buckets reduce on: the expert-data-parallel group for experts)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    out = []
    for m in parts["model"]:
        groups = m.bucket_groups if kind == "dense" else m.expert_parallel_bucket_groups
        for g in groups:
            for b in g.buckets:
                if parts["layout"].distopt:
                    size, rank = g.intra_distributed_optimizer_instance_size, g.intra_distributed_optimizer_instance_rank
                    out.append(shard_buffer(b.grad_data, size)[rank].detach().float().clone())
                else:
                    out.append(b.grad_data.detach().float().clone().view(-1))
    return torch.cat(out) if out else torch.zeros(0)


def _absmax_hook(parts) -> list:
    """Record max |local gradient| of dense and expert buckets before each step's sync."""
    config = parts["config"]
    original = config.finalize_model_grads_func
    seen: list = []

    def finalize(*args, **kwargs):
        seen.append({kind: max([float(b.grad_data.abs().max()) for m in parts["model"]
                                for g in (m.bucket_groups if kind == "dense" else m.expert_parallel_bucket_groups)
                                for b in g.buckets] or [0.0]) for kind in ("dense", "expert")})
        return original(*args, **kwargs)

    config.finalize_model_grads_func = finalize
    return seen


def moe_variants(rank: int, world: int, variants: list, steps: int = 1, moe: dict | None = None) -> dict:
    """Run each ``(name, block, build_kwargs)`` of ``variants`` for ``steps`` steps; per name the
    step-1 reduced gradients (``dense``, ``expert``), ``absmax`` and plugin counters."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from robust_plugins.recipes.megatron_gpt.train import PRESETS, build, param_digest, train_step
    from robust_plugins.workloads import load_corpus

    preset, corpus = PRESETS["cpu-moe"], load_corpus()
    moe = {"experts": 4, "ep": 2, "topk": 2, **(moe or {})}
    out = {}
    for name, block, kw in variants:
        t0 = time.perf_counter()
        kw = {"overlap": False, "distopt": False, "optimizer": "torch-adamw", "bf16": False, **kw}
        parts = build(preset, tp=1, seed=0, codec=None, block=block, **moe, **kw)
        absmax = _absmax_hook(parts)
        grads: list = []
        losses = []
        for s in range(1, steps + 1):
            hook = (lambda: grads.append({k: reduced(parts, k) for k in ("dense", "expert")})) if s == 1 else None
            losses.append(train_step(parts, preset, corpus, 0, s, before_step=hook))
            if (block or {}).get("telemetry") is not None:
                parts["plugin"].step_end(s, loss=losses[-1])
        res = {"losses": losses, **grads[0], "absmax": absmax[0], "digest": param_digest(parts["model"]),
               "expert_dp": dist.get_process_group_ranks(ps.get_expert_data_parallel_group()),
               "dp": dist.get_process_group_ranks(ps.get_data_parallel_group())}
        plugin = parts["plugin"]
        if plugin is not None:
            st = plugin.sync.stats if plugin.sync is not None else None
            if st is not None:
                res.update(by_codec=dict(st.by_codec), by_route=dict(st.by_route), hier=st.hierarchical_elements,
                           by_reason=dict(st.by_reason), decisions=list(st.auto_decisions))
            plugin.close()
        tel = (block or {}).get("telemetry")
        if tel is not None and rank == 0:  # rank 0 writes the records
            import json
            import pathlib

            lines = (pathlib.Path(tel["dir"]) / "metrics.jsonl").read_text().splitlines()
            res["telemetry"] = [r for r in map(json.loads, lines) if r.get("kind") == "step"]
        res["numel"] = {k: sum(b.grad_data.numel() for m in parts["model"]
                               for g in (m.bucket_groups if k == "dense" else m.expert_parallel_bucket_groups)
                               for b in g.buckets) for k in ("dense", "expert")}
        res["seconds"] = time.perf_counter() - t0
        out[name] = res
    return out

"""Rank functions for the megatron-core 3D tests: megatron's own schedules and optimizers on CPU.

One process group runs many scenarios (layouts x precisions x optimizers), each from the same seed,
vanilla megatron-core first, then with robust_plugins' codecs, through the recipe's ``build`` /
``train_step`` (``get_forward_backward_func``, ``finalize_model_grads``, ``get_megatron_optimizer``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _reduced_grads(parts) -> torch.Tensor:
    """This rank's reduced gradients after the sync, in a fixed order: every parameter's
    ``main_grad`` (all-reduce), or this rank's shard of every bucket (distributed optimizer: the
    rest of a bucket keeps local, unreduced values)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    layout = parts["layout"]
    if not layout.distopt:
        return torch.cat([p.main_grad.detach().flatten().clone() for m in parts["model"] for p in m.parameters()])
    return torch.cat([shard_buffer(b.grad_data, layout.dp)[layout.dp_rank].clone()
                      for m in parts["model"] for g in m.bucket_groups for b in g.buckets])


def _local_absmax(parts) -> list:
    """A hook on the step's ``finalize_model_grads``: records max |local gradient| before the sync."""
    config = parts["config"]
    original = config.finalize_model_grads_func
    seen: list = []

    def finalize(*args, **kwargs):
        seen.append(max(float(b.grad_data.abs().max()) for m in parts["model"] for g in m.bucket_groups
                        for b in g.buckets))
        return original(*args, **kwargs)

    config.finalize_model_grads_func = finalize
    return seen


def _variant(scenario: dict, codec, steps: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from robust_plugins.recipes.megatron_gpt.train import PRESETS, build, param_digest, train_step
    from robust_plugins.workloads import load_corpus

    preset = PRESETS["cpu-3d"]
    parts = build(preset, tp=scenario["tp"], seed=0, codec=codec, overlap=scenario.get("overlap", False),
                  distopt=scenario["distopt"], pp=scenario["pp"], vpp=scenario.get("vpp"), bf16=scenario["bf16"],
                  optimizer="megatron")
    absmax = _local_absmax(parts)
    grads: list = []
    corpus = load_corpus()
    losses = []
    for step in range(1, steps + 1):
        hook = (lambda: grads.append(_reduced_grads(parts))) if step == 1 else None
        losses.append(train_step(parts, preset, corpus, 0, step, gas=preset.micro_batches, before_step=hook))
    plugins = parts["plugins"] or []
    compressed = sum(p.sync.stats.compressed_elements for p in plugins)
    out = {"losses": losses, "digest": param_digest(parts["model"]), "grad1": grads[0], "absmax1": absmax[0],
           "compressed": compressed, "steps": [p.steps for p in plugins], "chunks": len(parts["model"]),
           "optimizer": type(parts["optimizer"]).__name__,
           "inner": sorted({type(o).__name__ for o in getattr(parts["optimizer"], "chained_optimizers",
                                                                 [parts["optimizer"]])}),
           "dp_ranks": dist.get_process_group_ranks(ps.get_data_parallel_group()),
           "pp_rank": ps.get_pipeline_model_parallel_rank(), "layout": parts["layout"].as_dict()}
    for p in plugins:
        p.close()
    return out


def pipeline_scenarios(rank, world, scenarios, steps):
    """Run every scenario (``name``, ``tp``, ``pp``, ``vpp``, ``bf16``, ``distopt``, ``overlap``,
    ``codecs``: None is vanilla megatron-core) for ``steps`` steps; results by name and codec."""
    out = {}
    for sc in scenarios:
        out[sc["name"]] = {str(c): _own_groups(_variant, sc, c, steps) for c in sc["codecs"]}
    out["refusal"] = _own_groups(_interleaved_batch_p2p_refusal)
    out["refusals"] = _own_groups(_refusals)
    return out


def _own_groups(fn, *args):
    """``fn(*args)``, then destroy the process groups it created. megatron-core's
    ``destroy_model_parallel`` only forgets its groups: each gloo group keeps three threads and a
    connection to every member, and 25 builds in one process left ~1000 threads a rank, which on a
    loaded machine slowed this file from 45 s to over 10 minutes."""
    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map)
    try:
        return fn(*args)
    finally:
        dist.barrier()  # no peer still sends on a group about to go
        for group in [g for g in c10d._world.pg_map if g not in before]:
            dist.destroy_process_group(group)


def _refused(fn) -> str | None:
    from robust_plugins.errors import RobustPluginsError

    try:
        fn()
    except RobustPluginsError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _refusals() -> dict:
    """What the checkpointer and telemetry refuse, each tried on a real build (no collective runs
    before the refusal, so every rank raises at the same place)."""
    import robust_plugins.megatron as rpm
    from robust_plugins.recipes.megatron_gpt.train import PRESETS, build

    preset = PRESETS["cpu-3d"]
    out = {}
    vpp = build(preset, tp=1, seed=0, codec=None, overlap=False, distopt=None, pp=2, vpp=2)
    out["checkpointer_vpp"] = _refused(lambda: rpm.MegatronCheckpointer(vpp["model"][0], vpp["optimizer"],
                                                                          {"dir": "unused"}, emergency_save=False))
    out["telemetry_vpp"] = _refused(lambda: rpm.enable(vpp["model"][1], {"telemetry": {"log_every": 1}}))
    parts = build(preset, tp=1, seed=0, codec=None, overlap=False, distopt=True, pp=2)
    (distopt,) = parts["optimizer"].chained_optimizers
    ckpt = {"dir": "unused", "memory_every": 1}
    distopt.config.use_precision_aware_optimizer = True
    out["precision_aware"] = _refused(lambda: rpm.MegatronCheckpointer(parts["ddp"], parts["optimizer"], ckpt,
                                                                         emergency_save=False))
    distopt.config.use_precision_aware_optimizer = False
    distopt.ddp_config.num_distributed_optimizer_instances = 2
    out["instances"] = _refused(lambda: rpm.MegatronCheckpointer(parts["ddp"], parts["optimizer"], ckpt,
                                                                   emergency_save=False))
    distopt.ddp_config.num_distributed_optimizer_instances = 1
    return out


def _interleaved_batch_p2p_refusal() -> str | None:
    """enable() on an interleaved pp=2 model whose config asks for batch_p2p_comm over gloo."""
    import robust_plugins.megatron as rpm
    from robust_plugins.errors import UnsupportedError
    from robust_plugins.recipes.megatron_gpt.train import PRESETS, build

    parts = build(PRESETS["cpu-3d"], tp=1, seed=0, codec=None, overlap=False, distopt=None, pp=2, vpp=2)
    parts["config"].batch_p2p_comm = True
    try:
        rpm.enable(parts["model"][0], {"compression": {"codec": "int8"}})
    except UnsupportedError as exc:
        return str(exc)
    return None

"""Rank functions for the megatron-core 3D tests: megatron's own schedules and optimizers on CPU.

One process group runs many scenarios (layouts x precisions x optimizers), each from the same seed,
vanilla megatron-core first, then with robust_plugins' codecs, through the recipe's ``build`` /
``train_step`` (``get_forward_backward_func``, ``finalize_model_grads``, ``get_megatron_optimizer``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _reduced_grads(parts) -> list[torch.Tensor]:
    """This rank's reduced gradients after the sync, one flat tensor per model chunk, in a fixed
    order: every parameter's ``main_grad`` (all-reduce), or this rank's shard of every bucket
    (distributed optimizer: the rest of a bucket keeps local, unreduced values)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    layout = parts["layout"]
    if not layout.distopt:
        return [torch.cat([p.main_grad.detach().flatten().clone() for p in m.parameters()]) for m in parts["model"]]
    return [torch.cat([shard_buffer(b.grad_data, layout.dp)[layout.dp_rank].clone()
                       for g in m.bucket_groups for b in g.buckets]) for m in parts["model"]]


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


def _variant(scenario: dict, codec, steps: int, telemetry_dir: str | None = None) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from robust_plugins.recipes.megatron_gpt.train import PRESETS, build, param_digest, train_step
    from robust_plugins.workloads import load_corpus

    preset = PRESETS["cpu-3d"]
    block = None
    if telemetry_dir is not None and codec is not None:  # every chunk fed to one recorder a rank
        block = {"compression": {"codec": codec}, "telemetry": {"dir": f"{telemetry_dir}/{codec}", "log_every": steps}}
    parts = build(preset, tp=scenario["tp"], seed=0, codec=codec, overlap=scenario.get("overlap", False), block=block,
                  distopt=scenario["distopt"], pp=scenario["pp"], vpp=scenario.get("vpp"), bf16=scenario["bf16"],
                  optimizer="megatron", grad_reduce_in_fp32=scenario.get("grad_fp32", True))
    absmax = _local_absmax(parts)
    grads: list = []
    corpus = load_corpus()
    losses = []
    for step in range(1, steps + 1):
        hook = (lambda: grads.append(_reduced_grads(parts))) if step == 1 else None
        losses.append(train_step(parts, preset, corpus, 0, step, gas=preset.micro_batches, before_step=hook))
        if block is not None:
            parts["plugin"].step_end(step, loss=losses[-1])
    plugins = parts["plugins"] or []
    compressed = sum(p.sync.stats.compressed_elements for p in plugins)
    out = {"losses": losses, "digest": param_digest(parts["model"]), "grad1": torch.cat(grads[0]),
           "grad1_by_chunk": grads[0], "absmax1": absmax[0], "compressed": compressed,
           "compressed_by_chunk": [p.sync.stats.compressed_elements if p is not None else 0 for p in plugins],
           "steps": [p.steps for p in plugins], "chunks": len(parts["model"]),
           "optimizer": type(parts["optimizer"]).__name__,
           "inner": sorted({type(o).__name__ for o in getattr(parts["optimizer"], "chained_optimizers",
                                                                 [parts["optimizer"]])}),
           "dp_ranks": dist.get_process_group_ranks(ps.get_data_parallel_group()),
           "pp_rank": ps.get_pipeline_model_parallel_rank(), "layout": parts["layout"].as_dict(),
           "grad_elements": sum(b.grad_data.numel() for m in parts["model"] for g in m.bucket_groups
                                for b in g.buckets)}
    tel = parts["plugin"].telemetry if parts["plugin"] is not None else None
    for p in plugins:
        p.close()
    if tel is not None:  # rank 0 wrote them; closed above (the end record)
        out["telemetry"] = [r for r in tel.records if r.get("kind") == "step"]
        out["telemetry_shared"] = all(p.telemetry is tel for p in plugins)
    return out


def pipeline_scenarios(rank, world, scenarios, steps, out_dir=None, checkpointer=()):
    """Run every scenario (``name``, ``tp``, ``pp``, ``vpp``, ``bf16``, ``distopt``, ``overlap``,
    ``grad_fp32``, ``telemetry``, ``codecs``: None is vanilla megatron-core) for ``steps`` steps,
    then each :func:`checkpointer_replay` scenario of ``checkpointer`` (``name`` and its build
    options) under ``out_dir``; results by name and codec."""
    out = {}
    for sc in scenarios:
        tel = f"{out_dir}/telemetry/{sc['name']}" if sc.get("telemetry") else None
        out[sc["name"]] = {str(c): _own_groups(_variant, sc, c, steps, tel) for c in sc["codecs"]}
    for sc in checkpointer:
        out[sc["name"]] = _own_groups(checkpointer_replay, sc, f"{out_dir}/ckpt/{sc['name']}")
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
    out["checkpointer_one_of_two_chunks"] = _refused(
        lambda: rpm.MegatronCheckpointer(vpp["model"][0], vpp["optimizer"], {"dir": "unused"}, emergency_save=False))
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


def _scalers(opt) -> list:
    """Each chained optimizer's grad scaler state as plain numbers (None: no scaler)."""
    out = []
    for part in getattr(opt, "chained_optimizers", [opt]):
        scaler = getattr(part, "grad_scaler", None)
        out.append(None if scaler is None else {k: float(v) for k, v in scaler.state_dict().items()})
    return out


def checkpointer_replay(sc: dict, root: str, steps: int = 3) -> dict:
    """``MegatronCheckpointer`` on every model chunk: an uninterrupted run of ``steps`` steps with a
    snapshot each step and a disk save at step 2; then two fresh builds from other seeds, one
    restored from the step-2 snapshot (``ROBUST_ROLLBACK_MAX_STEP=2``, as a rollback does), one
    from the step-2 ``dist_checkpointing`` checkpoint with every snapshot gone, each replaying to
    ``steps``. With fp16, step 1's gradients get an inf (a skipped step: the dynamic scaler's
    hysteresis moves), so the scaler state at step 2 is not a fresh one's."""
    import multiprocessing
    import os
    import uuid

    import robust_plugins.megatron as rpm
    from robust_plugins.checkpoint import memory
    from robust_plugins.recipes.megatron_gpt.train import PRESETS, build, param_digest, train_step
    from robust_plugins.workloads import load_corpus

    # dist_checkpointing.save starts a Manager process, which a daemonic process may not: these
    # ranks are run_ranks' daemonic children (the Manager is shut down when the rank exits).
    multiprocessing.current_process()._config["daemon"] = False
    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, uuid.uuid4().hex)
    os.environ[memory.ENV_JOB] = ids[0]
    key = memory.job_key()
    preset, corpus = PRESETS["cpu-3d"], load_corpus()
    if "tie_embeddings" in sc:
        import dataclasses

        preset = dataclasses.replace(preset, tie_embeddings=sc["tie_embeddings"])
    block = {"dir": root, "memory_every": 1, "timeout_s": 60}
    made = []

    def make(seed):
        parts = build(preset, tp=1, seed=seed, codec=sc.get("codec"), overlap=False, distopt=sc["distopt"], pp=2,
                      vpp=sc.get("vpp"), bf16=sc["bf16"], fp16=sc.get("fp16", False),
                      optimizer_config=sc.get("optimizer_config"))
        ckpt = rpm.MegatronCheckpointer(parts["model"], parts["optimizer"], block, emergency_save=False)
        made.append((parts, ckpt))
        return parts, ckpt

    def overflow():
        for chunk in made[-1][0]["model"]:
            chunk.buffers[0].grad_data[0] = float("inf")

    def train(parts, ckpt, first):
        losses, scalers = [], []
        for step in range(first, steps + 1):
            hook = overflow if sc.get("fp16") and step == 1 else None
            losses.append(train_step(parts, preset, corpus, 0, step, gas=preset.micro_batches, before_step=hook))
            ckpt.step_end(step, loss=losses[-1])
            if step == 2:
                refusal = _refused(lambda: ckpt.save(step))
                if refusal is not None:
                    out["disk_refusal"] = refusal
            scalers.append(_scalers(parts["optimizer"]))
        ckpt.memory.store.flush()
        return {"losses": losses, "scalers": scalers, "digest": param_digest(parts["model"]),
                "compressed": [p.sync.stats.compressed_elements for p in parts["plugins"] or []],
                "chunks": len(parts["model"]), "inner": [type(o).__name__ for o in
                                                         parts["optimizer"].chained_optimizers]}

    out: dict = {"disk_refusal": None}
    out["reference"] = train(*make(0), 1)
    os.environ["ROBUST_ROLLBACK_MAX_STEP"] = "2"
    try:
        parts, ckpt = make(5)
        fresh = _scalers(parts["optimizer"])
        start = ckpt.load()
        out["memory"] = {"start": start, "source": ckpt.memory.restored["source"], "fresh_scalers": fresh,
                         "loaded_scalers": _scalers(parts["optimizer"]), **train(parts, ckpt, start + 1)}
    finally:
        del os.environ["ROBUST_ROLLBACK_MAX_STEP"]
    for _, c in made:
        c.memory.close(remove=True)
    dist.barrier()
    if dist.get_rank() == 0:
        memory.remove_job(key)
    dist.barrier()
    if out["disk_refusal"] is None:
        parts, ckpt = make(7)
        start = ckpt.load()
        out["disk"] = {"start": start, "restored": ckpt.memory.restored, "files": sorted(os.listdir(root)),
                       "loaded_scalers": _scalers(parts["optimizer"]), **train(parts, ckpt, start + 1)}
    for p, c in made:
        c.memory.close(remove=True)
        c.close()
        for plugin in p["plugins"] or []:
            plugin.close()
    dist.barrier()
    if dist.get_rank() == 0:
        memory.remove_job(key)
    out["shm_left"] = memory.job_files(key)
    return out

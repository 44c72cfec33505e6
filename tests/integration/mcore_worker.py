"""Rank functions for the megatron-core tests (run by ``tests/_dist.run_ranks`` in fresh processes).

Each call runs several variants one after another in the same process group (megatron-core's
import costs ~7 s a process on 2 cores; building a tiny GPT costs milliseconds), rebuilding
megatron's parallel state, model, DDP and optimizer from the same seed for every variant.
"""

from __future__ import annotations

import torch


def _preset():
    from robust_plugins.recipes.megatron_gpt.train import PRESETS

    return PRESETS["cpu-tiny"]


def main_grads(ddp) -> torch.Tensor:
    """Every parameter's reduced gradient (``main_grad``, megatron's buffer after
    ``finish_grad_sync``), in parameter order: independent of the bucket layout."""
    return torch.cat([p.main_grad.detach().flatten().clone() for p in ddp.parameters()])


def train_variants(rank, world, variants, steps, tp=1, bucket_size=None):
    """Train the cpu-tiny GPT for ``steps`` per variant; return losses, digest, plugin stats and
    the reduced gradient of step 1 (``grad1``; every variant starts from the same weights, so it
    differs from vanilla's by the codec's error alone).

    ``variants``: list of dicts with ``codec`` (None: vanilla megatron-core), ``overlap``.
    """
    from robust_plugins.recipes.megatron_gpt.train import build, param_digest, train_step
    from robust_plugins.workloads import load_corpus

    preset = _preset()
    corpus = load_corpus()
    out = []
    for v in variants:
        parts = build(preset, tp=tp, seed=0, codec=v["codec"], overlap=v["overlap"], distopt=False,
                      bucket_size=bucket_size, optimizer="torch-adamw")
        losses = [train_step(parts, preset, corpus, 0, 1)]
        grad1 = main_grads(parts["ddp"])
        losses += [train_step(parts, preset, corpus, 0, s) for s in range(2, steps + 1)]
        plugin = parts["plugin"]
        stats = None
        if plugin is not None:
            st = plugin.sync.stats
            stats = {"compressed": st.compressed_elements, "passthrough": st.passthrough_elements,
                     "keys": plugin.sync.state.keys(), "groups": len(plugin.groups), "steps": plugin.steps}
        out.append({"losses": losses, "digest": param_digest(parts["ddp"]), "stats": stats,
                    "groups": len(parts["ddp"].bucket_groups), "grad1": grad1})
    return out


def distopt_variants(rank, world, variants, steps):
    """megatron DDP with ``use_distributed_optimizer=True`` stepped by megatron's own
    ``DistributedOptimizer`` (``get_megatron_optimizer``): gradients reduce-scattered into the
    local shard, Adam on the shard, megatron's parameter all-gather. Returns this rank's reduced
    gradient shard of every step (before the optimizer), the losses and the final digest."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from robust_plugins.recipes.megatron_gpt.train import build, param_digest, train_step
    from robust_plugins.workloads import load_corpus

    preset = _preset()
    corpus = load_corpus()
    out = []
    for v in variants:
        parts = build(preset, tp=1, seed=0, codec=v["codec"], overlap=v["overlap"], distopt=True,
                      optimizer="megatron")
        ddp = parts["ddp"]
        shards, losses = [], []

        def local_shards():
            shards.append(torch.cat([shard_buffer(b.grad_data, world)[rank].clone()
                                     for g in ddp.bucket_groups for b in g.buckets]))

        for step in range(1, steps + 1):
            losses.append(train_step(parts, preset, corpus, 0, step, before_step=local_shards))
        out.append({"shards": shards, "losses": losses, "digest": param_digest(ddp),
                    "optimizer": sorted(type(o).__name__ for o in parts["optimizer"].chained_optimizers)})
        if parts["plugin"] is not None:
            parts["plugin"].close()
    return out


def overlap_events(rank, world, steps, gate_step):
    """int8 with ``overlap_grad_reduce``: event order of the overlapped compressed syncs.

    At ``gate_step`` the sync thread is held at the start of the first dispatched bucket group
    until backward reaches the first transformer layer (a module backward pre-hook sets the gate);
    a sync that ran inside its dispatch would block backward there and never see the gate open
    (bounded: ``gate-timeout`` is recorded instead). Returns the events of that step, the losses
    and digest of the gated run (key True), and those of the same buckets synced synchronously at
    dispatch (key False: the plugin's sync thread stopped before training, so each group's
    compressed collectives run inside its dispatch; megatron without overlap would use one big
    bucket, whose blockwise codes differ).
    """
    import threading

    from robust_plugins.recipes.megatron_gpt.train import build, param_digest, train_step
    from robust_plugins.workloads import load_corpus

    preset = _preset()
    corpus = load_corpus()
    out = {}
    for overlap in (False, True):
        parts = build(preset, tp=1, seed=0, codec="int8", overlap=True, distopt=False, optimizer="torch-adamw")
        plugin, ddp = parts["plugin"], parts["ddp"]
        if not overlap:
            plugin.close()
        events, gate, first = [], threading.Event(), []
        state = {"on": False}

        def observer(event, name):
            if not state["on"]:
                return
            events.append((event, name))
            if event == "dispatch" and not first:
                first.append(name)
            if event == "start" and name == first[0] and not gate.wait(20):
                events.append(("gate-timeout", name))

        def layer0_hook(module, grad_output):
            if state["on"]:
                events.append(("layer0-backward", None))
                gate.set()

        plugin.observers.append(observer)
        ddp.module.decoder.layers[0].register_full_backward_pre_hook(layer0_hook)
        losses = []
        for s in range(1, steps + 1):
            state["on"] = s == gate_step
            losses.append(train_step(parts, preset, corpus, 0, s))
            if state["on"]:
                events.append(("step-end", None))
        out[overlap] = {"losses": losses, "digest": param_digest(ddp), "events": events,
                        "threaded": plugin.thread is not None, "groups": len(plugin.groups)}
        plugin.close()
    return out


def block_variants(rank, world, variants, steps):
    """Train the cpu-tiny GPT once per ``robust_plugins`` block (None: vanilla megatron-core).

    ``variants``: list of dicts with ``block`` and ``overlap``. Returns losses, digest and what the
    plugin's sync and telemetry recorded (telemetry records only on rank 0), the reduced gradient of
    step 1 (``grad1``) and the number of gradient elements (``n_params``).
    """
    from robust_plugins.recipes.megatron_gpt.train import build, param_digest, train_step
    from robust_plugins.workloads import load_corpus

    preset = _preset()
    corpus = load_corpus()
    out = []
    for v in variants:
        parts = build(preset, tp=1, seed=0, codec=None, overlap=v["overlap"], distopt=False, block=v["block"],
                      optimizer="torch-adamw")
        plugin = parts["plugin"]
        losses, grad1 = [], None
        for s in range(1, steps + 1):
            losses.append(train_step(parts, preset, corpus, 0, s))
            if s == 1:
                grad1 = main_grads(parts["ddp"])
            if plugin is not None:
                plugin.step_end(s, loss=losses[-1])
        info = {"grad1": grad1, "n_params": sum(p.numel() for p in parts["ddp"].parameters())}
        if plugin is not None and plugin.sync is not None:
            st = plugin.sync.stats
            info.update({"hierarchical": st.hierarchical_elements, "by_codec": dict(st.by_codec),
                         "auto": len(st.auto_decisions), "decisions": list(st.auto_decisions),
                         "by_route": dict(st.by_route), "threaded": plugin.thread is not None})
        if plugin is not None and plugin.telemetry is not None:
            info["records"] = list(plugin.telemetry.records)
        if plugin is not None:
            plugin.close()
        out.append({"losses": losses, "digest": param_digest(parts["ddp"]), **info})
    return out


def rank_order_tp2(rank, world, topology_file, steps):
    """apply_rank_order, then TP=2 megatron GPT: which launcher ranks form this rank's TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import robust_plugins.megatron as rpm
    from robust_plugins.recipes.megatron_gpt.train import build, train_step
    from robust_plugins.workloads import load_corpus

    info = rpm.apply_rank_order(tp=2, topology_file=topology_file)
    assert dist.get_rank() == info["rank"]
    preset = _preset()
    parts = build(preset, tp=2, seed=0, codec="int8", overlap=False, distopt=False, optimizer="torch-adamw")
    losses = [train_step(parts, preset, load_corpus(), 0, s) for s in range(1, steps + 1)]
    tp_group = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    dp_group = dist.get_process_group_ranks(ps.get_data_parallel_group())
    return {**info, "tp_launcher": [info["order"][r] for r in tp_group],
            "dp_launcher": [info["order"][r] for r in dp_group], "losses": losses}

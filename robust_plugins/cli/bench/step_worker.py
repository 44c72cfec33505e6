"""Rank program of ``robust bench comm --train-steps N``: training steps of the text GPT.

Started once per rank inside the simulator. Every method trains the same GPT (same seed, same
batches) for ``--steps`` optimizer steps with a different gradient communication:

* PyTorch ``DistributedDataParallel`` over gloo: its own fp32 all-reduce (``ddp fp32``), its
  ``fp16_compress_hook`` and its ``powerSGD_hook`` at rank 4 (``start_powerSGD_iter=2``, with
  error feedback and warm start; it can hang on gloo, so ``robust bench comm`` runs it in a launch
  of its own with a short bound);
* DeepSpeed ZeRO-0 (``deepspeed.initialize``, AdamW): its default fp32 all-reduce (``ds fp32``),
  ``communication_data_type: bf16`` (``ds bf16``), and this package's integration through the
  ``robust_plugins`` block: flat and hierarchical int8/int4 and hierarchical ``auto``
  (``ds hier auto``: ``auto`` chooses flat or hierarchical, and the codec), each with its buckets
  reduced during backward (``compression.overlap``, the default), and ``ds hier auto no-overlap``
  (the same buckets reduced after backward). DeepSpeed 0.19's ``gradient_clipping`` defaults to
  1.0 and DDP does not clip: the ``ds`` engines set it to 0 so that both hosts train the same math
  (``ds fp32`` and ``ddp fp32`` then end bitwise equal on loopback).

Rank 0 prints one JSON line with each method's step times (barrier to barrier) and held-out
loss after the last step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist

METHODS = ("ddp fp32", "ddp fp16_compress_hook", "ds fp32", "ds bf16", "ds flat int8", "ds flat int4",
           "ds hier int8", "ds hier int4", "ds hier auto", "ds hier auto no-overlap", "ddp powerSGD_hook",
           "plugin flat int8", "plugin hier int8", "plugin hier auto")
#: What ``robust bench comm --train-steps`` runs by default (the ``plugin *`` rows are the same
#: reductions through DDP comm hooks; ``ddp powerSGD_hook`` runs in a launch of its own).
DEFAULT_METHODS = METHODS[:10]


def _sync_hook(sync, world: int):
    """A DDP comm hook averaging each bucket through ``sync`` (what a host integration does)."""

    def hook(_state, bucket):
        buf = bucket.buffer()
        # DDP rebuilds its buckets after the first iteration; the size in the key keeps a rebuilt
        # bucket from meeting the residual of a different slice.
        key = ("ddp", bucket.index(), buf.numel())
        if sync.compress_key("ddp", buf.numel()) is None:
            dist.all_reduce(buf)
        else:
            sync.all_reduce_sum(buf, None, key)
        buf.div_(world)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook


def _install(name: str, ddp, world: int, step_ref: list) -> object | None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from robust_plugins.comm import CompressionState, ddp_comm_hook
    from robust_plugins.comm.gradient_sync import GradientSync
    from robust_plugins.config import CompressionConfig, TopologyConfig

    if name == "ddp fp32":
        return None
    if name == "ddp fp16_compress_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if name == "ddp powerSGD_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return None
    if name == "plugin flat int8":
        ddp.register_comm_hook(CompressionState(codec="int8"), ddp_comm_hook)
        return None
    codec = name.split()[-1]
    sync = GradientSync(CompressionConfig(codec=codec), step_fn=lambda: step_ref[0],
                        topology=TopologyConfig(hierarchical=True))
    ddp.register_comm_hook(None, _sync_hook(sync, world))
    return sync


def _ds_block(name: str, bucket_mb: float | None = None) -> dict | None:
    """The DeepSpeed config entries of a ``ds *`` method beyond the common ones."""
    if name == "ds fp32":
        return {}
    if name == "ds bf16":
        return {"communication_data_type": "bf16"}
    _, layout, codec, *rest = name.split()
    block: dict = {"compression": {"codec": codec, "overlap": rest != ["no-overlap"]}}
    if bucket_mb is not None:
        block["compression"]["bucket_mb"] = bucket_mb
    if layout == "hier":
        block["topology"] = {"hierarchical": True}
    return {"robust_plugins": block}


def _ds_engine(name: str, model, micro_batch: int, bucket_mb: float | None = None):
    import robust_plugins  # noqa: F401  (installs the DeepSpeed patch before initialize)
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
           # DeepSpeed 0.19 clips at norm 1.0 unless told otherwise (runtime/constants.py,
           # GRADIENT_CLIPPING_DEFAULT); the DDP rows do not clip. Clipping cost ds fp32 +1.73 % val
           # loss against ddp fp32 here; without it the two end bitwise equal.
           "gradient_clipping": 0.0,
           # CPU: DeepSpeed's 5e8-element default buckets cost seconds a step.
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
           **_ds_block(name, bucket_mb)}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _round_summary(res: dict) -> dict:
    """One round of one method, for the JSON: median step time, val loss and auto's choice."""
    import statistics

    return {"round": res["round"], "median_s": statistics.median(res["times_s"]), "val_loss": res["val_loss"],
            **({"choice": res["choice"]} if "choice" in res else {})}


def main() -> int:
    """Train each method; rank 0 prints the JSON result."""
    from robust_plugins.topology import build_groups, discover
    from robust_plugins.workloads.gpt import build_gpt
    from robust_plugins.workloads.text import get_batch, load_corpus

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="train every method this many times, in alternating order (forward, reverse, ...), "
                             "each time on fresh engines; a method's step times are those of all rounds")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="compression.bucket_mb of the plugin's ds rows (default: the config's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    build_groups(discover().records)  # the hierarchical methods reuse these cached groups
    corpus = load_corpus()
    out: dict = {"world_size": world, "methods": {}}
    # Rounds in alternating order: this machine's speed drifts within a launch (other jobs, the
    # cores' clocks), and a method always run last or first would carry that drift alone.
    order = [(r, name) for r in range(max(1, args.rounds))
             for name in (args.methods if r % 2 == 0 else list(reversed(args.methods)))]
    for round_, name in order:
        model = build_gpt("small", seed=0, d_model=args.d_model, n_layer=args.layers, seq_len=args.seq_len)
        step_ref = [0]
        engine = ddp = opt = sync = None
        if name.startswith("ds "):
            engine = _ds_engine(name, model, args.micro_batch, args.bucket_mb)
            plugin = getattr(engine, "robust_plugins", None)
            sync = plugin.sync if plugin is not None else None
        else:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            sync = _install(name, ddp, world, step_ref)
            opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        times, losses = [], []
        for step in range(args.steps):
            x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world,
                             micro_batch=args.micro_batch, seq_len=args.seq_len)
            dist.barrier()
            start = time.perf_counter()
            if engine is not None:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            else:
                loss = ddp(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            dist.barrier()
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
            step_ref[0] += 1
        with torch.no_grad():
            total = torch.zeros(1)
            for i in range(8):
                x, y = get_batch(corpus, "val", seed=0, step=i, rank=rank, world_size=world,
                                 micro_batch=args.micro_batch, seq_len=args.seq_len)
                total += model(x, y).float()
            dist.all_reduce(total)
        res = {"times_s": times[2:], "val_loss": float(total) / (8 * world), "train_losses": losses,
               "params": sum(p.numel() for p in model.parameters())}
        if sync is not None and sync.auto is not None:
            everyone = [None] * world
            dist.all_gather_object(everyone, sync.stats.auto_decisions)
            res["choice"] = "/".join(sorted({d.get("route", d["codec"]) for ds in everyone for d in ds}))
            res["decisions"] = everyone[0]
            buckets = getattr(getattr(engine, "robust_plugins", None), "buckets", None)
            if buckets is not None and buckets.host_choices:
                # auto handed the step back to DeepSpeed's one bucket: say so, with the wire.
                wires = "/".join(sorted({c["wire"] for c in buckets.host_choices}))
                res["choice"] += f", then DeepSpeed's bucket ({wires})"
                res["host_choices"] = buckets.host_choices
                res["host_trial_s"] = buckets.host_trial_s
        res["round"] = round_
        prev = out["methods"].get(name)
        if prev is None:
            res["rounds"] = [_round_summary(res)]
            out["methods"][name] = res
        else:  # step times of every round; val loss and losses stay the first round's
            prev["times_s"] += res["times_s"]
            prev["rounds"].append(_round_summary(res))
            if "choice" in res and res["choice"] not in prev["choice"].split(" | "):
                prev["choice"] += f" | {res['choice']}"  # each round decides afresh: every distinct choice
        if engine is not None and getattr(engine, "robust_plugins", None) is not None:
            from robust_plugins.patches.deepspeed import detach

            detach(engine)  # stops the overlap's sync thread, which holds the engine
        del ddp, opt, engine, sync
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

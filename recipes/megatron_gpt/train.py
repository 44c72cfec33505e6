"""Train a megatron-core ``GPTModel`` as Megatron-LM does, with robust_plugins, on CPU or GPU.

Run under torchrun (or ``robust run``, which adds fault detection and restarts)::

    torchrun --nproc-per-node 4 -m robust_plugins.recipes.megatron_gpt.train \\
        --preset cpu-3d --steps 100 --codec int8 --ckpt-dir runs/mcore/ckpt --save-every 50

Presets (:data:`PRESETS`, ``model.py``): ``cpu-tiny`` (2-4 CPU ranks over gloo, fp32, a few
seconds of training), ``cpu-3d`` (4 CPU ranks: PP 2 x DP 2, bf16, megatron's distributed
optimizer), ``cpu-moe`` (4 CPU ranks: 4 experts top-2, EP 2 x expert-DP 2, bf16, distributed
optimizer; ``--experts``, ``--ep``, ``--topk`` and ``--dispatcher`` make any preset MoE), and GPU
presets ``gpu-3d-tiny`` (``cpu-3d``'s shape on 4+ GPUs), ``gpu-125m`` (TP 1), ``gpu-1.3b`` (TP 2 x
PP 2) and ``gpu-8b``
(TP 4 x PP 2, one 8-GPU node): NCCL, bf16, configs only, never run here (untested on GPU).
``--tp``, ``--pp``, ``--vpp`` and ``--bf16`` override a preset's layout.

The step is Megatron-LM's: megatron-core's ``get_forward_backward_func()`` schedule (no pipelining,
1F1B, or interleaved 1F1B with ``--vpp``) over ``gas`` micro-batches, ``finalize_model_grads``
(the data-parallel gradient sync, which is what robust_plugins changes), then megatron's own
optimizer (``--optimizer megatron``, the default: ``get_megatron_optimizer``, with the
``DistributedOptimizer`` by default whenever the data-parallel size is above 1). ``--optimizer
torch-adamw`` steps a ``torch.optim.AdamW`` on ``param.main_grad`` and ``sharded-adamw`` the
:class:`~robust_plugins.recipes.megatron_gpt.sharded_adamw.ShardedAdamW`. On CPU the recipe installs
the CPU shim (``patches/megatron_cpu.py``) and passes an explicit causal mask (megatron's default
mask is built with ``device="cuda"``). Data are the byte-level standard-library corpus
(:mod:`robust_plugins.workloads.text`), indexed by step and data-parallel rank, so a run resumed
from a checkpoint at step ``k`` sees exactly the batches the uninterrupted run sees.

Rank placement: megatron-core puts TP groups on consecutive ranks. By default
(``--rank-order topology``) the recipe discovers the topology (``--topology-file``,
``ROBUST_TOPOLOGY_SIM``, SLURM, host names) and renumbers the ranks with
:func:`robust_plugins.megatron.apply_rank_order` before megatron builds its groups, so every TP
group stays inside a node whatever order the launcher started the processes in;
``--rank-order launcher`` keeps the launcher's ranks.
"""

# robust_plugins first (cheap, imports nothing heavy); megatron-core is imported in main().
import robust_plugins  # noqa: F401,I001

import argparse
import functools
import hashlib
import json
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from robust_plugins import watchdog
from robust_plugins.device import collective_device
from robust_plugins.errors import ConfigError
from robust_plugins.recipes.megatron_gpt.model import DISPATCHERS, OPTIMIZERS, PRESETS, Preset, build
from robust_plugins.workloads import get_batch, load_corpus

__all__ = ["PRESETS", "Preset", "build", "train_step", "global_loss", "param_digest", "run", "main"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=50, help="total optimizer steps to reach (default 50)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the preset's)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (default: the preset's)")
    p.add_argument("--vpp", type=int, help="virtual pipeline stages per pipeline rank: interleaved 1F1B "
                                           "(default: the preset's, none)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 parameters in Float16Module, fp32 main parameters (default: the preset's)")
    p.add_argument("--experts", type=int, help="mixture of experts: experts per layer (default: the preset's; "
                                              "cpu-moe has 4)")
    p.add_argument("--ep", type=int, help="expert-parallel size (default: the preset's)")
    p.add_argument("--topk", type=int, help="experts per token (default: the preset's, 2)")
    p.add_argument("--dispatcher", choices=DISPATCHERS, help="megatron MoE token dispatcher (default: alltoall)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="megatron",
                   help="megatron (default): get_megatron_optimizer; torch-adamw; sharded-adamw")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                   help="megatron's distributed optimizer (gradient reduce-scatter, sharded optimizer state); "
                        "default: on when the data-parallel size is above 1 (off with --optimizer torch-adamw)")
    p.add_argument("--codec", default=None,
                   help="robust_plugins compression codec (none, bf16, int8, int4, sign); omit for vanilla megatron")
    p.add_argument("--plugin-json",
                   help="JSON file holding the robust_plugins block (or a config with a 'robust_plugins' key): "
                        "topology, telemetry, compression settings; --codec overrides its codec")
    p.add_argument("--rank-order", choices=("topology", "launcher"), default="topology",
                   help="topology (default): renumber ranks so TP groups stay inside a node; launcher: keep RANK")
    p.add_argument("--topology-file", help="topology file for --rank-order topology (default: discovered)")
    p.add_argument("--overlap-grad-reduce", action="store_true", help="megatron DDP overlap_grad_reduce")
    p.add_argument("--ckpt-dir", help="verified dist_checkpointing saves go here; resumes from the newest valid one")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--memory-every", type=int, default=None,
                   help="in-memory snapshot every N steps (checkpoint.memory_every; with --ckpt-dir)")
    p.add_argument("--peer-backup", action="store_true",
                   help="copy each snapshot to a peer rank (checkpoint.peer_backup; with --memory-every)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step (default: micro batch x data-parallel size x the preset's "
                        "micro-batches); recorded in checkpoints, so a resume at another data-parallel size keeps "
                        "it by gradient accumulation; also records the global loss of every step")
    p.add_argument("--out", help="rank 0 writes the result JSON here")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints the loss every N steps (0: never)")
    return p.parse_args(argv)


def plugin_block(codec: str | None, path: str | None) -> dict | None:
    """The ``robust_plugins`` block: the file's (``--plugin-json``) with ``codec`` as its codec."""
    block: dict | None = None
    if path:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ConfigError(f"--plugin-json {path}: expected a JSON object, got {type(data).__name__}.")
        block = dict(data.get("robust_plugins", data))
    if codec is not None:
        block = dict(block or {})
        block["compression"] = {**block.get("compression", {}), "codec": codec}
    return block


def _forward_step(mask: torch.Tensor, slices: list, data_iterator, model):
    """Megatron-LM's ``forward_step`` contract: (output, loss function) for one micro-batch."""
    x, position_ids, y = next(data_iterator)
    output = model(x, position_ids, mask, labels=y)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        slices.append(loss.detach().clone())  # the schedule divides ``loss`` in place afterwards
        return loss, {"lm loss": slices[-1]}

    return output, loss_func


def _micro_batches(parts: dict[str, Any], preset: Preset, corpus, seed: int, step: int, gas: int, device,
                   first: bool, last: bool) -> list:
    """This rank's ``gas`` micro-batches of ``step`` as (tokens, positions, labels); tokens and
    positions only where a chunk embeds (first stage), labels only where one computes the loss."""
    layout = parts["layout"]
    out = []
    for m in range(gas):
        x, y = get_batch(corpus, "train", seed=seed, step=step, rank=layout.dp_rank * gas + m,
                         world_size=layout.dp * gas, micro_batch=preset.micro_batch, seq_len=preset.seq_len)
        x, y = x.to(device), y.to(device)
        pos = torch.arange(preset.seq_len, device=device).unsqueeze(0).expand_as(x)
        out.append((x if first else None, pos if first else None, y if last else None))
    return out


def train_step(parts: dict[str, Any], preset: Preset, corpus, seed: int, step: int, gas: int = 1,
               slice_losses: torch.Tensor | None = None, before_step: Callable[[], None] | None = None) -> float:
    """One optimizer step on the batch of ``step``: ``gas`` micro-batches a rank through megatron's
    pipeline schedule; returns the step's mean loss on this data-parallel rank (every stage).

    The global batch of a step is ``dp * gas`` slices of ``micro_batch`` samples (fixed by seed
    and step); data-parallel rank r takes slices ``r*gas .. r*gas+gas-1``, so another
    data-parallel size with the same ``dp * gas`` sees the same samples. ``slice_losses`` (a
    ``dp * gas`` tensor) receives the loss of each of this rank's slices on the last pipeline
    stage (zeros elsewhere). ``before_step`` runs after the gradient sync, before the optimizer.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, opt, layout = parts["model"], parts["optimizer"], parts["layout"]
    device = "cpu" if preset.device == "cpu" else torch.cuda.current_device()
    s = preset.seq_len
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=device), diagonal=1)
    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    iterators, losses = [], []
    for vp in range(len(model)):
        stage = vp if layout.vpp else None
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        iterators.append(iter(_micro_batches(parts, preset, corpus, seed, step, gas, device, first, last)))
    get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, causal, losses),
        data_iterator=iterators if len(model) > 1 else iterators[0], model=model if len(model) > 1 else model[0],
        num_microbatches=gas, seq_length=s, micro_batch_size=preset.micro_batch, forward_only=False)
    if before_step is not None:
        before_step()
    if layout.optimizer == "torch-adamw":
        for p in model[0].parameters():
            p.grad = p.main_grad
    opt.step()
    if slice_losses is not None:
        for m, loss in enumerate(losses):
            slice_losses[layout.dp_rank * gas + m] = loss.double()
    # On the rank's device (the losses' own): the broadcast below runs on NCCL on GPU presets.
    mean = torch.stack(losses).double().mean() if losses else torch.zeros((), dtype=torch.float64, device=device)
    if layout.pp > 1:  # the last stage computed it: every stage reports the same loss
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(mean, src=dist.get_process_group_ranks(group)[-1], group=group)
    return float(mean)


def global_loss(slice_losses: torch.Tensor) -> float:
    """Mean loss of a step over every slice of the global batch (collective over the default group).

    Each slice's loss is on one rank only (zeros elsewhere: the sum is exact); with tensor
    parallelism every rank of a TP group holds the same value, hence the division by ``tp``. The
    slices are then added in order, the same additions at any data-parallel size."""
    from megatron.core import parallel_state as ps

    dist.all_reduce(slice_losses)
    total = 0.0
    for v in (slice_losses / ps.get_tensor_model_parallel_world_size()).tolist():
        total += v
    return total / slice_losses.numel()


def param_digest(model) -> str:
    """sha256 of every parameter's bytes, in order (equal digests = bitwise equal models); ``model``
    is one module or a list of model chunks."""
    h = hashlib.sha256()
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for p in chunk.parameters():
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _accumulation(args: argparse.Namespace, preset: Preset, dp: int, ckpt) -> int:
    if ckpt is not None and ckpt.gradient_accumulation_steps is not None:
        return ckpt.gradient_accumulation_steps  # a resharded checkpoint's global batch wins
    if args.global_batch is None:
        return preset.micro_batches
    if args.global_batch % (preset.micro_batch * dp):
        raise ConfigError(f"--global-batch {args.global_batch} is not a multiple of micro batch "
                          f"{preset.micro_batch} x data-parallel size {dp}.")
    return args.global_batch // (preset.micro_batch * dp)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train as ``args`` say in an initialized process group; returns the rank's result dict."""
    import robust_plugins.megatron as rpm

    preset = PRESETS[args.preset]
    tp = args.tp if args.tp is not None else preset.tp
    parts = build(preset, tp=tp, seed=args.seed, codec=args.codec, overlap=args.overlap_grad_reduce,
                  distopt=args.distributed_optimizer, block=plugin_block(args.codec, args.plugin_json),
                  pp=args.pp, vpp=args.vpp, bf16=args.bf16, optimizer=args.optimizer, experts=args.experts,
                  ep=args.ep, topk=args.topk, dispatcher=args.dispatcher)
    rpm.name_pipeline_stage()  # robust run's straggler detector: each stage against itself
    corpus = load_corpus()
    ckpt = None
    start = 0
    if args.ckpt_dir:
        block = {"dir": args.ckpt_dir, "keep": 3}
        if args.memory_every is not None:
            block.update(memory_every=args.memory_every, peer_backup=args.peer_backup)
        ckpt = rpm.MegatronCheckpointer(parts["model"], parts["optimizer"], block, plugin=parts["plugins"],
                                        global_batch=args.global_batch,
                                        micro_batch=preset.micro_batch if args.global_batch else None)
        start = ckpt.load() or 0
    dp = parts["layout"].dp
    gas = _accumulation(args, preset, dp, ckpt)
    losses, global_losses, step_s = [], [], []
    t0 = time.perf_counter()
    try:
        for step in range(start + 1, args.steps + 1):
            t_step = time.perf_counter()
            slices = (torch.zeros(dp * gas, dtype=torch.float64, device=collective_device())
                      if args.global_batch else None)
            loss = train_step(parts, preset, corpus, args.seed, step, gas=gas, slice_losses=slices)
            losses.append(loss)
            if slices is not None:
                global_losses.append(global_loss(slices))
            if args.log_every and step % args.log_every == 0 and dist.get_rank() == 0:
                print(f"step {step} loss {loss:.4f}", flush=True)
            if ckpt is not None:
                ckpt.step_end(step, loss=loss)
                if args.save_every and step % args.save_every == 0:
                    ckpt.save(step)
            elif parts["plugin"] is not None:
                parts["plugin"].step_end(step, loss=loss)
            else:
                watchdog.step_end(step, loss=loss)
            step_s.append(time.perf_counter() - t_step)
    finally:
        if ckpt is not None:
            ckpt.close()
        for plugin in parts["plugins"] or []:
            plugin.close()
    from megatron.core import parallel_state as ps

    memory = ckpt.memory if ckpt is not None else None
    order = getattr(args, "rank_order_info", {}).get("order") or list(range(dist.get_world_size()))
    tp_launcher = [order[r] for r in dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())]
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, param_digest(parts["model"]))
    # each rank's data-parallel replicas (context-parallel included): what its weights must equal
    dp_groups: list = [None] * dist.get_world_size()
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    dist.all_gather_object(dp_groups, dist.get_process_group_ranks(dp_group))
    # gradient elements this rank's data-parallel sync reduces (bucket sizes, padding included)
    grad_elements: list = [None] * dist.get_world_size()
    dist.all_gather_object(grad_elements, sum(b.grad_data.numel() for m in parts["model"]
                                              for g in m.bucket_groups for b in g.buckets))
    return {"preset": args.preset, "codec": args.codec, "start": start, "gradient_accumulation_steps": gas,
            "global_losses": global_losses, "resharded": ckpt.resharded if ckpt is not None else None,
            "tp_group_launcher_ranks": tp_launcher, "steps": args.steps, "losses": losses,
            "train_s": time.perf_counter() - t0, "step_s": step_s,
            "snapshot_blocking_s": list(memory.blocking_s) if memory is not None else None, "digest": digests[dist.get_rank()], "digests": digests,
            "grad_elements_by_rank": grad_elements, "dp_group_by_rank": dp_groups,
            "param_sums": [float(p.detach().double().sum()) for p in parts["ddp"].parameters()],
            "param_abs_sums": [float(p.detach().double().abs().sum()) for p in parts["ddp"].parameters()],
            "param_numels": [p.numel() for p in parts["ddp"].parameters()],
            **parts["layout"].as_dict()}


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point."""
    args = parse_args(argv)
    if not dist.is_initialized():
        backend = "nccl" if PRESETS[args.preset].device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # NCCL's default 10 min, raised to what robust run needs to judge a hang before NCCL aborts.
        dist.init_process_group(backend, timeout=watchdog.pg_timeout(600))
    try:
        if args.rank_order == "topology":
            import robust_plugins.megatron as rpm

            preset = PRESETS[args.preset]
            ep = args.ep or (preset.ep if (args.experts or preset.experts) else 1)
            args.rank_order_info = rpm.apply_rank_order(tp=args.tp or preset.tp, pp=args.pp or preset.pp, ep=ep,
                                                        topology_file=args.topology_file,
                                                        timeout=watchdog.pg_timeout(600))
        result = run(args)
        if dist.get_rank() == 0:
            long = ("losses", "global_losses", "param_sums", "param_abs_sums", "param_numels", "digests",
                    "grad_elements_by_rank", "dp_group_by_rank",
                    "step_s", "snapshot_blocking_s")
            line = json.dumps({k: v for k, v in result.items() if k not in long} |
                              {"first_loss": result["losses"][:1], "last_loss": result["losses"][-1:]})
            print(line, flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    finally:
        import robust_plugins.megatron as rpm

        rpm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

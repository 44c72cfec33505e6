"""Train a megatron-core ``GPTModel`` with megatron-core DDP and robust_plugins, on CPU or GPU.

Run under torchrun (or ``robust run``, which adds fault detection and restarts)::

    torchrun --nproc-per-node 2 -m robust_plugins.recipes.megatron_gpt.train \\
        --preset cpu-tiny --steps 100 --codec int8 --ckpt-dir runs/mcore/ckpt --save-every 50

Presets (:data:`PRESETS`): ``cpu-tiny`` (2-4 CPU ranks over gloo, a few seconds of training;
what CI runs), ``gpu-125m`` and ``gpu-1b`` (NCCL, bf16, megatron-core's own optimizer; configs
only, never run here: untested on GPU). Data are the byte-level standard-library corpus
(:mod:`robust_plugins.workloads.text`), indexed by step and data-parallel rank, so a run resumed
from a checkpoint at step ``k`` sees exactly the batches the uninterrupted run sees.

On CPU the recipe installs the CPU shim (``patches/megatron_cpu.py``), passes an explicit causal
mask (megatron's default mask is built with ``device="cuda"``) and steps a ``torch.optim.AdamW`` on
``param.main_grad``: megatron-core 0.16's optimizers (``get_megatron_optimizer``) allocate CUDA
tensors unconditionally, and its distributed optimizer requires ``torch.cuda`` parameter types,
so neither runs on CPU; with ``--distributed-optimizer`` the CPU presets use :class:`ShardedAdamW`
(AdamW on each rank's shard of megatron's buffers). The gradient sync, which is what robust_plugins
changes, is megatron's DDP in every case.

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
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from robust_plugins.errors import ConfigError
from robust_plugins.workloads import get_batch, load_corpus


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model, parallel layout and optimizer settings of one recipe preset."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_len: int
    micro_batch: int
    tp: int
    device: str
    """``cpu`` (gloo, fp32, CPU shim) or ``cuda`` (NCCL, bf16)."""
    lr: float = 1e-3
    bucket_size: int | None = None
    """megatron DDP bucket size in elements (None: megatron's default, 40M, one bucket on small models)."""


PRESETS: dict[str, Preset] = {
    # 0.14M parameters: 200 steps on 2 CPU ranks train in ~10 s; bucket_size splits it into
    # several buckets so that per-bucket keys, overlap and bucket groups are exercised.
    "cpu-tiny": Preset(num_layers=2, hidden_size=64, num_attention_heads=2, seq_len=64, micro_batch=4,
                       tp=1, device="cpu", lr=1e-3, bucket_size=40_000),
    # GPT-2 small shape (byte vocabulary); TP 1, DP over every GPU. Untested here (no GPU).
    "gpu-125m": Preset(num_layers=12, hidden_size=768, num_attention_heads=12, seq_len=1024, micro_batch=8,
                       tp=1, device="cuda", lr=6e-4),
    # ~1.2B parameters; TP 2 inside a node (rank order from the topology), DP across. Untested here.
    "gpu-1b": Preset(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_len=2048, micro_batch=4,
                     tp=2, device="cuda", lr=3e-4),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=50, help="total optimizer steps to reach (default 50)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the preset's)")
    p.add_argument("--codec", default=None,
                   help="robust_plugins compression codec (none, bf16, int8, int4, sign); omit for vanilla megatron")
    p.add_argument("--plugin-json",
                   help="JSON file holding the robust_plugins block (or a config with a 'robust_plugins' key): "
                        "topology, telemetry, compression settings; --codec overrides its codec")
    p.add_argument("--rank-order", choices=("topology", "launcher"), default="topology",
                   help="topology (default): renumber ranks so TP groups stay inside a node; launcher: keep RANK")
    p.add_argument("--topology-file", help="topology file for --rank-order topology (default: discovered)")
    p.add_argument("--overlap-grad-reduce", action="store_true", help="megatron DDP overlap_grad_reduce")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="megatron distributed optimizer (grad reduce-scatter; on CPU presets: ShardedAdamW)")
    p.add_argument("--ckpt-dir", help="verified dist_checkpointing saves go here; resumes from the newest valid one")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--memory-every", type=int, default=None,
                   help="in-memory snapshot every N steps (checkpoint.memory_every; with --ckpt-dir)")
    p.add_argument("--peer-backup", action="store_true",
                   help="copy each snapshot to a peer rank (checkpoint.peer_backup; with --memory-every)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step (default: micro batch x data-parallel size, no accumulation); "
                        "recorded in checkpoints, so a resume at another data-parallel size keeps it by "
                        "gradient accumulation; also records the global loss of every step")
    p.add_argument("--out", help="rank 0 writes the result JSON here")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints the loss every N steps (0: never)")
    return p.parse_args(argv)


class ShardedAdamW:
    """The distributed optimizer of the CPU presets: AdamW on this rank's shard of megatron's buffers.

    megatron-core 0.16's ``DistributedOptimizer`` needs CUDA. With ``use_distributed_optimizer``
    megatron's DDP already does the distributed part on CPU too: parameters live in one contiguous
    buffer per dtype, and each bucket's gradients are reduce-scattered so that data-parallel rank r
    holds the reduced gradients of shard r. This class steps a ``torch.optim.AdamW`` over those
    shards only (each rank keeps 1/dp of the moments, as a distributed optimizer does), then
    megatron's ``start_param_sync`` all-gathers the updated parameters. Its optimizer state is
    checkpointed in model space: :meth:`sharded_state_dict` gives one ``ShardedTensor`` per
    parameter and moment, so a checkpoint resumes at another data-parallel size.
    """

    def __init__(self, ddp, lr: float, dp_rank: int, dp_size: int):
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        self.ddp, self.dp_rank, self.dp_size = ddp, dp_rank, dp_size
        self.params: list[torch.nn.Parameter] = []
        self._grads: list[torch.Tensor] = []
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                # Parameter() of a view aliases its storage: stepping it updates megatron's buffer.
                self.params.append(torch.nn.Parameter(shard_buffer(bucket.param_data, dp_size)[dp_rank]))
                self._grads.append(shard_buffer(bucket.grad_data, dp_size)[dp_rank])
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)

    def zero_grad(self) -> None:
        """Nothing to do: the gradient shards are views of megatron's buffer (``zero_grad_buffer``)."""

    def step(self) -> None:
        """AdamW on the local shards (after ``finish_grad_sync``), then all-gather the parameters."""
        for p, g in zip(self.params, self._grads):
            p.grad = g
        self.opt.step()
        self.ddp.start_param_sync(force_sync=True)

    def _ensure_state(self) -> None:
        for p in self.params:
            if not self.opt.state[p]:
                self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}

    def _layout(self) -> list[tuple[int, torch.nn.Parameter, int, int]]:
        """(bucket index, parameter, start, end) of every parameter, positions in its bucket."""
        out, i = [], 0
        for buffer in self.ddp.buffers:
            for bucket in buffer.buckets:
                for p in bucket.params_list:
                    start, end, _ = buffer.param_index_map[p]
                    out.append((i, p, start - bucket.offset, end - bucket.offset))
                i += 1
        return out

    def sharded_state_dict(self, model_sd: dict, is_loading: bool = False) -> dict:
        """dist_checkpointing view of the moments in model space: one tensor per parameter and moment.

        Keyed and sharded like the parameter itself (``optimizer.state.<moment>.<param key>``,
        data-parallel rank 0 the main replica), never by bucket: bucket sizes and padding
        depend on the data-parallel size, parameters do not, so a checkpoint written at one
        data-parallel size loads at another (megatron's "fully_reshardable" idea). Saving
        all-gathers each bucket's moments over the data-parallel group (collective).
        """
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor,
        )

        self._ensure_state()
        full: dict[tuple[int, str], torch.Tensor] = {}
        for i, p in enumerate(self.params):
            for name in ("exp_avg", "exp_avg_sq"):
                shard = self.opt.state[p][name]
                whole = torch.zeros(shard.numel() * self.dp_size, dtype=shard.dtype, device=shard.device)
                if not is_loading:  # a load only needs the template's shapes
                    dist.all_gather_into_tensor(whole, shard.contiguous(), group=ps.get_data_parallel_group())
                full[(i, name)] = whole
        layout = self._layout()
        id_map = get_param_id_to_sharded_param_map(model_sd, [p for _, p, _, _ in layout])
        moments = {}
        for pid, (i, p, start, end) in enumerate(layout):
            for name in ("exp_avg", "exp_avg_sq"):
                moments[f"{pid}.{name}"] = make_sharded_optimizer_tensor(
                    id_map[pid], full[(i, name)][start:end].view(p.shape), f"optimizer.state.{name}")
        steps = {float(self.opt.state[p]["step"]) for p in self.params}
        if len(steps) != 1:
            raise RuntimeError(f"ShardedAdamW: buckets stepped different numbers of times {sorted(steps)}")
        return {"moments": moments, "step": self.opt.state[self.params[0]]["step"].clone(),
                "lr": [g["lr"] for g in self.opt.param_groups]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`sharded_state_dict` saved (as loaded by ``dist_checkpointing.load``):
        each rank copies its shard of every bucket out of the per-parameter moments."""
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        self._ensure_state()
        layout = self._layout()
        for i, p in enumerate(self.params):
            for name in ("exp_avg", "exp_avg_sq"):
                shard = self.opt.state[p][name]
                whole = torch.zeros(shard.numel() * self.dp_size, dtype=shard.dtype, device=shard.device)
                for pid, (j, param, start, end) in enumerate(layout):
                    if j == i:
                        whole[start:end] = sd["moments"][f"{pid}.{name}"].reshape(-1)
                shard.copy_(shard_buffer(whole, self.dp_size)[self.dp_rank])
            self.opt.state[p]["step"] = sd["step"].clone()
        for g, lr in zip(self.opt.param_groups, sd["lr"]):
            g["lr"] = lr


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


def build(preset: Preset, *, tp: int, seed: int, codec: str | None, overlap: bool, distopt: bool,
          bucket_size: int | None = None, block: dict | None = None) -> dict[str, Any]:
    """Initialize megatron's parallel state and build model, DDP, optimizer and plugin.

    Expects an initialized default process group. Returns a dict with ``ddp``, ``optimizer``,
    ``plugin`` (None without ``codec``), ``config`` and the parallel ``layout``.
    """
    cpu = preset.device == "cpu"
    if cpu:
        from robust_plugins.patches import megatron_cpu

        megatron_cpu.install()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    import robust_plugins.megatron as rpm

    if dist.get_world_size() % tp:
        raise ConfigError(f"tp = {tp} does not divide the world size {dist.get_world_size()}.")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=preset.num_layers, hidden_size=preset.hidden_size,
        num_attention_heads=preset.num_attention_heads, use_cpu_initialization=cpu,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=not cpu,
        params_dtype=torch.float32 if cpu else torch.bfloat16, tensor_model_parallel_size=tp,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256,
                     max_sequence_length=preset.seq_len)
    if not cpu:
        model.cuda(torch.cuda.current_device())
    size = bucket_size if bucket_size is not None else preset.bucket_size
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, use_distributed_optimizer=distopt, grad_reduce_in_fp32=True,
        **({"bucket_size": size} if size is not None else {}),
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    if block is None and codec is not None:
        block = {"compression": {"codec": codec}}
    plugin = rpm.enable(ddp, block) if block is not None else None
    if cpu and distopt:
        optimizer = ShardedAdamW(ddp, preset.lr, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    elif cpu:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=preset.lr, weight_decay=0.0)
    else:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=preset.lr, bf16=True, use_distributed_optimizer=distopt,
                            clip_grad=1.0), [ddp])
    layout = {"tp": tp, "dp": ps.get_data_parallel_world_size(), "dp_rank": ps.get_data_parallel_rank()}
    return {"ddp": ddp, "optimizer": optimizer, "plugin": plugin, "config": config, "layout": layout}


def train_step(parts: dict[str, Any], preset: Preset, corpus, seed: int, step: int, gas: int = 1,
               slice_losses: torch.Tensor | None = None) -> float:
    """One optimizer step on the batch of ``step``: ``gas`` micro-batches a rank; returns this
    rank's mean loss.

    The global batch of a step is ``dp * gas`` slices of ``micro_batch`` samples (fixed by seed
    and step); data-parallel rank r takes slices ``r*gas .. r*gas+gas-1``, so another
    data-parallel size with the same ``dp * gas`` sees the same samples. ``slice_losses`` (a
    ``dp * gas`` tensor) receives this rank's loss of each of its slices.
    """
    ddp, opt, layout = parts["ddp"], parts["optimizer"], parts["layout"]
    device = "cpu" if preset.device == "cpu" else torch.cuda.current_device()
    s = preset.seq_len
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=device), diagonal=1)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    total = 0.0
    for m in range(gas):
        x, y = get_batch(corpus, "train", seed=seed, step=step, rank=layout["dp_rank"] * gas + m,
                         world_size=layout["dp"] * gas, micro_batch=preset.micro_batch, seq_len=preset.seq_len)
        x, y = x.to(device), y.to(device)
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand_as(x)
        # Gradients accumulate in megatron's buffers; only the last micro-batch syncs them.
        with ddp.no_sync() if m < gas - 1 else contextlib.nullcontext():
            loss = ddp(x, position_ids, causal, labels=y).float().mean()
            (loss / gas if gas > 1 else loss).backward()
        if slice_losses is not None:
            slice_losses[layout["dp_rank"] * gas + m] = loss.detach().double()
        total += float(loss.detach())
    ddp.finish_grad_sync()
    if isinstance(opt, torch.optim.Optimizer):
        for p in ddp.parameters():
            p.grad = p.main_grad
        opt.step()
    else:  # ShardedAdamW (CPU) or megatron's optimizer
        opt.step()
    return total / gas


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


def param_digest(ddp) -> str:
    """sha256 of every parameter's bytes, in order (equal digests = bitwise equal models)."""
    h = hashlib.sha256()
    for p in ddp.parameters():
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train as ``args`` say in an initialized process group; returns the rank's result dict."""
    import robust_plugins.megatron as rpm
    from robust_plugins import watchdog

    preset = PRESETS[args.preset]
    tp = args.tp if args.tp is not None else preset.tp
    parts = build(preset, tp=tp, seed=args.seed, codec=args.codec, overlap=args.overlap_grad_reduce,
                  distopt=args.distributed_optimizer, block=plugin_block(args.codec, args.plugin_json))
    corpus = load_corpus()
    ckpt = None
    start = 0
    if args.ckpt_dir:
        block = {"dir": args.ckpt_dir, "keep": 3}
        if args.memory_every is not None:
            block.update(memory_every=args.memory_every, peer_backup=args.peer_backup)
        ckpt = rpm.MegatronCheckpointer(parts["ddp"], parts["optimizer"], block, plugin=parts["plugin"],
                                        global_batch=args.global_batch,
                                        micro_batch=preset.micro_batch if args.global_batch else None)
        start = ckpt.load() or 0
    dp = parts["layout"]["dp"]
    if ckpt is not None and ckpt.gradient_accumulation_steps is not None:
        gas = ckpt.gradient_accumulation_steps  # a resharded checkpoint's global batch wins
    elif args.global_batch is not None:
        if args.global_batch % (preset.micro_batch * dp):
            raise ConfigError(f"--global-batch {args.global_batch} is not a multiple of micro batch "
                              f"{preset.micro_batch} x data-parallel size {dp}.")
        gas = args.global_batch // (preset.micro_batch * dp)
    else:
        gas = 1
    losses, global_losses = [], []
    t0 = time.perf_counter()
    try:
        for step in range(start + 1, args.steps + 1):
            slices = torch.zeros(dp * gas, dtype=torch.float64) if args.global_batch else None
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
    finally:
        if ckpt is not None:
            ckpt.close()
        if parts["plugin"] is not None:
            parts["plugin"].close()
    from megatron.core import parallel_state as ps

    order = getattr(args, "rank_order_info", {}).get("order") or list(range(dist.get_world_size()))
    tp_launcher = [order[r] for r in dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())]
    return {"preset": args.preset, "codec": args.codec, "start": start, "gradient_accumulation_steps": gas,
            "global_losses": global_losses, "resharded": ckpt.resharded if ckpt is not None else None,
            "tp_group_launcher_ranks": tp_launcher, "steps": args.steps, "losses": losses,
            "train_s": time.perf_counter() - t0, "digest": param_digest(parts["ddp"]),
            "param_sums": [float(p.detach().double().sum()) for p in parts["ddp"].parameters()], **parts["layout"]}


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point."""
    args = parse_args(argv)
    if not dist.is_initialized():
        backend = "nccl" if PRESETS[args.preset].device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    try:
        if args.rank_order == "topology":
            import robust_plugins.megatron as rpm

            tp = args.tp if args.tp is not None else PRESETS[args.preset].tp
            args.rank_order_info = rpm.apply_rank_order(tp=tp, topology_file=args.topology_file,
                                                        timeout=datetime.timedelta(seconds=600))
        result = run(args)
        if dist.get_rank() == 0:
            line = json.dumps({k: v for k, v in result.items() if k not in ("losses", "global_losses", "param_sums")} |
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

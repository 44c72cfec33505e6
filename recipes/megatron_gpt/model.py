"""Presets and the build of the megatron_gpt recipe: parallel state, GPT model chunks, DDP, optimizer.

What :func:`build` assembles is what Megatron-LM's ``pretrain`` assembles for a GPT: megatron-core's
``initialize_model_parallel`` (TP x PP x DP, optionally virtual pipeline stages), one ``GPTModel``
per virtual stage with the local layer spec, ``Float16Module`` around each for bf16, megatron's
``DistributedDataParallel`` per chunk (bucketing on the first chunk only), and
``get_megatron_optimizer`` (``DistributedOptimizer`` when asked, else ``Float16OptimizerWith
Float16Params`` / ``FP32Optimizer``, inside megatron's ``ChainedOptimizer``). On CPU presets the
shim (``patches/megatron_cpu.py``) lets that code run unchanged over gloo.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from robust_plugins.errors import ConfigError


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
    """``cpu`` (gloo, CPU shim) or ``cuda`` (NCCL)."""
    lr: float = 1e-3
    bucket_size: int | None = None
    """megatron DDP bucket size in elements (None: megatron's default, 40M, one bucket on small models)."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); None: plain 1F1B."""
    bf16: bool = False
    """bf16 parameters (``Float16Module``) with fp32 main parameters in megatron's optimizer."""
    micro_batches: int = 1
    """Micro-batches per rank and step when ``--global-batch`` is not given."""
    clip_grad: float = 1.0
    """megatron's ``OptimizerConfig.clip_grad`` (Megatron-LM's default)."""
    tie_embeddings: bool = False
    """Share the input embedding and output layer weights (Megatron-LM's GPT default); with PP the
    first and last stages keep copies that megatron all-reduces over its embedding group."""
    ranks: int = 2
    """Ranks the preset is laid out for (``robust recipe compare``'s default ``--nproc``)."""
    experts: int | None = None
    """Mixture of experts: experts per MoE layer (every layer's MLP); None: a dense GPT."""
    ep: int = 1
    """Expert-parallel size (experts are split over ``ep`` ranks of each data-parallel group)."""
    topk: int = 2
    """Experts each token is routed to."""
    dispatcher: str = "alltoall"
    """megatron's ``moe_token_dispatcher_type``: ``alltoall`` or ``allgather``."""


PRESETS: dict[str, Preset] = {
    # 0.14M parameters: 200 steps on 2 CPU ranks train in ~10 s; bucket_size splits it into
    # several buckets so that per-bucket keys, overlap and bucket groups are exercised.
    "cpu-tiny": Preset(num_layers=2, hidden_size=64, num_attention_heads=2, seq_len=64, micro_batch=4,
                       tp=1, device="cpu", lr=1e-3, bucket_size=40_000),
    # 3D on 4 CPU ranks: PP 2 x DP 2, bf16, megatron's DistributedOptimizer; 4 micro-batches a step
    # keep both stages busy in 1F1B. 4 layers also split into 2 x 2 virtual stages (--vpp 2).
    "cpu-3d": Preset(num_layers=4, hidden_size=64, num_attention_heads=2, seq_len=64, micro_batch=2,
                     tp=1, pp=2, bf16=True, micro_batches=4, device="cpu", lr=1e-3, bucket_size=40_000, ranks=4,
                     tie_embeddings=True),
    # Mixture of experts on 4 CPU ranks: 4 experts top-2, EP 2 x expert-DP 2 (dense DP 4), bf16,
    # megatron's distributed optimizer; dense and expert bucket groups reduce over different groups.
    "cpu-moe": Preset(num_layers=2, hidden_size=64, num_attention_heads=2, seq_len=64, micro_batch=4,
                      tp=1, bf16=True, device="cpu", lr=1e-3, bucket_size=40_000, ranks=4, experts=4, ep=2,
                      topk=2),
    # cpu-3d's shape on GPUs (NCCL): PP 2 x DP (GPUs / 2); what benchmarks/gpu_check_multi.py runs
    # under robust run with faults. Untested here (no GPU).
    "gpu-3d-tiny": Preset(num_layers=4, hidden_size=64, num_attention_heads=2, seq_len=64, micro_batch=2,
                          tp=1, pp=2, bf16=True, micro_batches=4, device="cuda", lr=1e-3, bucket_size=40_000,
                          ranks=4, tie_embeddings=True),
    # GPT-2 small shape (byte vocabulary); TP 1, DP over every GPU. Untested here (no GPU).
    "gpu-125m": Preset(num_layers=12, hidden_size=768, num_attention_heads=12, seq_len=1024, micro_batch=8,
                       tp=1, device="cuda", lr=6e-4, bf16=True, ranks=8,
                       tie_embeddings=True),
    # GPT-3 XL shape (1.3B; 24 layers, 2048 hidden, 16 heads): TP 2 inside a node, PP 2, DP across.
    # Untested here.
    "gpu-1.3b": Preset(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_len=2048, micro_batch=4,
                       tp=2, pp=2, micro_batches=8, device="cuda", lr=2e-4, bf16=True, ranks=8,
                       tie_embeddings=True),
    # An 8B shape (32 layers, 4096 hidden, 32 heads) on one 8-GPU node: TP 4 x PP 2. Untested here.
    "gpu-8b": Preset(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_len=4096, micro_batch=1,
                     tp=4, pp=2, micro_batches=16, device="cuda", lr=1.5e-4, bf16=True, ranks=8,
                     tie_embeddings=True),
}

#: megatron token dispatchers the recipe (and robust_plugins' CPU shim) runs; ``flex`` needs DeepEP (CUDA).
DISPATCHERS = ("alltoall", "allgather")

#: ``--optimizer`` choices: megatron-core's own (default), a torch AdamW stepped on ``main_grad``,
#: or :class:`~robust_plugins.recipes.megatron_gpt.sharded_adamw.ShardedAdamW`.
OPTIMIZERS = ("megatron", "torch-adamw", "sharded-adamw")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout of a build (what the loop and the result need)."""

    tp: int
    pp: int
    vpp: int | None
    dp: int
    dp_rank: int
    pp_rank: int
    bf16: bool
    distopt: bool
    optimizer: str
    fp16: bool = False
    experts: int | None = None
    ep: int = 1

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (the result JSON)."""
        return dataclasses.asdict(self)


def _model_chunks(preset: Preset, config, vpp: int | None) -> list[torch.nn.Module]:
    """One ``GPTModel`` per virtual pipeline stage of this rank (``Float16Module`` for bf16); with
    ``config.num_moe_experts`` every layer's MLP is a MoE layer (local spec, no grouped GEMM)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module

    chunks = []
    for vp in range(vpp or 1):
        stage = vp if vpp else None
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False),
                         vocab_size=256,
                         max_sequence_length=preset.seq_len,
                         share_embeddings_and_output_weights=preset.tie_embeddings,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                         vp_stage=stage)
        if preset.device == "cuda":
            model.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        chunks.append(model)
    return chunks


def _optimizer(kind: str, preset: Preset, config, chunks: list, distopt: bool, bf16: bool, fp16: bool,
               overrides: dict | None):
    from megatron.core import parallel_state as ps

    if kind == "megatron":
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        return get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=preset.lr, weight_decay=0.0, bf16=bf16, fp16=fp16,
                            use_distributed_optimizer=distopt, clip_grad=preset.clip_grad, **(overrides or {})),
            chunks)
    if len(chunks) > 1:
        raise ConfigError(f"--optimizer {kind} steps one model chunk; --vpp needs --optimizer megatron.")
    if kind == "sharded-adamw":
        from robust_plugins.recipes.megatron_gpt.sharded_adamw import ShardedAdamW

        return ShardedAdamW(chunks[0], preset.lr, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    return torch.optim.AdamW(chunks[0].parameters(), lr=preset.lr, weight_decay=0.0)


def _check_layout(preset: Preset, tp: int, pp: int, vpp: int | None, bf16: bool, fp16: bool, optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {optimizer!r}: allowed {', '.join(OPTIMIZERS)}.")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ConfigError(f"tp {tp} x pp {pp} does not divide the world size {world}.")
    if vpp is not None and (pp < 2 or vpp < 2 or preset.num_layers % (pp * vpp)):
        raise ConfigError(f"--vpp {vpp}: needs pp >= 2, vpp >= 2 and num_layers ({preset.num_layers}) divisible "
                          f"by pp x vpp ({pp} x {vpp}).")
    if bf16 and fp16:
        raise ConfigError("bf16 and fp16 exclude each other; choose one.")
    if (bf16 or fp16) and optimizer != "megatron":
        raise ConfigError(f"--bf16 / fp16 keep fp32 main parameters in megatron's optimizer; --optimizer {optimizer} "
                          f"would step the 16-bit parameters themselves. Use --optimizer megatron.")


def _check_moe(experts: int | None, ep: int, topk: int, dispatcher: str, tp: int, pp: int) -> None:
    if experts is None:
        if ep != 1:
            raise ConfigError(f"--ep {ep} needs --experts (expert parallelism splits the experts of a MoE model).")
        return
    world = dist.get_world_size()
    if experts < 1 or ep < 1 or experts % ep:
        raise ConfigError(f"--experts {experts} must be a positive multiple of --ep {ep}.")
    if not 1 <= topk <= experts:
        raise ConfigError(f"--topk {topk}: allowed 1 .. --experts ({experts}).")
    if dispatcher not in DISPATCHERS:
        raise ConfigError(f"--dispatcher {dispatcher!r}: allowed {', '.join(DISPATCHERS)}.")
    if (world // (tp * pp)) % ep:
        raise ConfigError(f"--ep {ep} must divide the data-parallel size {world // (tp * pp)} "
                          f"(world {world} / tp {tp} / pp {pp}).")


def _check_optimizer(optimizer: str, distopt: bool) -> None:
    if optimizer == "sharded-adamw" and not distopt:
        raise ConfigError("--optimizer sharded-adamw steps the distributed optimizer's shards; it needs "
                          "--distributed-optimizer.")
    if optimizer == "torch-adamw" and distopt:
        raise ConfigError("--optimizer torch-adamw steps whole parameters on all-reduced gradients; with "
                          "--distributed-optimizer only this rank's shard is reduced. Use --optimizer megatron "
                          "or sharded-adamw with it.")


def _transformer_config(preset: Preset, tp: int, pp: int, vpp: int | None, bf16: bool, fp16: bool,
                        moe: dict | None = None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    return TransformerConfig(
        num_layers=preset.num_layers, hidden_size=preset.hidden_size,
        num_attention_heads=preset.num_attention_heads, use_cpu_initialization=preset.device == "cpu",
        hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16, fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # Megatron-LM's choice with virtual stages (--overlap-p2p-communication, on by default):
        # separate isend/irecv, not one batch_isend_irecv. On gloo a batch holding two sends to
        # the same peer (interleaved, pp = 2) is matched in posting order: silently wrong.
        overlap_p2p_comm=vpp is not None, batch_p2p_comm=vpp is None,
        **(moe or {}),
    )


def build(preset: Preset, *, tp: int, seed: int, codec: str | None, overlap: bool, distopt: bool | None,
          bucket_size: int | None = None, block: dict | None = None, pp: int | None = None,
          vpp: int | None = None, bf16: bool | None = None, optimizer: str = "megatron", fp16: bool = False,
          grad_reduce_in_fp32: bool = True, optimizer_config: dict | None = None, experts: int | None = None,
          ep: int | None = None, topk: int | None = None, dispatcher: str | None = None) -> dict[str, Any]:
    """Initialize megatron's parallel state and build model chunks, DDP, optimizer and plugin.

    Expects an initialized default process group. ``pp``, ``vpp`` and ``bf16`` default to the
    preset's; ``distopt`` None means megatron's distributed optimizer exactly when the
    data-parallel size is above 1 (as Megatron-LM users run it). ``optimizer`` is one of
    :data:`OPTIMIZERS`. ``fp16`` builds fp16 parameters with megatron's dynamic loss scaler
    (``optimizer_config`` overrides ``OptimizerConfig`` fields, e.g. ``initial_loss_scale``);
    ``grad_reduce_in_fp32=False`` keeps 16-bit gradient buffers (Megatron-LM's default without
    ``--accumulate-allreduce-grads-in-fp32``). Returns a dict with ``model`` (the DDP chunks), ``ddp`` (the first chunk),
    ``optimizer``, ``plugins`` (one per chunk; None without a block), ``plugin`` (the first),
    ``config`` and ``layout`` (:class:`Layout`). ``experts``, ``ep``, ``topk`` and ``dispatcher``
    (default: the preset's) make every layer's MLP a mixture of experts over ``ep`` expert-parallel
    ranks (megatron's expert-data-parallel group is then ``dp / ep`` ranks).
    """
    if preset.device == "cpu":
        from robust_plugins.patches import megatron_cpu

        megatron_cpu.install()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import robust_plugins.megatron as rpm

    pp = preset.pp if pp is None else pp
    vpp = preset.vpp if vpp is None else vpp
    bf16 = preset.bf16 if bf16 is None else bf16
    experts = preset.experts if experts is None else experts
    ep = (preset.ep if experts == preset.experts else 1) if ep is None else ep
    topk = preset.topk if topk is None else topk
    dispatcher = preset.dispatcher if dispatcher is None else dispatcher
    _check_layout(preset, tp, pp, vpp, bf16, fp16, optimizer)
    _check_moe(experts, ep, topk, dispatcher, tp, pp)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1 if experts else None)
    # Expert MLPs are not tensor-parallel (megatron allows biases, which the local spec has, only then).
    moe = None if experts is None else dict(
        num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    dp = ps.get_data_parallel_world_size()
    if distopt is None:
        distopt = dp > 1 and optimizer != "torch-adamw"
    _check_optimizer(optimizer, distopt)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = _transformer_config(preset, tp, pp, vpp, bf16, fp16, moe)
    chunks = _model_chunks(preset, config, vpp)
    size = bucket_size if bucket_size is not None else preset.bucket_size
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, use_distributed_optimizer=distopt, grad_reduce_in_fp32=grad_reduce_in_fp32,
        **({"bucket_size": size} if size is not None else {}),
    )
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    if block is None and codec is not None:
        block = {"compression": {"codec": codec}}
    plugins = [rpm.enable(m, block) for m in model] if block is not None else None
    opt = _optimizer(optimizer, preset, config, model, distopt, bf16, fp16, optimizer_config)
    # What Megatron-LM's training loop sets on the config before its first step.
    config.finalize_model_grads_func = finalize_model_grads
    if optimizer == "megatron":
        config.grad_scale_func = opt.scale_loss
    if overlap:
        config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    layout = Layout(tp=tp, pp=pp, vpp=vpp, dp=dp, dp_rank=ps.get_data_parallel_rank(),
                    pp_rank=ps.get_pipeline_model_parallel_rank(), bf16=bf16, distopt=distopt, optimizer=optimizer,
                    fp16=fp16, experts=experts, ep=ep)
    return {"model": model, "ddp": model[0], "optimizer": opt, "plugins": plugins,
            "plugin": plugins[0] if plugins else None, "config": config, "layout": layout}

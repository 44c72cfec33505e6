"""DeepSpeed's gradient scaling options and its overflow check, through the plugin (2 CPU ranks).

Run as ``torchrun --nproc-per-node 2 ds_scaling_worker.py --out DIR``; rank 0 writes
``DIR/results.json`` for ``test_deepspeed_scaling.py``:

* ``scaling``: per ZeRO stage (0, and 1 with ``reduce_scatter: false``, the path where ZeRO applies
  these options) and scaling setting (``prescale_gradients`` true, i.e. ``postscale_gradients()``
  false; ``gradient_predivide_factor`` 4 with post-scaling), the averaged gradient of one step read
  as the update of SGD(lr=1), for plain DeepSpeed, codec ``none`` and int8;
* ``overflow``: a NaN put into one gradient element on rank 1 at step ``NAN_STEP``, plain
  DeepSpeed and int8: DeepSpeed's skipped-step counter, the weights of every rank before and
  after that step, the losses of the steps after it, and the plugin's residuals.
"""

from __future__ import annotations

import argparse
import json
import os

import robust_plugins  # noqa: F401,I001  (must precede deepspeed.initialize: installs the patch)

import deepspeed
import torch
import torch.distributed as dist

from ds_worker import INT8_BLOCK, SEED, all_digests, ds_config, train
from robust_plugins.patches import deepspeed as ds_patch
from robust_plugins.workloads.gpt import build_gpt
from robust_plugins.workloads.text import load_corpus
from _exit import leave_without_teardown

NAN_STEP = 2
NAN_STEPS = 5
# DeepSpeed config keys of each scaling setting (top level of the config)
SCALING = {"prescale": {"prescale_gradients": True},
           "predivide4": {"gradient_predivide_factor": 4.0}}


def engine_for(stage, block, extra, sgd, bf16=False):
    """An engine on the tiny GPT; ``block`` None: plain DeepSpeed (the patch undone for it). With
    ``sgd`` (the one-step reads) DeepSpeed's default clipping to norm 1.0 is off: it would hide
    any error of scale."""
    model = build_gpt("tiny", seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=1.0) if sgd else torch.optim.AdamW(model.parameters(), lr=3e-3)
    # ZeRO 1/2 apply the scaling options only on their full all-reduce path
    # (gradient_reduction_w_predivide, reduce_scatter off); average_tensor divides by the world size.
    zero_extra = {"reduce_scatter": False} if stage else None
    cfg = {**ds_config(stage, block, bf16=bf16, zero_extra=zero_extra), **({"gradient_clipping": 0.0} if sgd else {}),
           **extra}
    if block is None:
        ds_patch.undo()
        try:
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        finally:
            ds_patch.install()
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def flat_params(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().clone() for p in engine.module.parameters()])


def one_step_gradient(stage, block, extra, corpus) -> torch.Tensor:
    """The averaged gradient of one step: the update of SGD(lr=1)."""
    engine = engine_for(stage, block, extra, sgd=True)
    before = flat_params(engine)
    train(engine, 1, corpus)
    return before - flat_params(engine)


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor in nested dicts and lists (the plugin's residuals)."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [t for v in obj for t in tensors_in(v)] if isinstance(obj, (list, tuple)) else []


def nan_run(stage, block, extra, bf16, corpus) -> dict:
    """Train ``NAN_STEPS`` steps; at step ``NAN_STEP`` rank 1's first gradient element is NaN."""
    engine = engine_for(stage, block, extra, sgd=False, bf16=bf16)
    first = next(engine.module.parameters())

    def poison(grad):
        if engine.global_steps == NAN_STEP and dist.get_rank() == 1:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
        return grad

    first.register_hook(poison)
    out = {}
    losses, _ = train(engine, NAN_STEP, corpus)
    out["digests_before"] = all_digests(engine)
    plugin = getattr(engine, "robust_plugins", None)
    compressed_before = plugin.sync.stats.compressed_elements if plugin is not None else 0
    losses += train(engine, NAN_STEP + 1, corpus)[0]
    out["digests_after"] = all_digests(engine)
    out["skipped_steps"] = engine.skipped_steps
    out["finite_params"] = bool(torch.isfinite(flat_params(engine)).all())
    if plugin is not None:
        out["compressed_in_nan_step"] = plugin.sync.stats.compressed_elements - compressed_before
        residuals = tensors_in(plugin.state_dict())
        out["residuals_finite"] = all(bool(torch.isfinite(r).all()) for r in residuals)
        out["n_residuals"] = len(residuals)
    losses += train(engine, NAN_STEPS, corpus)[0]
    out["losses"] = losses
    out["n_params"] = sum(p.numel() for p in engine.module.parameters())
    out["final_finite"] = bool(torch.isfinite(flat_params(engine)).all())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.use_deterministic_algorithms(True)
    corpus = load_corpus()
    results: dict = {"scaling": {}, "overflow": {}}
    for stage in (0, 1):
        for name, extra in SCALING.items():
            exact = one_step_gradient(stage, None, extra, corpus)
            none = one_step_gradient(stage, {"compression": {"codec": "none"}}, extra, corpus)
            got = one_step_gradient(stage, INT8_BLOCK, extra, corpus)
            results["scaling"][f"zero{stage}_{name}"] = {
                "none_bitwise": torch.equal(none, exact),
                "norm_ratio": (got.norm() / exact.norm()).item(),
                "rel_error": ((got - exact).norm() / exact.norm()).item()}
    # The overflow check: ZeRO 0 bf16 (FP16_UnfusedOptimizer checks every step) and ZeRO 1 fp32
    # with clipping (the gradient norm is computed, an invalid one skips the step).
    for name, stage, extra, bf16 in (("zero0_bf16", 0, {}, True), ("zero1_clip", 1, {"gradient_clipping": 1.0}, False)):
        results["overflow"][name] = {"vanilla": nan_run(stage, None, extra, bf16, corpus),
                                     "int8": nan_run(stage, INT8_BLOCK, extra, bf16, corpus)}
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()  # the results are written; see _exit.py

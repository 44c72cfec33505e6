"""Several HF Trainer runs in one 2-rank launch (DeepSpeed's and transformers' imports dominate).

``--stage S``: vanilla (the DeepSpeed patch undone), the plugin imported with no block, codec
``none``, codec ``int8`` with telemetry (the wire's bytes), ``int8_wandb`` (5 steps with
``report_to="wandb"`` and ``telemetry.wandb``, offline), then ZeRO-3 with ``codec: sign`` (must be
refused). Each run is ``recipes/hf_trainer/train.py``'s ``train``; rank 0 writes
``<out>/results.json``.
"""

import robust_plugins  # noqa: F401,I001  (first: the import hooks)

import argparse
import copy
import json
import os
from pathlib import Path

import torch.distributed as dist

from robust_plugins.patches import deepspeed as ds_patch
from robust_plugins.recipes.hf_trainer.train import train

RECIPE = Path(robust_plugins.recipes.hf_trainer.__file__).parent

#: 192 windows of 4 a micro-batch on 2 ranks, 2 micro-batches a step: 12 steps an epoch, so 60
#: steps cross 4 epoch ends (the sampler reshuffles) and every step ends an accumulation window.
WINDOWS = 192
GRAD_ACCUM = 2
WANDB_STEPS = 5


def _config(stage: int, block: dict | None) -> dict:
    cfg = json.loads((RECIPE / "baseline.json").read_text())
    cfg["zero_optimization"]["stage"] = stage
    if block is not None:
        cfg["robust_plugins"] = block
    return cfg


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", default="vanilla,no_block,codec_none,int8")
    p.add_argument("--zero3", action="store_true", help="also check that ZeRO-3 with the block is refused")
    a = p.parse_args()
    out = Path(a.out)
    int8 = json.loads((RECIPE / "plugin.json").read_text())["robust_plugins"]
    int8 = {**int8, "telemetry": {"dir": str(out / "telemetry"), "log_every": 1}}
    wandb_block = {**int8, "telemetry": {"dir": str(out / "int8_wandb" / "telemetry"), "log_every": 1,
                                         "wandb": {"mode": "offline", "project": "robust_plugins"}}}
    runs = {"vanilla": None, "no_block": None, "codec_none": {"compression": {"codec": "none"}}, "int8": int8,
            "int8_wandb": wandb_block}
    results = {}
    for name in a.runs.split(","):
        block = runs[name]
        if name == "vanilla":
            ds_patch.undo()
        else:
            ds_patch.install()
        report_to, steps = "none", a.steps
        if name == "int8_wandb":  # the Trainer's own W&B run beside the plugin's (offline)
            os.environ["WANDB_DIR"] = str(out / "int8_wandb" / "trainer")
            os.makedirs(os.environ["WANDB_DIR"], exist_ok=True)
            report_to, steps = "wandb", WANDB_STEPS
        r = train(out / name, copy.deepcopy(_config(a.stage, block)), steps=steps, grad_accum=GRAD_ACCUM,
                  windows=WINDOWS, report_to=report_to, run_name="hf-wandb" if name == "int8_wandb" else None)
        dist.barrier()  # every rank's digest file is written
        results[name] = {"log_history": r["log_history"], "losses": [h["loss"] for h in r["log_history"] if "loss" in h],
                         "digest": r["digest"], "plugin": r["plugin"], "global_step": r["global_step"],
                         "zero_stage": r["zero_stage"], "n_params": r["n_params"],
                         "digests": sorted(p.read_text().strip() for p in (out / name).glob("digest.rank*"))}
    if a.zero3:
        try:
            # ZeRO-3's reduce-scatter takes none, int8, int4, auto; sign stays refused there (codec auto cannot
            # be tried under the HF Trainer: Accelerate takes every "auto" in the config for its own).
            train(out / "zero3", _config(3, {"compression": {"codec": "sign"}}), steps=2)
            results["zero3"] = {"error": None}
        except robust_plugins.RobustPluginsError as exc:
            results["zero3"] = {"error": f"{type(exc).__name__}: {exc}"}
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

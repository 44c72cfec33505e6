"""An ordinary Hugging Face Trainer script with DeepSpeed; ``import robust_plugins`` is its only addition.

Run under torchrun (or ``robust run``, which restarts it after a fault and resumes the Trainer
exactly where the plugin's restore point left it)::

    torchrun --nproc-per-node 2 -m robust_plugins.recipes.hf_trainer.train \\
        --ds-config recipes/hf_trainer/plugin.json --steps 60 --out runs/hf/plugin

The model is GPT-2 shaped and built from a ``GPT2Config`` (nothing is downloaded) with
``AutoModelForCausalLM.from_config`` after the ``TrainingArguments``: with a ZeRO-3 config
(``zero3.json``) that is where HF's DeepSpeed integration builds it under ``deepspeed.zero.Init``
and initialises its weights as without ZeRO-3 (a plain ``GPT2LMHeadModel(cfg)`` there would be
partitioned by ``deepspeed.initialize`` instead, which also works). The data are
fixed windows of the byte-level stdlib corpus (``robust_plugins.workloads.text``), so the
vocabulary is 256 bytes. ``--preset cpu-tiny`` trains on CPU ranks over gloo; ``--preset gpu`` is a
GPT-2 small on one GPU a rank (bf16). Rank 0 writes ``<out>/result.json``: the Trainer's
``log_history``, its final ``global_step`` and ``epoch``, the digest of the final weights, the
DeepSpeed config the engine ran with; every rank writes ``<out>/digest.rank<R>``.
"""

# robust_plugins first: its import hook patches deepspeed.initialize and the Trainer as they are
# imported, so the DeepSpeed config's "robust_plugins" block is honoured instead of ignored.
import robust_plugins  # noqa: F401,I001  (order matters)

import argparse
import contextlib
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, \
    default_data_collator
from transformers.integrations import is_deepspeed_zero3_enabled

from robust_plugins import watchdog
from robust_plugins.workloads import load_corpus

#: Model and batch per preset. cpu-tiny: 0.1 M parameters, a step takes ~10 ms on 2 CPU ranks.
PRESETS = {
    "cpu-tiny": {"n_embd": 32, "n_layer": 2, "n_head": 2, "seq_len": 32, "micro_batch": 4, "use_cpu": True,
                 "windows": 2048},
    "gpu": {"n_embd": 768, "n_layer": 12, "n_head": 12, "seq_len": 1024, "micro_batch": 8, "use_cpu": False,
            "windows": 200_000},
}


class ByteWindows(torch.utils.data.Dataset):
    """``n`` fixed windows of the corpus (window ``i`` starts at a seeded position): a map-style
    dataset, so the Trainer's sampler shuffles it per epoch and its resume can skip batches."""

    def __init__(self, n: int, seq_len: int, seed: int = 1234) -> None:
        self.data = load_corpus().train
        self.seq_len = seq_len
        rng = np.random.Generator(np.random.PCG64(seed))
        self.starts = rng.integers(0, len(self.data) - seq_len - 1, size=n)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        window = torch.from_numpy(self.data[self.starts[i]: self.starts[i] + self.seq_len].astype(np.int64))
        return {"input_ids": window, "labels": window.clone()}


def build_model(preset: dict, seed: int) -> GPT2LMHeadModel:
    """A GPT-2-shaped model from a config, initialised from ``seed`` (same weights on every rank).

    Built the way HF builds models, so that after ``TrainingArguments`` with a ZeRO-3 config it is
    created under ``deepspeed.zero.Init`` by HF's integration (module docstring)."""
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=preset["seq_len"], n_embd=preset["n_embd"],
                     n_layer=preset["n_layer"], n_head=preset["n_head"])
    return AutoModelForCausalLM.from_config(cfg)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in ``named_parameters`` order. ZeRO 1/2 keep full
    parameters on every rank; ZeRO-3's are gathered for it (a collective: every rank calls it)."""
    params = list(model.named_parameters())
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for _, p in params):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([p for _, p in params])
    h = hashlib.sha256()
    with gathered:
        for name, p in params:
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def training_args(out: Path, ds_config, *, steps: int, preset: dict, seed: int, grad_accum: int = 1,
                  report_to: str = "none", run_name: str | None = None) -> TrainingArguments:
    """The Trainer's arguments: DeepSpeed config (dict or file), logging every step, no saves."""
    return TrainingArguments(
        output_dir=str(out), deepspeed=ds_config, max_steps=steps, per_device_train_batch_size=preset["micro_batch"],
        gradient_accumulation_steps=grad_accum, learning_rate=1e-3, warmup_steps=5, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="no", report_to=report_to, run_name=run_name, seed=seed,
        data_seed=seed, use_cpu=preset["use_cpu"], bf16=not preset["use_cpu"], dataloader_num_workers=0,
        disable_tqdm=True,
    )


def train(out: Path, ds_config, *, steps: int, preset_name: str = "cpu-tiny", seed: int = 0, grad_accum: int = 1,
          report_to: str = "none", run_name: str | None = None, windows: int | None = None) -> dict:
    """Train once; returns (and on rank 0 writes) the result described in the module docstring."""
    preset = PRESETS[preset_name]
    out.mkdir(parents=True, exist_ok=True)
    args = training_args(out, ds_config, steps=steps, preset=preset, seed=seed, grad_accum=grad_accum,
                         report_to=report_to, run_name=run_name)
    if is_deepspeed_zero3_enabled():
        # zero.Init, which HF's integration runs inside build_model, reads the world size from
        # DeepSpeed's comm backend; on CPU (use_cpu) nothing has set that up by now and it would
        # partition for 1 rank ("train_batch_size ... 16 != 4 * 2 * 1"). args.device sets up the
        # torch process group, which init_distributed then adopts.
        import deepspeed

        _ = args.device
        deepspeed.init_distributed(dist_backend="gloo" if preset["use_cpu"] else "nccl",
                                   timeout=watchdog.pg_timeout(600))  # above robust run's hang timeouts
    model = build_model(preset, seed)
    data = ByteWindows(windows or preset["windows"], preset["seq_len"])
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    digest = weights_digest(trainer.model)
    (out / f"digest.rank{rank}").write_text(digest + "\n")
    engine = trainer.model_wrapped
    result = {
        "log_history": trainer.state.log_history, "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch, "digest": digest,
        "n_params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        "plugin": getattr(engine, "robust_plugins", None) is not None,
        "zero_stage": engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None,
    }
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ds-config", required=True,
                   help="DeepSpeed config JSON (baseline.json, plugin.json, or zero3.json for ZeRO-3)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--report-to", default="none", help="the Trainer's report_to (e.g. wandb)")
    p.add_argument("--windows", type=int, default=None, help="dataset size in windows (default: the preset's)")
    p.add_argument("--out", required=True, help="output directory (result.json, digests)")
    a = p.parse_args(argv)
    train(Path(a.out), a.ds_config, steps=a.steps, preset_name=a.preset, seed=a.seed, grad_accum=a.grad_accum,
          report_to=a.report_to, windows=a.windows)


if __name__ == "__main__":
    main()

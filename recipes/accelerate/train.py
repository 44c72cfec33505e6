"""An ordinary Accelerate training loop with DeepSpeed; ``import robust_plugins`` and the resume line are its additions.

Launch it with Accelerate (the DeepSpeed config file named in the yaml holds the block)::

    accelerate launch --config_file recipes/accelerate/accelerate_config.yaml \\
        recipes/accelerate/train.py --steps 60 --out runs/acc/plugin

or with ``robust run``, which restarts it after a fault (then the script names the DeepSpeed config
itself; ``Accelerator()`` reads the rank, world size and rendezvous that torch elastic set)::

    robust run --standalone --nproc-per-node 2 -m robust_plugins.recipes.accelerate.train \\
        --ds-config ds.json --steps 60 --out runs/acc/robust

The resume contract for Accelerate loops: under ``robust run`` with a ``checkpoint`` sub-block the
engine restores the newest restore point inside ``deepspeed.initialize``, i.e. inside
``accelerator.prepare``; the loop then starts at ``model.global_steps`` (0 on a cold start), puts the
loader at that step's epoch (``loader.set_epoch``) and skips the batches already trained in it
(``accelerator.skip_first_batches``). Model, optimizer, the engine's LR scheduler (the DeepSpeed
file's ``scheduler`` section), DeepSpeed's counters and the RNG states come back with the engine;
the data order must follow from the step alone (here a permutation seeded by seed and epoch).

The model is GPT-2 shaped, built from a ``GPT2Config`` (nothing downloaded), dropout off (a
resumed loader's first iterator draws from the global RNG: docs/hf_trainer.md); the data
are ``recipes/hf_trainer``'s byte windows. Rank 0 writes ``<out>/result.json`` (final step, the step
this incarnation started at, its losses and learning rates, the weights' digest); every rank writes
``<out>/digest.rank<R>``, and rank 0 appends one line a step to ``<out>/steps.jsonl``.
"""

# robust_plugins first: its import hook patches deepspeed.initialize as DeepSpeed is imported, so
# the DeepSpeed config's "robust_plugins" block is honoured instead of ignored.
import robust_plugins  # noqa: F401,I001  (order matters)

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator

from robust_plugins.recipes.hf_trainer.train import ByteWindows, weights_digest

#: cpu-tiny: 0.1 M parameters, 2 CPU ranks over gloo. The micro-batch is the DeepSpeed file's
#: train_micro_batch_size_per_gpu (4 in baseline.json / plugin.json).
PRESET = {"n_embd": 32, "n_layer": 2, "n_head": 2, "seq_len": 32, "micro_batch": 4}


class EpochPermutation(torch.utils.data.Sampler):
    """A permutation of the dataset seeded by ``(seed, epoch)``: the order follows from the epoch
    alone and draws nothing from the global RNG, so a resumed loop sees the fault-free run's batches."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(np.random.Generator(np.random.PCG64([self.seed, self.epoch])).permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


def make_accelerator(ds_config: str | None) -> Accelerator:
    """``Accelerator()`` with DeepSpeed, on GPUs or on CPU ranks.

    On a machine without GPUs, Accelerate 1.15's ``PartialState`` finds no backend unless told
    ``cpu=True`` and then counts 1 process while DeepSpeed's process group has all ranks (its
    dataloader is not sharded); with ``cpu=True`` passed to ``Accelerator`` itself it drops DeepSpeed
    for DDP. A ``PartialState(cpu=True)`` made first sets up gloo over every rank, and the
    ``Accelerator`` made after it still selects DeepSpeed (docs/hf_trainer.md, "Accelerate").
    """
    if not torch.cuda.is_available():
        PartialState(cpu=True)
    # Under `accelerate launch` the plugin comes from the yaml (ACCELERATE_DEEPSPEED_CONFIG_FILE).
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config) if ds_config else None
    return Accelerator(deepspeed_plugin=plugin)


def train(out: Path, ds_config: str | None, *, steps: int, seed: int = 0, windows: int = 192) -> dict:
    """Train ``steps`` optimizer steps (resuming where the engine's restore point left off)."""
    out.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator(ds_config)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=PRESET["seq_len"], n_embd=PRESET["n_embd"],
                     n_layer=PRESET["n_layer"], n_head=PRESET["n_head"], resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    # The LR schedule is the DeepSpeed file's `scheduler` section (WarmupDecayLR over 60 steps): the
    # engine steps it and its snapshots hold it. A torch scheduler handed to prepare instead stays
    # Accelerate's (an AcceleratedScheduler, stepped num_processes times a step), outside the engine.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = ByteWindows(windows, PRESET["seq_len"])
    sampler = EpochPermutation(len(data), seed)
    loader = torch.utils.data.DataLoader(data, batch_size=PRESET["micro_batch"], sampler=sampler, drop_last=True,
                                         collate_fn=default_data_collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    # The resume contract: the engine restored itself inside prepare (robust run); start there.
    start = model.global_steps
    per_epoch = len(loader)
    rank = accelerator.process_index
    losses, lrs, step = [], [], start
    log = open(out / "steps.jsonl", "a") if rank == 0 else None
    while step < steps:
        epoch, done = divmod(step, per_epoch)
        # Accelerate's set_epoch: the prepared loader sets the sampler's epoch to its own iteration
        # count at every __iter__, a count that starts at 0 in a resumed incarnation, so a bare
        # sampler.set_epoch would be undone there.
        loader.set_epoch(epoch)
        for batch in accelerator.skip_first_batches(loader, done) if done else loader:
            loss = model(**batch).loss
            accelerator.backward(loss)  # DeepSpeed: engine.backward and engine.step (the optimizer step)
            optimizer.step()  # a no-op under DeepSpeed, kept so the loop reads as any Accelerate loop
            optimizer.zero_grad()
            step += 1
            losses.append(loss.item())
            lrs.append(model.get_lr()[0])
            if log is not None:
                log.write(json.dumps({"step": step, "loss": losses[-1], "lr": lrs[-1],
                                      "start": start}) + "\n")
                log.flush()
            if step >= steps:
                break
    digest = weights_digest(model.module)
    (out / f"digest.rank{rank}").write_text(digest + "\n")
    result = {"global_step": model.global_steps, "start_step": start, "losses": losses, "lrs": lrs, "digest": digest,
              "num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
              "plugin": getattr(model, "robust_plugins", None) is not None,
              "zero_stage": model.zero_optimization_stage(), "dp_world_size": model.dp_world_size}
    if rank == 0:
        log.close()
        (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    accelerator.end_training()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ds-config", default=None,
                   help="DeepSpeed config JSON; leave unset under `accelerate launch` (the yaml names it)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--windows", type=int, default=192, help="dataset size in windows (192: 24 steps an epoch)")
    p.add_argument("--out", required=True, help="output directory (result.json, steps.jsonl, digests)")
    a = p.parse_args(argv)
    train(Path(a.out), a.ds_config, steps=a.steps, seed=a.seed, windows=a.windows)


if __name__ == "__main__":
    main()

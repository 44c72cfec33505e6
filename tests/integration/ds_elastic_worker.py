"""Elastic restart: a verified DeepSpeed checkpoint saved at one data-parallel size, resumed at another.

Three launches per ZeRO stage (``test_deepspeed_elastic.py``):

* ``--phase save`` (2 ranks): trains ``STEPS`` steps with micro-batch 2 and gradient accumulation 2
  (global batch 8), saving a verified checkpoint at step ``SAVE_AT`` with a ``client_state``;
  records the global mean loss of every step (the reference) and the weights at the end.
* ``--phase shrink`` (1 rank) and ``--phase grow`` (4 ranks): the *same* DeepSpeed config (micro 2,
  accumulation 2), a model seeded differently; ``load_checkpoint`` must reshard the step-6
  checkpoint and set gradient accumulation to 4 (shrink) or 1 (grow) so that the global batch
  stays 8, and continue to ``STEPS``.

Data: the global batch of step s is fixed by (seed, s) (``workloads.text.get_batch`` with
``dp * gas`` slices); rank r takes slices ``r*gas .. r*gas+gas-1``, so every phase sees the same
samples every step. The reported loss of a step is the sum of the per-slice losses in slice order
(the same additions at every size), divided by the number of slices. Rank 0 writes
``DIR/<phase>.json``; the test asserts on it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import pathlib

import robust_plugins  # noqa: F401  (must precede deepspeed.initialize: installs the patch)

import deepspeed
import torch
import torch.distributed as dist

from robust_plugins.workloads.gpt import build_gpt
from robust_plugins.workloads.text import get_batch, load_corpus
from _exit import leave_without_teardown

SEED = 1234
MICRO_BATCH = 2
GAS = 2
SEQ_LEN = 64
STEPS = 12
SAVE_AT = 6


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def make_engine(stage: int, root: str, seed: int):
    model = build_gpt("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
        "robust_plugins": {"checkpoint": {"dir": root, "keep": 3}},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def weights(engine) -> list[float]:
    return [float(p.detach().double().sum()) for p in engine.module.parameters()]


def digest(engine) -> str:
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(engine, until: int, corpus, save_at: int | None = None) -> list[float]:
    """Global mean loss of every optimizer step (averaged over ranks and micro-batches)."""
    rank, dp = dist.get_rank(), engine.dp_world_size
    losses = []
    while engine.global_steps < until:
        gas = engine.gradient_accumulation_steps()
        slices = torch.zeros(dp * gas, dtype=torch.float64)
        for m in range(gas):
            x, y = get_batch(corpus, "train", seed=SEED, step=engine.global_steps, rank=rank * gas + m,
                             world_size=dp * gas, micro_batch=MICRO_BATCH, seq_len=SEQ_LEN)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            slices[rank * gas + m] = loss.detach().double()
        dist.all_reduce(slices)  # one non-zero entry per slice: exact
        total = 0.0
        for v in slices.tolist():  # the same additions in the same order at every size
            total += v
        losses.append(total / (dp * gas))
        if engine.global_steps == save_at:
            engine.save_checkpoint(None, client_state={"next_step": save_at, "note": "elastic",
                                                       "marker": torch.arange(3) * save_at})
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["save", "shrink", "grow"], required=True)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.use_deterministic_algorithms(True)
    records = Records()
    logging.getLogger("robust_plugins").addHandler(records)
    logging.getLogger("robust_plugins").setLevel(logging.INFO)
    corpus = load_corpus()
    out = pathlib.Path(args.out)
    root = str(out / "ckpt")
    res: dict = {"world": dist.get_world_size()}
    if args.phase == "save":
        eng = make_engine(args.stage, root, SEED)
        res["losses"] = train(eng, STEPS, corpus, save_at=SAVE_AT)
    else:
        eng = make_engine(args.stage, root, SEED + 1)
        res["gas_before"] = eng.gradient_accumulation_steps()
        path, client_state = eng.load_checkpoint(root)
        res["load_path"] = str(path)
        res["resumed_at"] = eng.global_steps
        res["gas_after"] = eng.gradient_accumulation_steps()
        res["train_batch_size"] = eng.train_batch_size()
        res["client_state"] = {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in client_state.items()
                               if k in ("next_step", "note", "marker")}
        res["losses"] = train(eng, STEPS, corpus)
    res["weights"] = weights(eng)
    res["digest"] = digest(eng)
    res["log"] = records.lines
    if dist.get_rank() == 0:
        (out / f"{args.phase}.json").write_text(json.dumps(res))
    dist.barrier()
    # Freed here, not at interpreter exit: a gloo group destroyed during shutdown with its threads
    # still running sometimes aborts the rank after its work is done (exit -6; docs/megatron.md).
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()  # the results are written; see _exit.py

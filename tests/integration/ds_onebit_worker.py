"""1-bit Adam mode (``sign_mode: momentum``) on real DeepSpeed ZeRO 0 engines, one torchrun launch.

Run as ``torchrun --nproc-per-node 2 ds_onebit_worker.py --out DIR``. Rank 0 writes
``DIR/results.json``: vanilla and 1-bit runs (per-step losses, parameter digests of every rank,
bytes each rank sent per step counted by ``WireCounter``), a save after the freeze resumed into a
fresh engine, and the refusals. ``test_deepspeed_onebit.py`` asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid

import robust_plugins  # noqa: F401  (installs the DeepSpeed patch)

import deepspeed
import torch
import torch.distributed as dist

from ds_worker import SEED, all_digests, ds_config, make_engine, train, val_loss
from robust_plugins.comm import WireCounter
from robust_plugins.workloads.text import get_batch, load_corpus
from robust_plugins.workloads.gpt import build_gpt
from _exit import leave_without_teardown

FREEZE = 4
STEPS = 14
ONEBIT = {"compression": {"codec": "sign", "sign_mode": "momentum", "freeze_steps": FREEZE}}


def counted_train(engine, steps, corpus):
    """Train to ``steps``; per step, the bytes this rank sent in backward and in step."""
    losses, sent = [], []
    rank, world = dist.get_rank(), dist.get_world_size()
    while engine.global_steps < steps:
        x, y = get_batch(corpus, "train", seed=SEED, step=engine.global_steps, rank=rank, world_size=world,
                         micro_batch=4, seq_len=64)
        loss = engine(x, y)
        with WireCounter() as wb:
            engine.backward(loss)
        with WireCounter() as ws:
            engine.step()
        losses.append(loss.item())
        sent.append({"backward": wb.bytes_sent, "step": ws.bytes_sent, "calls": dict(wb.calls + ws.calls)})
    return losses, sent


def refusal(stage=0, opt="adamw", bf16=False) -> str:
    model = build_gpt("tiny", seed=SEED)
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1) if opt == "sgd"
                 else torch.optim.Adam(model.parameters(), amsgrad=True) if opt == "amsgrad"
                 else torch.optim.AdamW(model.parameters(), lr=3e-3))
    try:
        deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage, ONEBIT, bf16=bf16))
    except Exception as exc:  # noqa: BLE001 - the test asserts on type and text
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.use_deterministic_algorithms(True)
    corpus = load_corpus()
    results = {"freeze": FREEZE, "steps": STEPS, "world": dist.get_world_size()}

    van = make_engine(0, None, vanilla=True)
    losses, sent = counted_train(van, STEPS, corpus)
    results["vanilla"] = {"losses": losses, "sent": sent, "digests": all_digests(van), "val": val_loss(van, corpus)}
    n_params = sum(p.numel() for p in van.module.parameters())
    results["n_params"] = n_params
    # By hand, not from the code under test (_twophase.plan): the momentum is padded to whole
    # 256-element blocks on every rank and cut into W chunks; a chunk's row is 1 bit an element
    # plus one fp32 scale a block. Rank r sends W-1 rows in the all-to-all and its reduced row to
    # the W-1 others in the all-gather.
    w, block = dist.get_world_size(), 256
    chunk = -(-n_params // (w * block)) * block
    row_bytes = chunk // 8 + 4 * (chunk // block)
    results["expected_onebit_bytes"] = 2 * (w - 1) * row_bytes
    del van

    eng = make_engine(0, ONEBIT)
    losses, sent = counted_train(eng, STEPS, corpus)
    results["onebit"] = {"losses": losses, "sent": sent, "digests": all_digests(eng), "val": val_loss(eng, corpus),
                         "onebit_steps": eng.robust_plugins.onebit.steps_taken}
    del eng

    # Save after the freeze, resume into an engine built from another seed: only the checkpoint
    # (weights, Adam state with the frozen v, residuals, step) can make it match the straight run.
    ckpt = os.path.join(args.out, "ckpt")
    eng = make_engine(0, ONEBIT)
    first, _ = train(eng, FREEZE + 3, corpus, save_at=FREEZE + 3, save_dir=ckpt)
    v_at_save = [eng.optimizer.state[p]["exp_avg_sq"].clone() for p in eng.module.parameters()]
    del eng
    eng = make_engine(0, ONEBIT, seed=SEED + 1)
    eng.load_checkpoint(ckpt)
    resumed_at = eng.global_steps
    second, _ = train(eng, STEPS, corpus)
    v_end = [eng.optimizer.state[p]["exp_avg_sq"] for p in eng.module.parameters()]
    results["resumed"] = {"losses": first + second, "digests": all_digests(eng), "resumed_at": resumed_at,
                          "v_unchanged_after_freeze": all(torch.equal(a, b) for a, b in zip(v_at_save, v_end)),
                          "residual_file": os.path.isfile(os.path.join(ckpt, f"global_step{FREEZE + 3}",
                                                                       "robust_plugins_rank00000.pt"))}
    del eng

    # The same from an in-memory snapshot (checkpoint.memory_every: 1): a fresh engine of another
    # seed restores the newest snapshot, residuals and frozen v included, and must match too.
    from robust_plugins.checkpoint import memory

    job = [uuid.uuid4().hex]
    dist.broadcast_object_list(job, src=0)
    os.environ[memory.ENV_JOB] = job[0]
    with_memory = {**ONEBIT, "checkpoint": {"memory_every": 1}}
    eng = make_engine(0, with_memory)
    first, _ = train(eng, FREEZE + 3, corpus)
    eng.robust_plugins.memory.store.flush()
    del eng
    eng = make_engine(0, with_memory, seed=SEED + 1)
    load_path, _ = eng.load_checkpoint()
    resumed_at = eng.global_steps
    second, _ = train(eng, STEPS, corpus)
    results["memory_resumed"] = {"losses": first + second, "digests": all_digests(eng), "resumed_at": resumed_at,
                                 "load_path": str(load_path)}
    eng.robust_plugins.memory.store.flush()
    del eng

    results["refused"] = {"zero1": refusal(stage=1), "sgd": refusal(opt="sgd"), "amsgrad": refusal(opt="amsgrad"),
                          "bf16": refusal(bf16=True)}
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    # Freed here, not at interpreter exit: a gloo group destroyed during shutdown with its threads
    # still running sometimes aborts the rank after its work is done (exit -6; docs/megatron.md).
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()  # the results are written; see _exit.py

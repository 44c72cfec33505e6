"""One torchrun launch = every in-memory snapshot scenario for one ZeRO stage (2 CPU ranks).

Run as ``torchrun --nproc-per-node 2 ds_memory_worker.py --stage S --out DIR``. Rank 0 writes
``DIR/results.json``; ``test_deepspeed_memory.py`` asserts on it. A "restart" here is a fresh
engine built from a differently seeded model in the same processes: it sees only what the
previous engine left in /dev/shm (and on disk), exactly what a restarted process would see.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import logging
import os
import pathlib
import random
import uuid

import robust_plugins  # noqa: F401  (must precede deepspeed.initialize: installs the patch)

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from robust_plugins.checkpoint import memory, persist
from robust_plugins.workloads.gpt import build_gpt
from robust_plugins.workloads.text import get_batch, load_corpus
from _exit import leave_without_teardown

SEED = 1234
MICRO_BATCH = 4
SEQ_LEN = 64
STEPS = 8


class Records(logging.Handler):
    """Collects robust_plugins log lines of this rank."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def take(self) -> list[str]:
        out, self.lines = self.lines, []
        return out


def make_engine(stage, block, seed=SEED):
    model = build_gpt("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                       "warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
    }
    if block is not None:
        cfg["robust_plugins"] = block
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


class DataPosition:
    """A stand-in for a data loader position the script registers (a tensor and an int)."""

    def __init__(self):
        self.seen = 0
        self.order = torch.zeros(4, dtype=torch.int64)

    def get(self):
        return {"seen": self.seen, "order": self.order}

    def set(self, v):
        self.seen, self.order = v["seen"], v["order"].clone()


def seed_all(seed: int) -> None:
    """Seed torch, numpy and Python's RNG, differently on each rank (a restore must hand every
    rank back its own states)."""
    s = seed + 1000 * dist.get_rank()
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def rng_states() -> tuple:
    """This rank's torch, numpy and Python RNG states, as they are now."""
    return torch.get_rng_state().clone(), np.random.get_state(), random.getstate()


def set_rng_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def rng_digest() -> str:
    """sha256 of this rank's torch, numpy and Python RNG states."""
    t, n, p = rng_states()
    h = hashlib.sha256(t.numpy().tobytes())
    h.update(n[1].tobytes())
    h.update(repr((n[0], n[2:], p)).encode())
    return h.hexdigest()


def train(engine, until, corpus, data=None, rng_log=None) -> list[float]:
    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    while engine.global_steps < until:
        if rng_log is not None:  # the states a snapshot of the previous step must give back
            rng_log[engine.global_steps] = rng_states()
        x, y = get_batch(corpus, "train", seed=SEED, step=engine.global_steps, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=SEQ_LEN)
        # Draws from torch, numpy and Python's RNG every step, scaling the loss (and so the
        # gradients): a resumed run matches the reference only if all three states came back.
        noise = torch.rand(()) + float(np.random.rand()) + random.random()
        loss = engine(x, y) * (1 + 0.05 * noise)
        engine.backward(loss)
        if data is not None:  # the position after this step's batch, as a loader would hold it
            data.seen += 1
            data.order += 1
        engine.step()
        losses.append(loss.item())
    return losses


def digests(engine) -> list[str]:
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    opt_sd = engine.optimizer.state_dict()
    base = opt_sd.get("base_optimizer_state", opt_sd.get("optimizer_state_dict", opt_sd))
    for group in opt_sd.get("fp32_groups", []):  # ZeRO 0's bf16 wrapper: the fp32 master copies
        for t in group:
            h.update(t.detach().float().contiguous().numpy().tobytes())
    for st in base["state"].values():
        for v in st.values():
            if torch.is_tensor(v):
                h.update(v.float().contiguous().numpy().tobytes())
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, h.hexdigest())
    return out


def _digest_of(states: tuple) -> str:
    now = rng_states()
    set_rng_states(states)
    try:
        return rng_digest()
    finally:
        set_rng_states(now)


CLIENT_STATE = {"epoch": 3, "sampler": {"position": torch.arange(4) * 7, "name": "text"}, "history": [1.5, 2]}


def plain(x):
    """Tensors as (dtype, values), for JSON."""
    if torch.is_tensor(x):
        return [str(x.dtype), x.tolist()]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def gather(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    records = Records()
    logging.getLogger("robust_plugins").addHandler(records)
    logging.getLogger("robust_plugins").setLevel(logging.INFO)
    out = pathlib.Path(args.out)
    root = str(out / "ckpt")
    corpus = load_corpus(max_bytes=200_000)
    res: dict = {}
    job = gather(uuid.uuid4().hex)[0]
    os.environ[memory.ENV_JOB] = job
    key = memory.job_key()
    block = {"checkpoint": {"dir": root, "memory_every": 1, "peer_backup": True, "persist_every": 3},
             "compression": {"codec": "int8", "block_size": 256}}

    # Reference: uninterrupted, same block (snapshots every step, disk save at 4).
    ref = make_engine(args.stage, {"compression": block["compression"]})
    seed_all(7)
    ref_rng: dict[int, tuple] = {}
    res["reference"] = {"losses": train(ref, STEPS, corpus, rng_log=ref_rng), "digests": digests(ref)}

    # Main: snapshots every step; the background save of step 3 fails (ENOSPC on rank 1); a
    # foreground DeepSpeed save at step 4; stop at 5 (the "crash").
    os.environ[memory.ENV_JOB] = job
    data = DataPosition()
    eng = make_engine(args.stage, block)
    seed_all(7)
    eng.robust_plugins.memory.register("data", data.get, data.set)
    real_write = persist._write

    def full_disk(slot, path):
        if rank == 1 and slot.header().step == 3:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_write(slot, path)

    persist._write = full_disk
    losses = train(eng, 4, corpus, data)
    eng.robust_plugins.memory.store.flush()
    persist._write = real_write
    res["failed_persist"] = {"log": records.take(), "dirs": sorted(os.listdir(root)) if os.path.isdir(root) else [],
                             "failures": gather(len(eng.robust_plugins.memory.persister.failures))}
    # The save's client_state goes into the snapshots: step 4's snapshot is taken again with it
    # (into another slot, which retires the first); own slots and peer copies still hold step 3.
    eng.save_checkpoint(root, client_state=CLIENT_STATE)
    eng.robust_plugins.memory.store.flush()
    mem = eng.robust_plugins.memory
    newest = max(mem.store.own_snapshots(), key=lambda s: s.step)
    res["client_state_snapshot"] = {
        "own_steps": gather(sorted(s.step for s in mem.store.own_snapshots())),
        "held_steps": gather(sorted(s.step for s in mem.peers.held_snapshots(dist.get_world_size()))),
        "in_newest": plain(mem.store.load(newest.slot)[1]["client_state"])}
    losses += train(eng, 5, corpus, data)
    eng.robust_plugins.memory.store.flush()
    res["main"] = {"losses": losses, "blocking_s": eng.robust_plugins.memory.blocking_s,
                   "files": sorted(os.path.basename(f) for f in memory.job_files(key)),
                   "holders": eng.robust_plugins.memory.peers.holders}
    records.take()

    def restart(seed, until):
        d = DataPosition()
        e = make_engine(args.stage, block, seed=seed)
        seed_all(999 + seed)  # different RNG states: only the snapshot can make them right
        e.robust_plugins.memory.register("data", d.get, d.set)
        load_path, client = e.load_checkpoint(root)
        info = {"load_path": load_path, "resumed_at": e.global_steps, "data_seen": d.seen,
                "data_order": d.order.tolist(),
                "client_state": gather(plain({k: client[k] for k in CLIENT_STATE if k in client}))}
        # torch, numpy and Python RNG states as the reference had them at the resumed step
        info["rng_restored"] = gather(rng_digest() == _digest_of(ref_rng[e.global_steps]))
        if "global_step" in load_path and load_path.endswith("mp_rank_00_model_states.pt"):
            # DeepSpeed's own checkpoint holds no RNG state: a script restores its own (as from
            # its client_state); here the reference's states of that step.
            set_rng_states(ref_rng[e.global_steps])
        info["log"] = records.take()
        info["losses"] = train(e, until, corpus, d)
        info["digests"] = digests(e)
        info["restored"] = gather(e.robust_plugins.memory.restored)
        e.robust_plugins.memory.store.flush()
        return e, info

    # 1. own memory: resume at 5, train to 6.
    e1, res["own"] = restart(seed=5, until=6)
    # 2. rank 1's shared memory is wiped (its node "lost"): rank 1 restores from its peer (rank 0).
    dist.barrier()
    if rank == 1:
        for f in memory.job_files(key):
            if ".r00001.s" in f:
                os.remove(f)
    dist.barrier()
    e2, res["peer"] = restart(seed=6, until=7)
    # 3. rank 0's newest slot (step 7) is corrupted: restored from rank 1's copy of it.
    def corrupt_newest(slots):
        newest = max((s for s in slots if s.header() is not None), key=lambda s: s.header().step)
        with open(newest.path, "r+b") as f:
            f.seek(newest.header().data_off + 100)
            b = f.read(1)
            f.seek(newest.header().data_off + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        return os.path.basename(newest.path)

    dist.barrier()
    if rank == 0:
        res["corrupted_file"] = corrupt_newest(e2.robust_plugins.memory.store.slots)
    dist.barrier()
    e3, res["corrupt"] = restart(seed=7, until=STEPS)
    # 4. after one more "crash" at 8: rank 0's newest snapshot is corrupt and so is rank 1's copy
    # of it; step 7 is the newest every rank has: both go back to it (rank 0 from its older slot).
    dist.barrier()
    if rank == 0:
        corrupt_newest(e3.robust_plugins.memory.store.slots)
    else:
        corrupt_newest(e3.robust_plugins.memory.peers.held)
    dist.barrier()
    e4, res["common"] = restart(seed=8, until=STEPS)
    res["dirs_after_runs"] = sorted(os.listdir(root))
    res["persisted"] = e1.robust_plugins.memory.persister.saved
    # 5. every snapshot is gone: the newest verified disk checkpoint, step 6 written in the
    # background (snapshot format), is used.
    dist.barrier()
    if rank == 0:
        memory.remove_job(key)
    dist.barrier()
    e5, res["disk"] = restart(seed=9, until=STEPS)
    # 6. snapshots gone and step 6's file on disk corrupted: skipped, DeepSpeed's own step 4 is used.
    dist.barrier()
    if rank == 0:
        memory.remove_job(key)
        path = pathlib.Path(root, "global_step6", persist.FILE.format(rank=1))
        data_ = bytearray(path.read_bytes())
        data_[-10] ^= 0xFF
        path.write_bytes(bytes(data_))
    dist.barrier()
    e6, res["older_disk"] = restart(seed=10, until=STEPS)
    if args.stage == 0:
        # DeepSpeed's bf16 wrapper of ZeRO 0 (FP16_UnfusedOptimizer on CPU): a restart restored
        # from memory continues bitwise (fp32 masters, wrapped Adam, loss-scale settings).
        os.environ[memory.ENV_JOB] = f"{job}-bf16"

        def bf16_engine(seed):
            model = build_gpt("tiny", seed=seed)
            cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "bf16": {"enabled": True},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                   "zero_optimization": {"stage": 0}, "robust_plugins": {"checkpoint": {"memory_every": 1}}}
            e, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            return e

        b_ref = bf16_engine(SEED)
        seed_all(7)
        bf16 = {"optimizer": type(b_ref.optimizer).__name__, "ref_losses": train(b_ref, 6, corpus)}
        bf16["ref_digests"] = digests(b_ref)
        b_ref.robust_plugins.memory.close(remove=True)
        b1 = bf16_engine(SEED)
        seed_all(7)
        bf16["losses"] = train(b1, 4, corpus)
        b1.robust_plugins.memory.store.flush()
        b2 = bf16_engine(SEED + 3)
        seed_all(999)
        path, _ = b2.load_checkpoint()
        bf16["load_path"], bf16["resumed_at"] = path, b2.global_steps
        bf16["losses"] += train(b2, 6, corpus)
        bf16["digests"] = digests(b2)
        b2.robust_plugins.memory.close(remove=True)
        b1.robust_plugins.memory.close(remove=True)
        res["bf16_zero0"] = bf16
        os.environ[memory.ENV_JOB] = job
    res["files_before_end"] = sorted(os.path.basename(f) for f in memory.job_files(key))
    res["job_key"] = key
    if rank == 0:
        (out / "results.json").write_text(json.dumps(res, indent=1))
    dist.barrier()
    # Freed here, not at interpreter exit: a gloo group destroyed during shutdown with its threads
    # still running sometimes aborts the rank after its work is done (exit -6; docs/megatron.md).
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()  # the results are written; see _exit.py

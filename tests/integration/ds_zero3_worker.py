"""Every ZeRO-3 checkpoint scenario of ``test_deepspeed_zero3.py`` in one set of 2 ranks.

``scenarios(rank, world, out)`` runs under ``tests/_dist.run_ranks(..., init=False)`` and returns
this rank's results. A "restart" is a fresh engine built from a differently seeded model, with
differently seeded RNGs, in the same processes: it sees only what the previous engines left in
``/dev/shm`` and on disk, which is what a restarted process sees.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import uuid

import robust_plugins  # noqa: F401  (installs the DeepSpeed patch)

import numpy as np
import torch

from robust_plugins.checkpoint import memory
from robust_plugins.workloads.gpt import build_gpt
from robust_plugins.workloads.text import get_batch, load_corpus

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


def make_engine(block, seed=SEED, bf16=False):
    import deepspeed

    model = build_gpt("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                       "warmup_num_steps": 5}},
        # Under 1000 elements a parameter stays gathered after each step (persistent); the
        # matrices are partitioned: both kinds are restored.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000,
                              "reduce_bucket_size": 5e6, "stage3_prefetch_bucket_size": 5e6},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if block is not None:
        cfg["robust_plugins"] = block
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def seed_all(seed: int) -> None:
    """Seed torch, numpy and Python's RNG, differently on each rank."""
    import torch.distributed as dist

    s = seed + 1000 * dist.get_rank()
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def rng_states() -> tuple:
    return torch.get_rng_state().clone(), np.random.get_state(), random.getstate()


def set_rng_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def rng_digest(states: tuple) -> str:
    t, n, p = states
    h = hashlib.sha256(t.numpy().tobytes())
    h.update(n[1].tobytes())
    h.update(repr((n[0], n[2:], p)).encode())
    return h.hexdigest()


def train(engine, until, corpus, rng_log=None) -> list[float]:
    import torch.distributed as dist

    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    while engine.global_steps < until:
        if rng_log is not None:  # the states a snapshot of the previous step must give back
            rng_log[engine.global_steps] = rng_states()
        x, y = get_batch(corpus, "train", seed=SEED, step=engine.global_steps, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=SEQ_LEN)
        # Draws from torch, numpy and Python's RNG scale the loss (and the gradients): a resumed
        # run matches the reference only if all three states came back.
        noise = torch.rand(()) + float(np.random.rand()) + random.random()
        loss = engine(x, y) * (1 + 0.05 * noise)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def state_digest(engine) -> str:
    """sha256 of this rank's fp32 master partition, low-precision partition and Adam state."""
    opt = engine.optimizer
    h = hashlib.sha256()
    for t in list(opt.fp32_partitioned_groups_flat) + list(opt.fp16_partitioned_groups_flat):
        h.update(t.detach().float().contiguous().numpy().tobytes())
    for st in opt.optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                h.update(v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _restart(block, seed, until, corpus, records, ref_rng=None, bf16=False, rng_from_ref=False):
    e = make_engine(block, seed=seed, bf16=bf16)
    seed_all(999 + seed)  # other RNG states: only the restore can make them right
    load_path, _ = e.load_checkpoint(block["checkpoint"]["dir"])
    info = {"load_path": load_path, "resumed_at": e.global_steps, "restored": e.robust_plugins.memory.restored}
    if ref_rng is not None:
        info["rng_restored"] = rng_digest(rng_states()) == rng_digest(ref_rng[e.global_steps])
        if rng_from_ref:  # DeepSpeed's own checkpoint holds no RNG state: the script brings its own
            set_rng_states(ref_rng[e.global_steps])
    info["log"] = records.take()
    info["losses"] = train(e, until, corpus)
    info["digest"] = state_digest(e)
    e.robust_plugins.memory.store.flush()
    return e, info


def scenarios(rank: int, world: int, out: str) -> dict:
    """Every scenario on this rank (module docstring); returns this rank's results."""
    import deepspeed
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    records = Records()
    logging.getLogger("robust_plugins").addHandler(records)
    logging.getLogger("robust_plugins").setLevel(logging.INFO)
    corpus = load_corpus(max_bytes=200_000)
    ids = [None] * world
    dist.all_gather_object(ids, uuid.uuid4().hex)
    res: dict = {}
    engines = []
    root = os.path.join(out, "ckpt")
    block = {"checkpoint": {"dir": root, "memory_every": 1, "peer_backup": True}}
    os.environ[memory.ENV_JOB] = ids[0]
    key = memory.job_key()

    # Reference: vanilla ZeRO-3 (no block), uninterrupted.
    ref = make_engine(None)
    seed_all(7)
    ref_rng: dict[int, tuple] = {}
    res["reference"] = {"losses": train(ref, STEPS, corpus, rng_log=ref_rng), "digest": state_digest(ref),
                        "persistent": len(ref.optimizer.persistent_parameters),
                        "partitioned": sum(1 for p in ref.module.parameters() if p.ds_persist is False)}
    # Main: snapshots every step, a verified DeepSpeed save at step 2, stop at 4 (the "crash").
    main = make_engine(block)
    engines.append(main)
    seed_all(7)
    losses = train(main, 2, corpus)
    main.save_checkpoint(root)
    losses += train(main, 4, corpus)
    main.robust_plugins.memory.store.flush()
    res["main"] = {"losses": losses, "blocking_s": main.robust_plugins.memory.blocking_s,
                   "ckpt_files": sorted(os.listdir(os.path.join(root, "global_step2"))),
                   "log": records.take()}
    # 1. own memory snapshot (step 4), continue to 6.
    e, res["own"] = _restart(block, 5, 6, corpus, records, ref_rng)
    engines.append(e)
    # 2. rank 1's shared memory wiped: its partitions come from rank 0's copy (step 6).
    dist.barrier()
    if rank == 1:
        for f in memory.job_files(key):
            if ".r00001.s" in f:
                os.remove(f)
    dist.barrier()
    e, res["peer"] = _restart(block, 6, STEPS, corpus, records, ref_rng)
    engines.append(e)
    # 3. every snapshot gone: the verified disk checkpoint of step 2 (DeepSpeed's ZeRO-3 files).
    dist.barrier()
    if rank == 0:
        memory.remove_job(key)
    dist.barrier()
    e, res["disk"] = _restart(block, 8, STEPS, corpus, records, ref_rng, rng_from_ref=True)
    engines.append(e)

    # bf16: vanilla reference, then snapshots and a restart from memory at step 3.
    os.environ[memory.ENV_JOB] = f"{ids[0]}-bf16"
    bf16_block = {"checkpoint": {"dir": os.path.join(out, "ckpt_bf16"), "memory_every": 1}}
    b_ref = make_engine(None, bf16=True)
    seed_all(7)
    b_rng: dict[int, tuple] = {}
    res["bf16_reference"] = {"losses": train(b_ref, 6, corpus, rng_log=b_rng), "digest": state_digest(b_ref),
                             "dtype": str(b_ref.optimizer.fp16_partitioned_groups_flat[0].dtype)}
    b1 = make_engine(bf16_block, bf16=True)
    engines.append(b1)
    seed_all(7)
    res["bf16_main"] = {"losses": train(b1, 3, corpus)}
    b1.robust_plugins.memory.store.flush()
    e, res["bf16_own"] = _restart(bf16_block, 11, 6, corpus, records, b_rng, bf16=True)
    engines.append(e)
    for eng in engines:
        eng.robust_plugins.memory.close(remove=True)
    dist.barrier()
    if rank == 0:
        memory.remove_job(key)
        memory.remove_job(memory.job_key(f"{ids[0]}-bf16"))
    res["shm_left"] = memory.job_files(key)
    return res


def _local_grads(seed: int, x, y) -> list[torch.Tensor]:
    """This rank's full fp32 gradients of the plain model (no DeepSpeed), in parameter order."""
    model = build_gpt("tiny", seed=seed)
    model(x, y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def compression_scenarios(rank: int, world: int, out: str) -> dict:
    """Codec none vs vanilla ZeRO-3 (fp32, bf16), int8 after one SGD(lr=1) step against an
    independent bound, and the reduce-scatter's bytes; this rank's results."""
    import deepspeed
    import torch.distributed as dist

    from robust_plugins.comm import WireCounter
    from robust_plugins.patches.deepspeed_zero3_reduce import interleave

    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    corpus = load_corpus(max_bytes=200_000)
    res: dict = {}
    for dtype in ("fp32", "bf16"):
        for name, block in (("vanilla", None), ("none", {"compression": {"codec": "none"}})):
            e = make_engine(block, bf16=dtype == "bf16")
            seed_all(7)
            res[f"{dtype}_{name}"] = {"losses": train(e, 4, corpus), "digest": state_digest(e),
                                      "plugin": getattr(e, "robust_plugins", None) is not None}
    # int8 training against vanilla over 20 steps, and int8 with snapshots: a restart at step 10
    # restores the error-feedback residuals with the partitions and continues bitwise.
    int8 = {"codec": "int8", "block_size": 256, "min_numel": 0, "warmup_steps": 0}
    long = 20
    e = make_engine(None)
    seed_all(7)
    res["fp32_vanilla_long"] = {"losses": train(e, long, corpus)}
    e = make_engine({"compression": int8})
    seed_all(7)
    res["int8_long"] = {"losses": train(e, long, corpus), "digest": state_digest(e),
                        "residual_sq": float(e.robust_plugins.sync.state.residual_sq_norm())}
    e = make_engine(None, bf16=True)
    seed_all(7)
    res["bf16_vanilla_long"] = {"losses": train(e, long, corpus)}
    e = make_engine({"compression": int8}, bf16=True)
    seed_all(7)
    res["bf16_int8_long"] = {"losses": train(e, long, corpus),
                             "compressed": e.robust_plugins.sync.stats.compressed_elements}
    from robust_plugins.patches.deepspeed import detach

    name = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
    bound = name in e.optimizer.__dict__
    detach(e)  # the reduce-scatter falls back to DeepSpeed's
    res["int8_long"]["detach"] = [bound, name in e.optimizer.__dict__]
    os.environ[memory.ENV_JOB] = f"{out}-int8"
    block = {"compression": int8, "checkpoint": {"memory_every": 1}}
    first = make_engine(block)
    seed_all(7)
    losses = train(first, long // 2, corpus)
    first.robust_plugins.memory.store.flush()
    second = make_engine(block, seed=SEED + 1)
    seed_all(99)
    path, _ = second.load_checkpoint()
    losses += train(second, long, corpus)
    res["int8_restart"] = {"losses": losses, "digest": state_digest(second), "load_path": path}
    for eng in (first, second):
        eng.robust_plugins.memory.close(remove=True)
    dist.barrier()
    if rank == 0:
        memory.remove_job(memory.job_key())
    x, y = get_batch(corpus, "train", seed=SEED, step=0, rank=rank, world_size=world, micro_batch=MICRO_BATCH,
                     seq_len=SEQ_LEN)
    sgd = {}
    int8_1 = {"compression": {"codec": "int8", "block_size": 256, "min_numel": 0, "warmup_steps": 0}}
    for name, block in (("vanilla", None), ("int8", int8_1), ("bf16_vanilla", None), ("bf16_int8", int8_1)):
        import deepspeed as ds

        model = build_gpt("tiny", seed=SEED)
        cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "steps_per_print": 10**9,
               "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,  # DeepSpeed's default: 1.0
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000,
                                     "reduce_bucket_size": 5e6, "stage3_prefetch_bucket_size": 5e6}}
        if block is not None:
            cfg["robust_plugins"] = block
        if name.startswith("bf16"):
            cfg["bf16"] = {"enabled": True}
        e, *_ = ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=cfg)
        params = list(e.module.parameters())
        before = [p.ds_tensor.detach().float().clone() for p in params]
        # bf16: the fp32 master partitions, where SGD(lr=1) subtracts the reduced gradient exactly
        master = [f.detach().clone() for f in e.optimizer.fp32_partitioned_groups_flat]
        loss = e(x, y)
        with WireCounter() as wire:
            e.backward(loss)
        e.step()
        if name.startswith("bf16"):
            upd = torch.cat([(b - f.detach()).reshape(-1)
                             for b, f in zip(master, e.optimizer.fp32_partitioned_groups_flat)])
            sgd[name] = {"update": upd, "by_op": dict(wire.by_op),
                         "compressed": e.robust_plugins.sync.stats.compressed_elements if block else 0}
            continue
        # this rank's partition of each parameter: before - after = the reduced gradient (lr 1)
        update = [b - p.ds_tensor.detach().float() for b, p in zip(before, params)]
        sgd[name] = {"before": before, "update": update, "by_op": dict(wire.by_op),
                     "ds_ids": [p.ds_id for p in params], "numels": [p.ds_numel for p in params]}
        if block is not None:  # the error-feedback residual the step left (one bucket)
            sgd[name]["residual"] = [t.clone() for t in e.robust_plugins.sync.state.state_dict()["sender"].values()]
    # Telemetry on ZeRO-3 (int8): each record's all-gather and reduce-scatter bytes, by phase.
    import json

    tel_dir = os.path.join(out, "telemetry")
    e = make_engine({"compression": {"codec": "int8", "block_size": 256, "min_numel": 0, "warmup_steps": 0},
                     "telemetry": {"dir": tel_dir, "log_every": 1}})
    seed_all(7)
    train(e, 3, corpus)
    e.robust_plugins.telemetry.close()
    dist.barrier()
    res["telemetry"] = {
        "records": [json.loads(x) for x in open(os.path.join(tel_dir, "metrics.jsonl"))] if rank == 0 else [],
        "partitioned_numels": [p.ds_numel for p in e.module.parameters() if not p.ds_persist]}
    # The independent oracle: every rank's plain-PyTorch gradient, gathered, laid out as
    # DeepSpeed's reduce-scatter lays out this rank's shard of the one bucket (parameters in
    # ds_id order, a zero-padded chunk of ceil(numel / world) each), where the int8 blocks are.
    v = sgd["vanilla"]
    grads = _local_grads(SEED, x, y)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, grads)
    bucket = sorted(range(len(grads)), key=lambda k: v["ds_ids"][k])  # parameter indices, ds_id order
    assert bucket == sorted(range(len(grads)), key=lambda k: sgd["int8"]["ds_ids"][k])
    chunks = [-(-v["numels"][i] // world) for i in bucket]
    shard = sum(chunks)
    xs = []
    for g in everyone:
        buf, _ = interleave([g[i] / world for i in bucket], world)
        xs.append(buf[rank * shard:(rank + 1) * shard])
    block = 256
    bound = torch.zeros(shard)
    for x_r in xs:  # int8, round to nearest: |error| <= absmax(block) / 127 / 2 per sender
        padded = torch.zeros(-(-shard // block) * block)
        padded[:shard] = x_r.abs()
        bound += padded.view(-1, block).amax(dim=1).repeat_interleave(block)[:shard] / 254
    oracle = sum(xs)
    # This rank's error-feedback residual after its first step, by hand: what it sent to each
    # destination (its shard of its own gradient / world) minus that row's int8 round trip.
    mine, _ = interleave([everyone[rank][i] / world for i in bucket], world)
    expected = []
    for d in range(world):
        row = torch.zeros(-(-shard // block) * block)
        row[:shard] = mine[d * shard:(d + 1) * shard]
        step = row.view(-1, block).abs().amax(dim=1, keepdim=True) / 127
        decoded = torch.where(step > 0, torch.round(row.view(-1, block) / step.clamp_min(1e-30)) * step, 0.0)
        expected.append((row.view(-1, block) - decoded).reshape(-1)[:shard])
    (residual,) = sgd["int8"]["residual"]
    res["sgd_residual"] = {"got": residual.tolist(), "expected": torch.cat(expected).tolist(),
                           "half_step": torch.cat([
                               (torch.nn.functional.pad(mine[d * shard:(d + 1) * shard], (0, -shard % block))
                                .view(-1, block).abs().amax(dim=1) / 254).repeat_interleave(block)[:shard]
                               for d in range(world)]).tolist()}

    def per_param(t):  # the shard cut back into each parameter's chunk, in bucket order
        out, offset = [], 0
        for c in chunks:
            out.append(t[offset:offset + c])
            offset += c
        return torch.cat(out)

    def flat(d):
        return torch.cat([d[i].reshape(-1) for i in bucket])

    b_van, b_int8 = sgd["bf16_vanilla"]["update"], sgd["bf16_int8"]["update"]
    res["sgd_bf16"] = {"vanilla_update": b_van.tolist(), "int8_update": b_int8.tolist(),
                       "by_op": {k: sgd[k]["by_op"] for k in ("bf16_vanilla", "bf16_int8")},
                       "compressed": sgd["bf16_int8"]["compressed"]}
    res["sgd"] = {"vanilla_minus_int8": (flat(v["update"]) - flat(sgd["int8"]["update"])).tolist(),
                  "same_start": all(torch.equal(v["before"][i], sgd["int8"]["before"][i]) for i in bucket),
                  "oracle_update": per_param(oracle).tolist(), "vanilla_update": flat(v["update"]).tolist(),
                  "bound": per_param(bound).tolist(), "shard_numel": shard,
                  "by_op": {k: sgd[k]["by_op"] for k in sgd}, "numels": v["numels"]}
    return res


def everything(rank: int, world: int, out: str) -> dict:
    """:func:`scenarios` and, under ``"compression"``, :func:`compression_scenarios`: one launch."""
    res = scenarios(rank, world, out)
    res["compression"] = compression_scenarios(rank, world, out)
    return res

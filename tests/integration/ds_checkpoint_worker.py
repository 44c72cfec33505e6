"""One torchrun launch = every verified-checkpoint scenario for one ZeRO stage (2 CPU ranks).

Run as ``torchrun --nproc-per-node 2 ds_checkpoint_worker.py --stage S --out DIR``. Rank 0 writes
``DIR/results.json``; ``test_deepspeed_checkpoint.py`` asserts on it. Each scenario records what
happened (resumed step, losses, parameter digests, the error raised, the robust_plugins log lines)
rather than asserting here, so that one failure does not hide the others.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import logging
import os
import pathlib
import shutil
import statistics
import time

import robust_plugins  # noqa: F401  (must precede deepspeed.initialize: installs the patch)

import deepspeed
import torch
import torch.distributed as dist

from robust_plugins.checkpoint import manifest as mf
from robust_plugins.errors import CheckpointError
from robust_plugins.patches import deepspeed as ds_patch
from robust_plugins.workloads.gpt import build_gpt
from robust_plugins.workloads.text import get_batch, load_corpus
from _exit import leave_without_teardown

SEED = 1234
MICRO_BATCH = 4
SEQ_LEN = 64
INT8 = {"codec": "int8", "block_size": 256}


class Records(logging.Handler):
    """Collects robust_plugins log lines (this rank) so results can show what the user saw."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def take(self) -> list[str]:
        out, self.lines = self.lines, []
        return out


def ds_config(stage: int, block: dict | None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        # CPU: DeepSpeed's 5e8-element default buckets cost seconds a step (HOSTS.md).
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
    }
    if block is not None:
        cfg["robust_plugins"] = block
    return cfg


def make_engine(stage, block, seed=SEED, vanilla=False):
    model = build_gpt("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if vanilla:
        ds_patch.undo()
        try:
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, block))
        finally:
            ds_patch.install()
        assert not hasattr(engine, "robust_plugins")
        return engine
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, block))
    return engine


def digests(engine) -> list[str]:
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, h.hexdigest())
    return out


def train(engine, until: int, corpus, save_at=(), save_dir=None) -> list[float]:
    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    while engine.global_steps < until:
        x, y = get_batch(corpus, "train", seed=SEED, step=engine.global_steps, rank=rank, world_size=world,
                         micro_batch=MICRO_BATCH, seq_len=SEQ_LEN)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.global_steps in save_at:
            engine.save_checkpoint(save_dir)
    return losses


def on_rank0(fn):
    """Run ``fn`` (a file mutation) on rank 0 alone once every rank is done with the files:
    DeepSpeed's load does not end in a barrier, so rank 1 may still be reading."""
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def load(engine, root, records, tag=None) -> dict:
    """load_checkpoint, recording the resumed step or the error, and the log lines."""
    out = {}
    try:
        path, _ = engine.load_checkpoint(root, tag)
        out["load_path"] = None if path is None else str(path)
        out["resumed_at"] = engine.global_steps
    except CheckpointError as exc:
        out["error"] = str(exc)
    out["log"] = records.take()
    return out


def committed(root) -> list[str]:
    return sorted(p.name for p in pathlib.Path(root).iterdir() if p.is_dir())


def shard(root, tag) -> pathlib.Path:
    """A file DeepSpeed wrote for ``tag``: a ZeRO shard of rank 1 when there is one."""
    d = pathlib.Path(root) / tag
    zero = sorted(d.glob("*zero_pp_rank_1_*optim_states.pt"))
    return zero[0] if zero else d / "mp_rank_00_model_states.pt"


def flip_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


class _Evil:
    """Unpickling this would create a directory: proof that a load ran code from a checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.use_deterministic_algorithms(True)
    records = Records()
    logging.getLogger("robust_plugins").addHandler(records)
    logging.getLogger("robust_plugins").setLevel(logging.INFO)
    corpus = load_corpus()
    stage, out, rank = args.stage, pathlib.Path(args.out), dist.get_rank()
    res: dict = {}

    # Reference: vanilla DeepSpeed, 30 steps without interruption.
    ref = make_engine(stage, None, vanilla=True)
    res["reference"] = {"losses": train(ref, 30, corpus), "digests": digests(ref)}
    del ref

    # Main run: automatic saves at 10 and 20 (persist_every), keep 3.
    root = str(out / "main")
    block = {"checkpoint": {"dir": root, "persist_every": 10, "keep": 3}}
    eng = make_engine(stage, block)
    # A checkpoint-only block must leave gradient reduction to DeepSpeed (no instance shadows).
    res["hooks"] = sorted(
        f"{type(obj).__name__}.{name}" for obj in (eng, eng.optimizer)
        for name in ("allreduce_bucket", "gradient_reduction_w_predivide") if name in vars(obj))
    res["sync"] = eng.robust_plugins.sync is not None
    res["main_losses"] = train(eng, 20, corpus)
    res["main_after_20"] = {"dirs": committed(root), "log": records.take(),
                            "latest": (pathlib.Path(root) / "latest").read_text()}
    del eng

    # 1. corrupt one byte of step 20's shard -> resume from 10, then continue to 30 (saves 20, 30).
    on_rank0(lambda: flip_byte(shard(root, "global_step20")))
    eng = make_engine(stage, block, seed=SEED + 1)
    res["corrupt"] = load(eng, root, records)
    res["corrupt"]["corrupted_file"] = shard(root, "global_step20").name
    res["corrupt"]["losses"] = train(eng, 30, corpus)
    res["corrupt"]["digests"] = digests(eng)
    res["corrupt"]["dirs_after"] = committed(root)
    res["corrupt"]["log_after"] = records.take()

    # 2. truncate step 30's shard -> newest intact is the re-saved 20.
    def truncate():
        p = shard(root, "global_step30")
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    on_rank0(truncate)
    res["truncated"] = load(eng, root, records)
    res["truncated"]["file"] = shard(root, "global_step30").name
    # ... and asking for that tag explicitly is an error naming the file.
    res["explicit_bad_tag"] = load(eng, root, records, tag="global_step30")

    # 3. remove step 20's manifest -> step 10. 4. plus a leftover temporary directory.
    def break_more():
        (pathlib.Path(root) / "global_step20" / mf.MANIFEST_NAME).unlink()
        shutil.copytree(pathlib.Path(root) / "global_step10", pathlib.Path(root) / ".tmp-global_step40")
    on_rank0(break_more)
    res["missing_manifest_and_leftover"] = load(eng, root, records)

    # 5. nothing usable: corrupt step 10 too -> a clear error, nothing loaded.
    on_rank0(lambda: flip_byte(shard(root, "global_step10")))
    res["none_usable"] = load(eng, root, records)
    res["empty_dir"] = load(eng, str(out / "empty"), records)
    del eng

    # 6. ENOSPC in the middle of writing a shard (rank 1's ZeRO shard; stage 0: rank 0's model file).
    root2 = str(out / "enospc")
    block2 = {"checkpoint": {"dir": root2, "keep": 2}}
    eng = make_engine(stage, block2)
    train(eng, 10, corpus, save_at=(10,), save_dir=root2)
    victim = 0 if stage == 0 else 1
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"\0" * 4096)  # a partial file, as a real full disk leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

    train(eng, 20, corpus)
    if rank == victim:
        torch.save = full_disk
    try:
        eng.save_checkpoint(root2)
        res["enospc"] = {"error": None}
    except CheckpointError as exc:
        res["enospc"] = {"error": str(exc)}
    finally:
        torch.save = real_save
    res["enospc"].update(dirs=committed(root2), latest=(pathlib.Path(root2) / "latest").read_text(),
                         log=records.take())
    del eng
    eng = make_engine(stage, block2, seed=SEED + 2)
    res["after_enospc"] = load(eng, root2, records)
    # Continue to 30 saving at 20 and 30: keep=2 prunes step 10; ends equal to the reference.
    res["after_enospc"]["losses"] = train(eng, 30, corpus, save_at=(20, 30), save_dir=root2)
    res["after_enospc"]["digests"] = digests(eng)
    res["after_enospc"]["dirs_after"] = committed(root2)
    res["after_enospc"]["log_after"] = records.take()

    # 7. A checkpoint whose file would run code when unpickled, with a matching manifest (an
    #    attacker who can write files can write the manifest too): refused, no code runs.
    marker = out / "code_ran"

    def plant():
        d = pathlib.Path(root2) / "global_step30"
        evil = pathlib.Path(root2) / "global_step31"
        shutil.copytree(d, evil)
        real_save({"module": _Evil(str(marker))}, evil / "mp_rank_00_model_states.pt")
        m = mf.read_manifest(evil)
        files = tuple(mf.FileEntry(f.path, *mf.hash_file(evil / f.path)) for f in m.files)
        mf.write_manifest(evil, mf.Manifest(**{**m.__dict__, "files": files, "tag": "global_step31",
                                                "sequence": m.sequence + 1}))
    on_rank0(plant)
    res["pickle_code"] = load(eng, root2, records, tag="global_step31")
    res["pickle_code"]["code_ran"] = marker.exists()
    del eng

    # Plain DeepSpeed (no plugin) still reads the directory through the `latest` we wrote.
    van = make_engine(stage, None, vanilla=True, seed=SEED + 4)
    path, _ = van.load_checkpoint(root2)
    res["vanilla_latest"] = {"load_path": str(path), "resumed_at": van.global_steps, "digests": digests(van),
                             "expected": res["after_enospc"]["digests"]}
    del van

    # 8. compression residuals ride along: int8 + checkpoint, resume at 10 is bitwise equal.
    root3 = str(out / "int8")
    block3 = {"compression": INT8, "checkpoint": {"dir": root3, "persist_every": 10}}
    eng = make_engine(stage, block3)
    straight = train(eng, 20, corpus)
    straight_digests = digests(eng)
    del eng
    eng = make_engine(stage, block3, seed=SEED + 3)
    res["int8"] = load(eng, root3, records, tag="global_step10")
    res["int8"].update(straight=straight, straight_digests=straight_digests,
                       resumed=train(eng, 20, corpus), digests=digests(eng))
    res["int8"]["files"] = sorted(f.path for f in mf.read_manifest(pathlib.Path(root3) / "global_step10").files)
    del eng

    # 9. Save cost, side by side on the same weights: DeepSpeed's own save vs the verified one.
    times = {"deepspeed": [], "verified": [], "hash_s": [], "commit_s": []}
    van = make_engine(stage, None, vanilla=True)
    ver = make_engine(stage, {"checkpoint": {"keep": 1}})
    for i in range(5):
        for name, engine in (("deepspeed", van), ("verified", ver)):
            dist.barrier()
            t0 = time.perf_counter()
            engine.save_checkpoint(str(out / f"timing_{name}"), tag=f"t{i}")
            times[name].append(time.perf_counter() - t0)
        times["hash_s"].append(ver.robust_plugins.disk.last_save["hash_s"])
        times["commit_s"].append(ver.robust_plugins.disk.last_save.get("commit_s", 0.0))
    res["timing"] = {k: statistics.median(v) for k, v in times.items()}
    res["timing"]["bytes"] = sum(f.stat().st_size for f in (out / "timing_verified" / "t4").iterdir())
    records.take()

    if rank == 0:
        (out / "results.json").write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()  # the results are written; see _exit.py

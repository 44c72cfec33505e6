"""Parts of the one-GPU check (``gpu_check_cuda.py``) that drive a host or big CUDA state:
memory snapshots of several GB, a 1-rank DeepSpeed engine, megatron-core DDP on one GPU.

Each part takes the check's context (``device``, ``backend``, ``out``, ``snapshot_gb``; the
1-rank process group is already initialized) and returns a dict with ``checks`` (name -> bool),
or raises :class:`Skip` with the reason (the helpers of both files live here, so that the check
run as ``__main__`` and this module raise and catch the same class).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

from typing import Any

import torch


class Skip(Exception):
    """A part that cannot run here; its message is the reason printed."""


def need_cuda() -> None:
    """Skip the part without a CUDA device."""
    if not torch.cuda.is_available():
        raise Skip("needs a CUDA device")


def need(module: str) -> Any:
    """``module`` imported, or skip the part saying why it is not importable."""
    try:
        return __import__(module, fromlist=["_"])
    except Exception as exc:  # any import failure: the part cannot run, say which and why
        raise Skip(f"{module} not importable: {type(exc).__name__}: {exc}"[:300]) from None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu())


def _copy_bandwidth(src: torch.Tensor) -> dict:
    """GB/s of one device-to-host copy of ``src`` into pageable and into pinned memory."""
    out = {}
    pageable = torch.empty(src.shape, dtype=src.dtype)
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    for name, dst in (("pageable", pageable), ("pinned", pinned)):
        dst.copy_(src, non_blocking=True)  # first touch: page faults are not the copy's steady cost
        _sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync()
        out[f"{name}_GBps"] = round(src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9, 2)
    return out


def _matmul_loop(dev: torch.device, seconds: float, stop: threading.Event | None = None) -> float:
    """Matmuls a second (8192^2 bf16) over ``seconds`` (or until ``stop``)."""
    torch.cuda.set_device(dev)  # also when run on a thread: its current device is not inherited
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and not (stop is not None and stop.is_set()):
        a @ a
        n += 1
        if n % 8 == 0:
            _sync()
    _sync()
    return n / (time.perf_counter() - t0)


def part_snapshots(ctx: dict) -> dict:
    """In-memory snapshots of ``snapshot_gb`` GB of CUDA state: the caller's blocking time, copy
    bandwidth pinned vs pageable, a concurrent matmul loop's slowdown, and a bitwise restore."""
    need_cuda()
    from robust_plugins.checkpoint.memory import SnapshotStore

    dev = ctx["device"]
    n_tensors = 8
    numel = int(ctx["snapshot_gb"] * 2**30 / 4 / n_tensors)
    state = {f"t{i}": torch.randn(numel, device=dev) for i in range(n_tensors)}
    bw = _copy_bandwidth(state["t0"])
    # Two slots of the state: a container's /dev/shm is often 64 MB, then the snapshot goes to disk
    # (recorded: its bandwidth is then the disk's page cache, not shared memory's).
    need_bytes = 2.2 * n_tensors * numel * 4
    shm = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need_bytes
    root = tempfile.mkdtemp(prefix="gpucheck-snap-", dir="/dev/shm" if shm else None)
    store = SnapshotStore(f"gpucheck{os.getpid()}", 0, 1, root=root)
    try:
        alone = _matmul_loop(dev, 3.0)
        stop, rate = threading.Event(), {}
        loop = threading.Thread(target=lambda: rate.update(r=_matmul_loop(dev, 60.0, stop)))
        loop.start()
        t0 = time.perf_counter()
        blocking = store.save(1, state)
        settle = store.settle()
        total = time.perf_counter() - t0
        stop.set()
        loop.join(120)
        step, restored = store.load(store.own_snapshots()[0].slot)
        same = step == 1 and all(_equal(restored[k], v) for k, v in state.items())
    finally:
        store.close(remove=True)
        shutil.rmtree(root, ignore_errors=True)
    gb = n_tensors * numel * 4 / 1e9
    return {"gb": round(gb, 2), "root": root, "copy": bw, "blocking_s": blocking, "settle_s": settle, "total_s": total,
            "snapshot_GBps": round(gb / total, 2), "matmul_per_s": {"alone": alone, "during": rate.get("r")},
            "checks": {"bitwise restore": same, "blocking below total": blocking <= total}}


def _ds_engine(stage: int, bf16: bool, overlap: bool | None, tmp: str):
    deepspeed = need("deepspeed")
    import robust_plugins  # noqa: F401  (the DeepSpeed patch, before deepspeed.initialize)
    from robust_plugins.workloads import build_gpt

    block = {"compression": {"codec": "int8", "overlap": overlap},
             "telemetry": {"dir": os.path.join(tmp, "telemetry"), "log_every": 1},
             "checkpoint": {"dir": os.path.join(tmp, "ckpt"), "memory_every": 1}}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
              "robust_plugins": block}
    if bf16:
        config["bf16"] = {"enabled": True}
    model = build_gpt("tiny", seed=0).to(torch.cuda.current_device())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def part_deepspeed(ctx: dict) -> dict:
    """A 1-rank DeepSpeed engine (ZeRO 0 fp32/bf16, ZeRO 1/2) with int8, overlap on and off,
    memory snapshots and telemetry: three steps each, finite losses, equal results with and
    without overlap."""
    need_cuda()
    need("deepspeed")
    from robust_plugins.workloads import get_batch, load_corpus

    corpus, runs, checks = load_corpus(), {}, {}
    for stage, bf16 in ((0, False), (0, True), (1, False), (2, False)):
        digests = {}
        # False: reduce after backward; None: the default, on where supported (ZeRO 0 fp32), off with
        # a log line elsewhere (the result must be bitwise the same either way).
        for overlap in (False, None):
            name = f"zero{stage} {'bf16' if bf16 else 'fp32'} overlap={overlap}"
            with tempfile.TemporaryDirectory(prefix="gpucheck-ds-") as tmp:
                try:
                    engine = _ds_engine(stage, bf16, overlap, tmp)
                    losses = []
                    for step in range(3):
                        x, y = get_batch(corpus, "train", seed=0, step=step, rank=0, world_size=1, micro_batch=4,
                                         seq_len=64)
                        loss = engine(x.cuda(), y.cuda())
                        engine.backward(loss)
                        engine.step()
                        losses.append(float(loss))
                    digests[overlap] = torch.cat([p.detach().float().flatten().cpu()
                                                  for p in engine.module.parameters()])
                    runs[name] = {"losses": losses, "telemetry": sorted(os.listdir(os.path.join(tmp, "telemetry")))
                                  if os.path.isdir(os.path.join(tmp, "telemetry")) else []}
                    checks[f"{name}: finite losses"] = all(torch.isfinite(torch.tensor(losses)))
                    checks[f"{name}: telemetry written"] = bool(runs[name]["telemetry"])
                except Skip:
                    raise
                except Exception as exc:
                    runs[name] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
                    checks[f"{name}: ran"] = False
        if len(digests) == 2:
            checks[f"zero{stage} {'bf16' if bf16 else 'fp32'}: overlap default == off"] = _equal(
                digests[None], digests[False])
    return {"runs": runs, "checks": checks}


def part_megatron(ctx: dict) -> dict:
    """megatron-core DDP on one GPU with ``overlap_grad_reduce``, int8, the checkpointer (save,
    ``step_end``'s SIGTERM agreement on the default group's device, load back bitwise)."""
    need_cuda()
    need("megatron.core")
    import robust_plugins.megatron as rpm
    from robust_plugins.recipes.megatron_gpt.train import Preset, build, param_digest, train_step
    from robust_plugins.workloads import load_corpus

    preset = Preset(num_layers=2, hidden_size=64, num_attention_heads=2, seq_len=64, micro_batch=4, tp=1,
                    device="cuda", lr=1e-3, bucket_size=40_000)
    corpus = load_corpus()
    parts = build(preset, tp=1, seed=0, codec="int8", overlap=True, distopt=False)
    with tempfile.TemporaryDirectory(prefix="gpucheck-mcore-") as tmp:
        ckpt = rpm.MegatronCheckpointer(parts["ddp"], parts["optimizer"], {"dir": tmp, "keep": 2},
                                        plugin=parts["plugin"])
        losses = []
        for step in range(1, 4):
            losses.append(train_step(parts, preset, corpus, 0, step))
            ckpt.step_end(step, loss=losses[-1])
        ckpt.save(3)
        digest = param_digest(parts["ddp"])
        losses.append(train_step(parts, preset, corpus, 0, 4))
        loaded = ckpt.load()
        back = param_digest(parts["ddp"])
        ckpt.close()
    return {"losses": losses, "loaded_step": loaded,
            "checks": {"finite losses": all(torch.isfinite(torch.tensor(losses))),
                       "loaded step 3": loaded == 3, "load restores the saved parameters": back == digest}}

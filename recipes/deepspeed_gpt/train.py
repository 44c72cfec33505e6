"""Train the byte-level GPT with DeepSpeed on CPU or GPU; one launch can hold several runs.

Run under torchrun (or through :func:`robust_plugins.launch.run_torchrun`)::

    torchrun --nproc-per-node 2 -m robust_plugins.recipes.deepspeed_gpt.train \\
        --config recipes/deepspeed_gpt/plugin.json --steps 100 --out runs/plugin.json

    # several configs, one process group (DeepSpeed's import + init costs ~10 s on 2 cores):
    ... train --configs baseline.json plugin.json --steps 100 --out-dir runs/cmp

    # or a plan: {"runs": [{"name": "a", "config": "baseline.json", "steps": 40, "seed": 1,
    #                       "save_dir": "ckpt", "save_at": 20}, ...]}
    ... train --plan plan.json --out-dir runs/plan

Under ``robust run`` a plan entry with ``"resume": true`` and ``"save_every": N`` follows the resume
contract (``robust_plugins/watchdog/FORMAT.md``): it loads the newest checkpoint in ``save_dir`` if
there is one, saves there every N steps when the node monitor agrees (``watchdog.ok_to_save``),
and every step is reported with ``watchdog.step_end`` (a no-op outside ``robust run``). A config
whose ``robust_plugins`` block has a ``checkpoint`` sub-block needs neither: under ``robust run``
``deepspeed.initialize`` resumes from the newest restore point (in-memory snapshots first) and
the result's ``loaded`` names it (``robust demo``'s fault job runs so).

Each run builds a fresh model, optimizer and engine from its seed (``--seed``, or the plan entry's
``seed``), which also orders the training batches. Data are indexed by
``engine.global_steps``, so a run started with ``--load-dir`` continues with exactly the batches
the uninterrupted run would have seen, and ``--steps`` is the *total* step count to reach. Rank 0
writes one JSON result per run (losses, timings, gradient bytes on the wire, parameter hash, and
the loss on a fixed held-out validation set that does not depend on the run's seed).
"""

# robust_plugins first: its import hook patches deepspeed.initialize as DeepSpeed is imported, so
# the config's "robust_plugins" block is honoured instead of silently ignored.
import robust_plugins  # noqa: I001  (order matters)

import argparse
import copy
import dataclasses
import gc
import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import deepspeed

from robust_plugins import watchdog
from robust_plugins.config import BLOCK_KEY, load_json
from robust_plugins.errors import ConfigError, RobustPluginsError
from robust_plugins.workloads import PRESETS, build_gpt, get_batch, load_corpus

log = logging.getLogger("robust_plugins.recipes.deepspeed_gpt")

#: Keys a plan's run entry may have.
RUN_KEYS = ("name", "config", "steps", "seed", "save_dir", "save_at", "load_dir", "out", "codec_error",
            "save_every", "resume")

#: Validation batches evaluated after training; each is world_size x micro_batch windows, so
#: 32 x 4 x 8 = 1024 windows of the val split for the benchmark (~2 s for `small` on 2 cores).
#: A fixed, larger set keeps the evaluation's own sampling error out of run-to-run comparisons.
VAL_BATCHES = 32

#: Seed of the validation windows. Fixed, not the run's seed: every run of a launch with the same
#: world size and micro-batch is scored on the same windows, so runs with different seeds compare.
VAL_SEED = 0

#: Training losses averaged into ``final_loss_last10``; one step's loss is too noisy to compare runs.
LAST_K = 10


@dataclasses.dataclass
class RunSpec:
    """One training run inside a launch."""

    name: str
    config: str
    steps: int
    seed: int = 0
    save_dir: str | None = None
    save_at: int | None = None
    load_dir: str | None = None
    out: str | None = None
    codec_error: bool = False
    save_every: int | None = None
    resume: bool = False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="DeepSpeed JSON config (one run)")
    src.add_argument("--configs", nargs="+", help="several DeepSpeed JSON configs, run one after another")
    src.add_argument("--plan",
                     help="JSON plan: {\"runs\": [{name, config, steps, seed, save_dir, save_at, load_dir}]}")
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps to reach (default 100)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="GPT size (default tiny)")
    p.add_argument("--seed", type=int, default=0,
                   help="model init and training-data seed (default 0; a plan entry's \"seed\" overrides it)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--save-dir", help="engine.save_checkpoint directory (single run)")
    p.add_argument("--save-at", type=int, help="save a checkpoint once global_steps reaches this")
    p.add_argument("--load-dir", help="engine.load_checkpoint from here before training (single run)")
    p.add_argument("--out", help="results JSON (single run)")
    p.add_argument("--out-dir", default="runs/deepspeed_gpt", help="results directory: <name>.json a run")
    p.add_argument("--codec-error", action="store_true",
                   help="measure the codec's relative error on one real gradient before training")
    p.add_argument("--no-wire-count", action="store_true",
                   help="do not count gradient bytes (for runs without robust_plugins.comm.WireCounter)")
    p.add_argument("--log-every", type=int, default=10, help="rank-0 progress line every N steps")
    return p.parse_args(argv)


def build_specs(args: argparse.Namespace) -> list[RunSpec]:
    """Turn --config / --configs / --plan into run specs; paths in a plan are relative to it."""
    if args.config:
        specs = [RunSpec(Path(args.config).stem, args.config, args.steps, args.seed, args.save_dir,
                         args.save_at, args.load_dir, args.out, args.codec_error)]
    elif any(v is not None for v in (args.save_dir, args.save_at, args.load_dir, args.out)):
        raise ConfigError("--save-dir/--save-at/--load-dir/--out apply to one --config; "
                          "with --configs or --plan put them in the plan's run entries.")
    elif args.configs:
        specs, seen = [], set()
        for i, path in enumerate(args.configs):
            name = Path(path).stem if Path(path).stem not in seen else f"{Path(path).stem}-{i}"
            seen.add(name)
            specs.append(RunSpec(name, path, args.steps, args.seed, codec_error=args.codec_error))
    else:
        specs = _plan_specs(Path(args.plan), args)
    for s in specs:
        if (s.save_every is not None or s.resume) and s.save_dir is None:
            raise ConfigError(f"run {s.name!r}: save_every/resume need a save_dir (where checkpoints go).")
        if s.save_every is not None and s.save_every < 1:
            raise ConfigError(f"run {s.name!r}: save_every={s.save_every} must be >= 1.")
        if s.save_at is not None and (s.save_dir is None or not 0 < s.save_at <= s.steps):
            raise ConfigError(f"run {s.name!r}: save_at={s.save_at} needs a save_dir and 0 < save_at <= steps={s.steps}.")
    return specs


def _plan_specs(plan_path: Path, args: argparse.Namespace) -> list[RunSpec]:
    plan = load_json(plan_path)
    runs = plan.get("runs")
    if not isinstance(runs, list) or not runs or set(plan) - {"runs"}:
        raise ConfigError(f"{plan_path} must be {{\"runs\": [ ... ]}} with at least one run entry.")
    specs = []
    for i, entry in enumerate(runs):
        unknown = set(entry) - set(RUN_KEYS)
        if unknown or "config" not in entry:
            raise ConfigError(f"{plan_path}: run {i} has unknown keys {sorted(unknown)} or no 'config'; "
                              f"allowed keys: {', '.join(RUN_KEYS)}.")
        rel = {k: str(plan_path.parent / entry[k]) for k in ("config", "save_dir", "load_dir", "out")
               if entry.get(k) is not None}
        defaults = {"name": Path(entry["config"]).stem, "steps": args.steps, "seed": args.seed,
                    "codec_error": args.codec_error}
        specs.append(RunSpec(**{**defaults, **entry, **rel}))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{plan_path}: run names must be unique, got {names}.")
    return specs


def _wire_counter_cls():
    try:
        from robust_plugins.comm import WireCounter
    except ImportError as exc:
        raise RobustPluginsError(
            "robust_plugins.comm.WireCounter is not available, so gradient bytes cannot be counted "
            f"({exc}). Install a robust_plugins that has it, or pass --no-wire-count."
        ) from exc
    return WireCounter


def _total(calls: Any) -> int:
    # WireCounter.calls counts calls per op (a Counter).
    return sum(calls.values()) if hasattr(calls, "values") else int(calls)


class _NoCounter:
    # Stands in for WireCounter under --no-wire-count.
    bytes_sent = 0
    calls: dict = {}
    by_op: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def param_sha256(module: torch.nn.Module) -> str:
    """sha256 over every parameter (name order, raw bytes): equal hashes mean bitwise-equal weights."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters(), key=lambda item: item[0]):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def codec_relative_error(model: torch.nn.Module, x, y, codec: str, block_size: int | None) -> dict[str, float]:
    """Reduce one real local gradient (flattened) with the codec and exactly; compare.

    One shot, no error-feedback residual: this is the error of a single compressed all-reduce.
    """
    from robust_plugins.comm import compressed_all_reduce

    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(model(x, y), params)
    flat = torch.cat([g.reshape(-1) for g in grads]).float()
    exact = flat.clone()
    dist.all_reduce(exact)
    exact /= dist.get_world_size()
    kwargs = {"codec": codec, "op": "avg"}
    if block_size is not None:
        kwargs["block_size"] = block_size
    approx = flat.clone()
    out = compressed_all_reduce(approx, **kwargs)
    if isinstance(out, torch.Tensor):
        approx = out
    err = (approx - exact).norm().item()
    return {"codec": codec, "numel": flat.numel(), "rel_error": err / max(exact.norm().item(), 1e-30)}


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    return str(obj)


def train_one(spec: RunSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Build model + engine from the seed, (maybe) load, train to ``spec.steps``, (maybe) save."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = load_json(spec.config)
    block = ds_config.get(BLOCK_KEY)
    corpus = load_corpus()
    model = build_gpt(args.preset, spec.seed)
    seq_len = model.cfg.seq_len
    # A pristine copy for the one-shot codec measurement: DeepSpeed takes over `model`'s params.
    probe = copy.deepcopy(model) if spec.codec_error else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t_init = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=spec.config)
    init_s = time.perf_counter() - t_init
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    def batch(split: str, index: int):
        seed = spec.seed if split == "train" else VAL_SEED
        x, y = get_batch(corpus, split, seed=seed, step=index, rank=rank, world_size=world,
                         micro_batch=micro, seq_len=seq_len)
        return x.to(engine.device), y.to(engine.device)

    codec_error = None
    codec = (block or {}).get("compression", {}).get("codec") if isinstance(block, dict) else None
    if probe is not None and codec is not None:
        codec_error = codec_relative_error(probe.to(engine.device), *batch("train", 0), codec,
                                           block["compression"].get("block_size"))
    del probe

    loaded = None
    if spec.resume and Path(spec.save_dir, "latest").is_file():
        loaded, _ = engine.load_checkpoint(spec.save_dir)
    elif spec.load_dir:
        loaded, _ = engine.load_checkpoint(spec.load_dir)
        if loaded is None:
            raise RobustPluginsError(f"run {spec.name!r}: no checkpoint found in {spec.load_dir}.")
    resumed = getattr(getattr(engine, "robust_plugins", None), "resumed", None)
    if loaded is None and resumed is not None:
        loaded = resumed[0]  # robust run's default resume, inside deepspeed.initialize
    start = engine.global_steps
    counter_cls = _NoCounter if args.no_wire_count else _wire_counter_cls()

    losses, step_times = [], []
    wire = {"backward": [], "step": [], "calls": []}
    first_by_op = None
    saved = None
    while engine.global_steps < spec.steps:
        step = engine.global_steps
        t0 = time.perf_counter()
        step_loss, grad_bytes, other_bytes, calls = 0.0, 0, 0, 0
        for m in range(gas):
            loss = engine(*batch("train", step * gas + m))
            # Two counters: ZeRO reduces gradients inside backward (at the accumulation boundary);
            # step() carries ZeRO-1/2's parameter all-gather and the clipping norm's all-reduce,
            # which are not gradient traffic and which the plugin does not touch.
            with counter_cls() as wb:
                engine.backward(loss)
            with counter_cls() as ws:
                engine.step()
            step_loss += loss.item() / gas
            grad_bytes += wb.bytes_sent
            other_bytes += ws.bytes_sent
            calls += _total(wb.calls)
            if first_by_op is None:
                first_by_op = {"backward": {"bytes": _jsonable(dict(wb.by_op)), "calls": _jsonable(dict(wb.calls))},
                               "step": {"bytes": _jsonable(dict(ws.by_op)), "calls": _jsonable(dict(ws.calls))}}
        step_times.append(time.perf_counter() - t0)
        losses.append(step_loss)
        wire["backward"].append(grad_bytes)
        wire["step"].append(other_bytes)
        wire["calls"].append(calls)
        if rank == 0 and args.log_every and (engine.global_steps % args.log_every == 0 or engine.global_steps == spec.steps):
            log.info("[%s rank 0 - step %d] loss %.4f  %.3f s  %.1f KB of gradients sent", spec.name,
                     engine.global_steps, step_loss, step_times[-1], grad_bytes / 1e3)
        watchdog.step_end(engine.global_steps, loss=step_loss)
        if (spec.save_every is not None and engine.global_steps % spec.save_every == 0
                and watchdog.ok_to_save(engine.global_steps)):
            engine.save_checkpoint(spec.save_dir)
            saved = str(Path(spec.save_dir) / f"global_step{engine.global_steps}")
        if spec.save_at is not None and engine.global_steps == spec.save_at:
            engine.save_checkpoint(spec.save_dir)
            saved = str(Path(spec.save_dir) / f"global_step{engine.global_steps}")

    # Evaluation and aggregation happen outside the timed, counted region.
    engine.eval()
    with torch.no_grad():
        val = sum(engine(*batch("val", i)).item() for i in range(VAL_BATCHES)) / VAL_BATCHES
    engine.train()
    # On the engine's device: NCCL moves CUDA tensors only.
    stats = torch.tensor([losses, [float(b) for b in wire["backward"]]], dtype=torch.float64,
                         device=engine.device).reshape(2, -1)
    dist.all_reduce(stats)
    val_t = torch.tensor([val], dtype=torch.float64, device=engine.device)
    dist.all_reduce(val_t)
    mean_losses = (stats[0] / world).tolist()
    digest = param_sha256(engine.module)
    digests = [None] * world
    dist.all_gather_object(digests, digest)

    plugin = getattr(engine, "robust_plugins", None)
    result = {
        "name": spec.name,
        "config_path": str(spec.config),
        "robust_plugins_block": block,
        "plugin_active": plugin is not None,
        "plugin_stats": (_jsonable(dataclasses.asdict(plugin.sync.stats))
                         if getattr(plugin, "sync", None) is not None else None),
        "preset": args.preset,
        "model": dataclasses.asdict(model.cfg) if hasattr(model, "cfg") else None,
        "n_params": sum(p.numel() for p in engine.module.parameters()),
        "world_size": world,
        "seed": spec.seed,
        "lr": args.lr,
        "micro_batch": micro,
        "gradient_accumulation_steps": gas,
        "zero_stage": engine.zero_optimization_stage(),
        "dtype": str(engine.get_data_types()[0]),
        "steps": spec.steps,
        "start_step": start,
        "losses": mean_losses,
        "rank0_losses": losses,
        "final_loss": mean_losses[-1] if mean_losses else None,
        "final_loss_last10": statistics.fmean(mean_losses[-LAST_K:]) if mean_losses else None,
        "val_loss": val_t.item() / world,
        "val_windows": {"seed": VAL_SEED, "batches": VAL_BATCHES, "windows": VAL_BATCHES * world * micro},
        "step_time_s": step_times,
        "median_step_time_s": statistics.median(step_times) if step_times else None,
        "init_s": init_s,
        "wire": None if args.no_wire_count else {
            "rank0_grad_bytes_per_step": wire["backward"],
            "rank0_grad_calls_per_step": wire["calls"],
            "rank0_median_grad_bytes_per_step": statistics.median(wire["backward"]) if losses else None,
            "all_ranks_median_grad_bytes_per_step": statistics.median(stats[1].tolist()) if losses else None,
            "rank0_step_bytes_per_step": wire["step"],
            "rank0_median_step_bytes_per_step": statistics.median(wire["step"]) if losses else None,
            "rank0_by_op_first_step": first_by_op,
        },
        "codec_error": codec_error,
        "param_sha256": digest,
        "param_sha256_per_rank": digests,
        "ranks_agree": len(set(digests)) == 1,
        "saved": saved,
        "loaded": loaded,
        "data_sha256": corpus.sha256,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "deepspeed": deepspeed.__version__, "robust_plugins": robust_plugins.__version__},
    }
    # Free the engine before the next run builds its own (ZeRO buffers, comm groups stay shared).
    del engine, optimizer, model
    gc.collect()
    dist.barrier()
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0 on success. Rank 0 writes the results."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-init config dump drowns ours
    specs = build_specs(args)
    # DeepSpeed's default 10 min, raised to what robust run needs to judge a hang before NCCL aborts.
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl",
                               timeout=watchdog.pg_timeout(600))
    rank = dist.get_rank()
    out_dir = Path(args.out_dir)
    for spec in specs:
        t0 = time.perf_counter()
        result = train_one(spec, args)
        result["wall_s"] = time.perf_counter() - t0
        if rank == 0:
            out = Path(spec.out) if spec.out else out_dir / f"{spec.name}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")
            log.info("[%s] done: final loss %.4f, val %.4f, median step %.3f s -> %s", spec.name,
                     result["final_loss"] or float("nan"), result["val_loss"],
                     result["median_step_time_s"] or float("nan"), out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

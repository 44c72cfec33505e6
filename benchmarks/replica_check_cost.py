"""What the snapshot's replica check (``checkpoint.verify_replicas``) costs a training step.

One ``robust run`` job per round and setting, alternated (on, off, on, off, ...) so that load from
other jobs lands on both alike: 4 ranks, DeepSpeed ZeRO 1, the text GPT (``tiny``), a memory
snapshot every step, persisted every 50. Each rank records its step times (forward to the end of
``engine.step``) and the snapshot binding's blocking (``blocking_s``: the snapshot's part in the
step plus the wait at the next optimizer step, where the replicas' verdict is waited for too).
Steps before ``--warmup`` are dropped. Per setting: medians over the rounds of each round's
per-rank mean blocking, of the per-step maximum over ranks (what the next collective waits for),
of the wait at the optimizer step, and of the step time.

Run (about 6 minutes with the defaults)::

    python benchmarks/replica_check_cost.py --rounds 4 --steps 400
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker() -> None:
    """One rank of a job (run by ``robust run`` with ``--worker``)."""
    import robust_plugins  # noqa: F401,I001  (the DeepSpeed patch, before deepspeed is used)
    import deepspeed
    import torch
    import torch.distributed as dist

    from robust_plugins.workloads import build_gpt, get_batch, load_corpus

    out, steps, verify = os.environ["RC_OUT"], int(os.environ["RC_STEPS"]), os.environ["RC_VERIFY"] == "1"
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_gpt("tiny", 0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
           "robust_plugins": {"checkpoint": {"dir": os.path.join(out, "ckpt"), "memory_every": 1,
                                             "persist_every": 50, "verify_replicas": verify}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    corpus = load_corpus(max_bytes=200_000)
    dts = []
    for step in range(1, steps + 1):
        x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world, micro_batch=4,
                         seq_len=model.cfg.seq_len)
        t0 = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        dts.append(time.perf_counter() - t0)
    mem = engine.robust_plugins.memory
    checked = mem.sdc is not None
    Path(out, f"rank{rank}.json").write_text(json.dumps({"blk": mem.blocking_s, "wait": mem.wait_s, "dts": dts,
                                                         "checked": checked}))
    dist.barrier()
    # Freed here, not at interpreter exit: a gloo group destroyed during shutdown with its threads
    # still running sometimes aborts the rank after its work is done (exit -6; docs/megatron.md).
    dist.destroy_process_group()


def summarize(run_dir: Path, warmup: int) -> dict:
    """One job's figures (ms) from its ranks' files."""
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    n = min(len(r["blk"]) for r in ranks)
    per_step_max = [max(r["blk"][k] for r in ranks) for k in range(warmup, n)]
    return {"checked": all(r["checked"] for r in ranks),
            "blocking_ms": 1e3 * statistics.mean(statistics.mean(r["blk"][warmup:]) for r in ranks),
            "slowest_rank_ms": 1e3 * statistics.mean(per_step_max),
            "wait_at_step_ms": 1e3 * statistics.mean(statistics.mean(r["wait"][warmup:]) for r in ranks),
            "step_ms": 1e3 * statistics.median(x for r in ranks for x in r["dts"][warmup:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker()
        return
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    root = Path(tempfile.mkdtemp(prefix="replica-check-cost-"))
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for rnd in range(args.rounds):
        for setting in ("on", "off"):
            work = root / f"{rnd}-{setting}"
            work.mkdir()
            env = dict(os.environ, RC_OUT=str(work), RC_STEPS=str(args.steps), RC_VERIFY="1" if setting == "on" else "0")
            cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--standalone", "--nproc-per-node",
                   str(args.nproc), "--max-restarts", "0", "--run-dir", str(work / "run"), __file__, "--worker"]
            rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
            if rc != 0:
                raise SystemExit(f"round {rnd} ({setting}) failed with exit code {rc}; see {work}/run")
            res = summarize(work, args.warmup)
            if res["checked"] != (setting == "on"):
                raise SystemExit(f"round {rnd}: verify_replicas {setting} but the check ran={res['checked']}")
            results[setting].append(res)
            print(json.dumps({"round": rnd, "setting": setting, **{k: round(v, 3) if isinstance(v, float) else v
                                                                   for k, v in res.items()}}), flush=True)
    keys = ("blocking_ms", "slowest_rank_ms", "wait_at_step_ms", "step_ms")
    print(f"\n{args.nproc} ranks, DeepSpeed ZeRO 1 tiny GPT, snapshot every step, {args.rounds} rounds of "
          f"{args.steps} steps, medians over rounds ({root})")
    print("| verify_replicas | blocking a step, rank mean | slowest rank a step | wait at the optimizer step | step time |")
    print("|---|---|---|---|---|")
    for setting in ("off", "on"):
        med = [statistics.median(r[k] for r in results[setting]) for k in keys]
        print(f"| {setting} | " + " | ".join(f"{v:.2f} ms" for v in med) + " |")
    ratio = statistics.median(r["step_ms"] for r in results["on"]) / statistics.median(r["step_ms"] for r in results["off"])
    pairs = sum(a["step_ms"] > b["step_ms"] for a, b in zip(results["on"], results["off"]))
    print(f"step time on / off: {ratio:.3f} (on slower in {pairs} of {args.rounds} rounds)")


if __name__ == "__main__":
    main()

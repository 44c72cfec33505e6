"""What ``robust run``'s recovery costs a training step, end to end, split by part.

One job per round and setting, the settings alternated within each round so that load from other
jobs lands on all alike. Each setting adds one part to the one before it:

=========  ==================================================================================
host       the same script under ``torchrun``, without the plugin (DeepSpeed: no
           ``robust_plugins`` block; plain loop: no :class:`robust_plugins.Snapshotter`)
monitor    under ``robust run``: each step's signal into the shared-memory ring and the node
           monitor beside the ranks (DeepSpeed: an empty ``robust_plugins`` block)
copy       + an in-memory snapshot every step (``memory_every: 1``), replica check off
check      + the replica check of each snapshot (``verify_replicas``, on by default): this row
           is ``robust run``'s defaults with ``memory_every: 1``
peer       + ``peer_backup`` (not a default; ``--peer``)
=========  ==================================================================================

A part's cost is the step time of its row minus the row before (:func:`split`), so the parts add
up to the defaults' overhead over the host by construction; the per-rank snapshot blocking
(``blocking_s``: the snapshot's part in the step plus the wait at the next optimizer step for the
background copy and the replicas' verdict) says how much of the copy part is spent in the step.
Hosts: DeepSpeed ZeRO-1 with the text GPT (``tiny``) and a plain PyTorch DDP loop over the same
model. Step time: forward to the end of the optimizer step and ``step_end``, per rank; the median
over ranks and steps after ``--warmup``; then the median over rounds.

Run (about 12 minutes with the defaults on the 2-core dev box)::

    python benchmarks/snapshot_cost.py --hosts ds,plain --rounds 2 --steps 150
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

SETTINGS = ("host", "monitor", "copy", "check", "peer")


def split(step_ms: dict[str, float]) -> dict[str, float]:
    """Each part's cost (ms a step): a row's step time minus the previous row's, in
    :data:`SETTINGS` order among those measured. They add up to the last row minus ``host``."""
    rows = [s for s in SETTINGS if s in step_ms]
    if not rows or rows[0] != "host":
        raise ValueError(f"split: the rows {sorted(step_ms)} must include 'host', the baseline")
    return {b: step_ms[b] - step_ms[a] for a, b in zip(rows, rows[1:])}


def ratio(step_ms: dict[str, float], setting: str = "check") -> float:
    """Step time at ``setting`` (default: robust run's defaults) over the host's."""
    return step_ms[setting] / step_ms["host"]


def _config(host: str, setting: str) -> dict | None:
    """The checkpoint block for a setting (None: no plugin at all)."""
    if setting == "host":
        return None
    if setting == "monitor":
        return {}
    return {"memory_every": 1, "verify_replicas": setting != "copy", "peer_backup": setting == "peer"}


def worker() -> None:
    """One rank of a job (``--worker``; settings from the environment)."""
    host, setting = os.environ["SC_HOST"], os.environ["SC_SETTING"]
    out, steps = Path(os.environ["SC_OUT"]), int(os.environ["SC_STEPS"])
    cfg = _config(host, setting)
    if cfg is not None:
        import robust_plugins  # noqa: F401  (the DeepSpeed patch, before deepspeed is used)
    import torch
    import torch.distributed as dist

    from robust_plugins.workloads import build_gpt, get_batch, load_corpus

    torch.set_num_threads(1)
    model = build_gpt("tiny", 0)
    corpus = load_corpus(max_bytes=200_000)
    binding = None
    if host == "ds":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6}}
        if cfg is not None:
            ds["robust_plugins"] = {"checkpoint": cfg} if cfg else {}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        binding = engine.robust_plugins.memory if cfg else None

        def step_fn(step, x, y):
            engine.backward(engine(x, y))
            engine.step()
    else:
        from robust_plugins import watchdog

        dist.init_process_group("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        if cfg:
            binding = __import__("robust_plugins").Snapshotter(ddp, opt, cfg)
        end = binding.step_end if binding is not None else watchdog.step_end

        def step_fn(step, x, y):
            loss = ddp(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            end(step, loss=loss.item())
    rank, world = dist.get_rank(), dist.get_world_size()
    dts, cpus = [], []
    for step in range(1, steps + 1):
        x, y = get_batch(corpus, "train", seed=0, step=step, rank=rank, world_size=world, micro_batch=4,
                         seq_len=model.cfg.seq_len)
        t0, c0 = time.perf_counter(), time.process_time()
        step_fn(step, x, y)
        dts.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)  # every thread of the rank: the snapshot threads too
    blk = list(binding.blocking_s) if binding is not None else []
    (out / f"rank{rank}.json").write_text(json.dumps({"dts": dts, "cpu": cpus, "blk": blk,
                                                      "checked": binding is not None and binding.sdc is not None}))
    dist.barrier()
    dist.destroy_process_group()  # not at interpreter exit: gloo threads may abort the rank then


def summarize(work: Path, warmup: int) -> dict:
    """One job's step time and snapshot blocking (ms) from its ranks' files."""
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
    blk = [x for r in ranks for x in r["blk"][warmup:]]
    return {"step_ms": 1e3 * statistics.median(x for r in ranks for x in r["dts"][warmup:]),
            "cpu_ms": 1e3 * statistics.mean(x for r in ranks for x in r["cpu"][warmup:]),
            "blocking_ms": 1e3 * statistics.mean(blk) if blk else 0.0,
            "checked": all(r["checked"] for r in ranks)}


def run_job(host: str, setting: str, work: Path, args) -> dict:
    env = dict(os.environ, SC_HOST=host, SC_SETTING=setting, SC_OUT=str(work), SC_STEPS=str(args.steps),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    if setting == "host":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               __file__, "--worker"]
    else:
        cmd = [sys.executable, "-m", "robust_plugins.cli.main", "run", "--standalone", "--nproc-per-node",
               str(args.nproc), "--max-restarts", "0", "--run-dir", str(work / "run"), __file__, "--worker"]
    with open(work / "job.log", "wb") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    if rc != 0:
        raise SystemExit(f"{host}/{setting} failed with exit code {rc}; see {work}/job.log")
    res = summarize(work, args.warmup)
    if res["checked"] != (setting in ("check", "peer")):
        raise SystemExit(f"{host}/{setting}: the replica check ran={res['checked']}, expected the opposite")
    return res


def table(host: str, rows: dict[str, list[dict]]) -> str:
    """The markdown table of one host: step time, part cost, blocking, ratio to the host; then
    the same for the rank's CPU time a step (all its threads), which other jobs' load on a shared
    box moves far less than wall time."""
    step = {s: statistics.median(r["step_ms"] for r in rs) for s, rs in rows.items()}
    cpu = {s: statistics.median(r["cpu_ms"] for r in rs) for s, rs in rows.items()}
    parts, cpu_parts = split(step), split(cpu)
    lines = [f"| {host} | step time | part (this row - previous) | snapshot blocking | x host "
             f"| CPU a step | CPU part | CPU x host |", "|---|---|---|---|---|---|---|---|"]
    for s in step:
        blk = statistics.median(r["blocking_ms"] for r in rows[s])
        part = f"{parts[s]:+.2f} ms" if s in parts else ""
        cpart = f"{cpu_parts[s]:+.2f} ms" if s in cpu_parts else ""
        lines.append(f"| {s} | {step[s]:.2f} ms | {part} | {blk:.2f} ms | {step[s] / step['host']:.3f} "
                     f"| {cpu[s]:.2f} ms | {cpart} | {cpu[s] / cpu['host']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="ds,plain", help="comma list of ds, plain")
    p.add_argument("--settings", default=",".join(SETTINGS[:-1]), help="comma list of rows (host first)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--peer", action="store_true", help="add the peer_backup row")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker()
        return
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    hosts = [h for h in args.hosts.split(",") if h]
    if not set(hosts) <= {"ds", "plain"}:
        p.error(f"--hosts {args.hosts!r}: choose among ds, plain")
    settings = [s for s in args.settings.split(",") if s] + (["peer"] if args.peer else [])
    if not settings or settings[0] != "host" or not set(settings) <= set(SETTINGS):
        p.error(f"--settings {args.settings!r}: 'host' first, then any of {SETTINGS[1:]}")
    root = Path(tempfile.mkdtemp(prefix="snapshot-cost-"))
    results = {h: {s: [] for s in settings} for h in hosts}
    for rnd in range(args.rounds):
        for host in hosts:
            for setting in settings:
                work = root / f"{rnd}-{host}-{setting}"
                work.mkdir()
                res = run_job(host, setting, work, args)
                results[host][setting].append(res)
                print(json.dumps({"round": rnd, "host": host, "setting": setting,
                                  **{k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}}),
                      flush=True)
    print(f"\n{args.nproc} ranks, tiny GPT, {args.rounds} rounds of {args.steps} steps (first {args.warmup} "
          f"dropped), medians ({root})")
    for host in hosts:
        print()
        print(table(host, results[host]))


if __name__ == "__main__":
    main()

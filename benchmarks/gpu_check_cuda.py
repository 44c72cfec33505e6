"""The one-GPU check of issues 18 and 30: the package's CUDA and NCCL paths on one device, in one call.

A task lent a GPU (one H200 so far) gets minutes of it in all, so everything is one command that
writes ``$OUT/gpu_check_cuda.json`` after every part (a run cut short returns what it finished)
and prints one line a part (``part NAME: ok | FAILED | skipped (why)``):

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check_cuda.py --out $OUT

NCCL refuses two ranks on one GPU, but a 1-rank NCCL group works:
``init_process_group("nccl", world_size=1, device_id=...)``. Parts, in order (``--parts`` picks):

``auto``        ``auto``'s probe, link collectives, group agreement and route trials on the group's
                device (CUDA on NCCL), with the warm-up per group/route;
``coord``       the checkpoint coordination collectives (JSON all-gather/broadcast, barrier);
``heatmap``     the telemetry heat-map probe;
``pipelined``   the pipelined compressed all-reduce (its all-to-all/all-gather pieces) bitwise
                equal to the unpipelined one, and WireCounter's seconds of its waits;
``threads``     ``compressed_all_reduce`` run by the package's own ``SyncThread`` (its thread on
                CPU, a side stream on CUDA), bitwise equal to the main thread's;
``timing``      the timing helper against raw CUDA events, host timers around NCCL (what they
                miss), the first collective of a new group (what the warm-up hides);
``kernels``     kernels at n = 2**31 + 256 (int64 indexing), stochastic rounding CPU vs GPU,
                ``reduce_requantize`` under ``torch.compile`` and in a CUDA graph;
``simulate``    ``simulate_all_reduce`` W = 2..8, CPU reference vs GPU kernels, bitwise;
``snapshots``, ``deepspeed``, ``megatron``: see ``gpu_check_hosts.py``;
``device``, ``overlap``, ``flight``, ``wire_async``, ``rng``, ``param_hash``, ``nvml``, ``stream_save``:
                the fault paths on NCCL (issue 30), see ``gpu_check_faults.py``;
``gloo_ranks``  two ranks on the one GPU over gloo with CUDA tensors (the paths that need a peer),
                see ``gpu_check_ranks.py``.

The check runs on the machine's last GPU (a device other than 0 where there are several: a device
index taken from 0 or the global rank then fails a part; with one GPU ``device`` says it cannot
show). Two ranks cannot share one GPU over NCCL: multi-rank paths (1-rank groups skip most
collectives) run over gloo with CUDA tensors (``gloo_ranks``) and over NCCL in
``gpu_check_multi.py``, on a node of 4 or more GPUs.

Without CUDA the distributed parts run over a 1-rank gloo group (so the script itself is tested on
CPU: ``tests/unit/test_gpu_check_cuda.py``) and the parts that need a GPU print a skip line.
Triton's interpreter is never turned on here; kernels fall back to the plain-torch reference on
CPU tensors. Kernel-vs-reference correctness on the device is ``benchmarks/gpu_check.py`` (issue 5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


import gpu_check_faults as faults  # noqa: E402
import gpu_check_hosts as hosts  # noqa: E402
import gpu_check_ranks as ranks  # noqa: E402
from gpu_check_hosts import Skip, _equal, _sync, need_cuda  # noqa: E402
from robust_plugins.watchdog.flight import recorder_env as flight_env  # noqa: E402


# -- parts ------------------------------------------------------------------------------------------


def part_auto(ctx: dict) -> dict:
    from robust_plugins.comm import auto_measure, autocodec, compressed_all_reduce
    from robust_plugins.device import collective_device
    from robust_plugins.timing import WARMUP

    dev = ctx["device"]
    want = "cuda" if ctx["backend"] == "nccl" else "cpu"
    got = collective_device(None)
    bucket = torch.randn(1 << 20 if dev.type == "cuda" else 1 << 14, device=dev)
    agreed = auto_measure._max_over_group([1.0, 2.5], None)
    tiny = torch.zeros(1, device=got)
    dist.all_reduce(tiny)  # what the link probe issues (its w > 1 branch is skipped on one rank)
    auto = autocodec.AutoCodec(candidates=("int8", "bf16_allreduce"), sample_numel=1 << 14)
    link, costs = auto_measure.probe(bucket[: auto.sample_numel], None, codecs=("int8",),
                                     block_size=auto.block_size, bf16_error_feedback=False, link_gbit=None,
                                     probe_bytes=auto.probe_bytes)

    def run(route: str, t: torch.Tensor) -> None:
        codec = route.split()[1]
        if codec == "none":
            dist.all_reduce(t)
        elif codec == "bf16_allreduce":
            from robust_plugins.comm.collectives import bf16_all_reduce
            bf16_all_reduce(t, op="sum")
        else:
            compressed_all_reduce(t, codec=codec, op="sum")

    times = auto_measure.timed_runs(bucket, ("flat none", "flat int8"), run, None, rounds=2)
    decision = auto.decide(bucket, None, run=run)
    warmed = [WARMUP.seen(("run", auto_measure.ranks_of(None), r)) for r in ("flat none", "flat int8")]
    return {"collective_device": str(got), "agreed": agreed, "link": vars(link),
            "costs": {c: vars(v) for c, v in costs.items()}, "trial_s": times, "route": decision.to_dict(),
            "checks": {"collective_device is the backend's": got.type == want,
                       "max over group": agreed == [1.0, 2.5],
                       "trial times finite and > 0": all(0 < t < 60 for v in times.values() for t in v),
                       "warm-up recorded per route": all(warmed),
                       "codec costs measured": all(v.seconds_per_element > 0 for v in costs.values())}}


def part_coord(ctx: dict) -> dict:
    from robust_plugins.checkpoint import coord

    gathered = coord.all_gather_json({"rank": 0, "x": [1, 2]}, 60.0, "gpu check")
    sent = coord.broadcast_json({"step": 7}, 60.0, "gpu check")
    coord.barrier(60.0, "gpu check")
    return {"gathered": gathered, "broadcast": sent,
            "checks": {"all_gather_json": gathered == [{"rank": 0, "x": [1, 2]}],
                       "broadcast_json": sent == {"step": 7}}}


def part_heatmap(ctx: dict) -> dict:
    from robust_plugins.telemetry import heatmap

    result = heatmap.probe(nbytes=1 << 20)
    return {"result": json.loads(json.dumps(result, default=str)), "checks": {"returned": isinstance(result, dict)}}


def part_pipelined(ctx: dict) -> dict:
    from robust_plugins.comm import WireCounter, _twophase, collectives, compressed_all_reduce

    dev = ctx["device"]
    n, piece = (1 << 24, 1 << 20) if dev.type == "cuda" else (1 << 18, 1 << 15)
    x = torch.randn(n, device=dev)
    whole = compressed_all_reduce(x.clone(), codec="int8", op="sum")  # one rank: no collective
    flat = x.clone()
    layout = _twophase.plan(n, 1, "int8", 256)
    with WireCounter(timing_only=True) as wc:
        collectives._pipelined(flat, layout, 0, None, None, None, 1.0, piece)
        _sync()
    return {"pieces": len(_twophase.pieces(layout, piece)), "calls": dict(wc.calls), "comm_s": wc.seconds,
            "checks": {"pipelined bitwise equal to unpipelined": _equal(flat, whole),
                       "collectives counted": sum(wc.calls.values()) >= 2, "comm seconds > 0": wc.seconds > 0}}


def part_threads(ctx: dict) -> dict:
    """``compressed_all_reduce`` submitted to the package's own :class:`SyncThread` (the overlap's
    runner: a background thread that sets its device first on CPU, a side stream on the
    submitting thread on CUDA), bitwise equal to the main thread's."""
    from robust_plugins.comm import compressed_all_reduce
    from robust_plugins.comm.overlap import SyncThread

    dev = ctx["device"]
    x = torch.randn(1 << 22 if dev.type == "cuda" else 1 << 16, device=dev)
    main = compressed_all_reduce(x.clone(), codec="int8", op="sum")
    got, where = x.clone(), {}

    def work() -> None:
        where["thread"] = threading.current_thread().name
        if dev.type == "cuda":
            where["device"] = torch.cuda.current_device()
            where["side_stream"] = torch.cuda.current_stream(dev) != torch.cuda.default_stream(dev)
        compressed_all_reduce(got, codec="int8", op="sum")

    sync = SyncThread("gpu-check-sync", "gpu check bucket", device=dev)
    try:
        sync.submit("b0", work, [got]).wait(120)
        _sync()
    finally:
        sync.close()
    checks = {"bitwise equal to the main thread's": _equal(got, main)}
    if dev.type == "cuda":
        checks["inline on the submitting thread"] = sync.inline and where.get("thread") == threading.current_thread().name
        checks["on the rank's device"] = where.get("device") == dev.index
        checks["on a side stream"] = where.get("side_stream") is True
    else:
        checks["on the package's own thread"] = where.get("thread") == "gpu-check-sync" and not sync.inline
    return {"where": where, "checks": checks}


def part_timing(ctx: dict) -> dict:
    need_cuda()
    from robust_plugins import timing
    from robust_plugins.comm import WireCounter

    dev = ctx["device"]
    a = torch.randn(8192, 8192, device=dev)
    for _ in range(3):
        a @ a  # warm cuBLAS
    _sync()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    clock = timing.Clock(dev).start()
    begin.record()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    host = time.perf_counter() - t0
    end.record()
    s = clock.stop()
    events = begin.elapsed_time(end) / 1e3
    buf = torch.ones(1 << 26, device=dev)  # 256 MB
    with WireCounter(timing_only=True) as wc:
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        host_ar = time.perf_counter() - t0
    ar = wc.seconds
    group = dist.new_group([0])
    first = timing.timed(lambda: dist.all_reduce(buf, group=group), dev)[1]
    second = timing.timed(lambda: dist.all_reduce(buf, group=group), dev)[1]
    return {"matmul": {"clock_s": s, "raw_events_s": events, "host_launch_s": host},
            "all_reduce_256MB": {"wire_counter_s": ar, "host_s": host_ar},
            "new_group": {"first_s": first, "second_s": second},
            "checks": {"clock within 5 % of raw events": abs(s - events) <= 0.05 * events,
                       "host timer misses the work (< half)": host < 0.5 * s,
                       "wire counter times the collective": ar > 0}}


def part_kernels(ctx: dict) -> dict:
    need_cuda()
    import triton_ops
    from triton_ops import reference as ref

    dev, checks, out = ctx["device"], {}, {}
    n, block, tail = 2**31 + 256, 256, 1 << 20
    try:
        g = torch.randn(n, device=dev, dtype=torch.bfloat16)  # 4 GB; fp32 would be 8 GB more
        codes, scales = triton_ops.quantize_ef(g, None, codec="int8", block_size=block, backend="triton")
        want_c, want_s = ref.quantize_ef(g[-tail:], None, codec="int8", block_size=block)  # the spec
        checks["quantize_ef n=2**31+256 tail equals reference"] = (
            _equal(codes[-tail:], want_c) and _equal(scales[-(tail // block):], want_s))
        back = triton_ops.dequantize(codes, scales, codec="int8", block_size=block, numel=n, backend="triton")
        want = ref.dequantize(want_c, want_s, codec="int8", block_size=block, numel=tail)
        checks["dequantize n=2**31+256 tail"] = torch.allclose(back[-tail:], want, rtol=1e-6, atol=0)
        del g, codes, scales, back
    except torch.cuda.OutOfMemoryError as exc:
        out["big"] = f"skipped: {exc}"[:300]
    torch.cuda.empty_cache()
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    cpu = ref.quantize_ef(x, None, codec="int8", block_size=256, rounding="stochastic", seed=5)
    gpu = triton_ops.quantize_ef(x.to(dev), None, codec="int8", block_size=256, rounding="stochastic", seed=5,
                                 backend="triton")
    checks["stochastic rounding CPU == GPU"] = _equal(gpu[0], cpu[0]) and _equal(gpu[1], cpu[1])
    rows = [ref.quantize_ef(torch.randn(1 << 16).to(dev), None, codec="int8", block_size=256) for _ in range(4)]
    codes_l, scales_l = [c for c, _ in rows], [s for _, s in rows]

    def rr(cs, ss):
        return triton_ops.reduce_requantize(cs, ss, codec="int8", block_size=256)

    eager = rr(codes_l, scales_l)
    compiled = torch.compile(rr, fullgraph=True)(codes_l, scales_l)
    checks["reduce_requantize torch.compile"] = _equal(compiled[0], eager[0]) and _equal(compiled[1], eager[1])
    rr(codes_l, scales_l)
    _sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = rr(codes_l, scales_l)
    graph.replay()
    _sync()
    checks["reduce_requantize CUDA graph"] = _equal(static[0], eager[0]) and _equal(static[1], eager[1])
    return {**out, "checks": checks}


def part_simulate(ctx: dict) -> dict:
    need_cuda()
    from robust_plugins.comm import _twophase

    checks = {}
    gen = torch.Generator().manual_seed(3)
    for w in range(2, 9):
        for codec in ("int8", "int4", "sign"):
            xs = [torch.randn(100_003, generator=gen) for _ in range(w)]
            cpu = _twophase.simulate_all_reduce(xs, codec=codec, block_size=256)
            gpu = _twophase.simulate_all_reduce([x.to(ctx["device"]) for x in xs], codec=codec, block_size=256)
            if codec == "sign":  # sign's scales may differ by 2**-20 relative (a sum's order): gpu_check.py
                checks[f"W={w} sign within 2**-20"] = torch.allclose(gpu.cpu(), cpu, rtol=2.0**-20, atol=0)
            else:
                checks[f"W={w} {codec} bitwise"] = _equal(gpu, cpu)
    return {"checks": checks}


def _host_parts() -> dict[str, Callable[[dict], dict]]:
    return {"snapshots": hosts.part_snapshots, "deepspeed": hosts.part_deepspeed, "megatron": hosts.part_megatron}


PARTS = ("auto", "coord", "heatmap", "pipelined", "threads", "timing", "kernels", "simulate",
         "snapshots", "deepspeed", "megatron", *faults.PARTS, *ranks.PARTS)


def _init_group() -> tuple[str, torch.device]:
    if torch.cuda.is_available():
        # The last GPU: with more than one, a device index taken from 0 or the global rank
        # anywhere in the package shows as a failure (gpu_check_faults.part_device).
        dev = torch.device("cuda", torch.cuda.device_count() - 1)
        torch.cuda.set_device(dev)
        # What `robust run` gives its ranks: a flight recorder that records (part flight).
        for name, value in flight_env(os.environ).items():
            os.environ.setdefault(name, value)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
        return "nccl", dev
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return "gloo", torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check_cuda.json")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--snapshot-gb", type=float, default=4.0, help="CUDA state size of the snapshot part")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip the parts left after this long")
    args = parser.parse_args(argv)
    wanted = [p for p in args.parts.split(",") if p]
    bad = [p for p in wanted if p not in PARTS]
    if bad:
        parser.error(f"unknown parts {bad}; allowed: {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check_cuda.json"
    if os.environ.get("TRITON_INTERPRET") == "1" and torch.cuda.is_available():
        print("TRITON_INTERPRET=1 with a GPU present: unset it, the check must run the compiled kernels")
        return 2
    t_start = time.monotonic()
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "env": {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
                    "parts": {}}
    backend, device = _init_group()
    report["env"]["backend"] = backend
    ctx = {"device": device, "backend": backend, "out": args.out, "snapshot_gb": args.snapshot_gb}
    fns = {**{p: globals()[f"part_{p}"] for p in PARTS[:8]}, **_host_parts(), **faults.PARTS, **ranks.PARTS}
    # What `robust run` sets; memory snapshots (the deepspeed part's memory_every) refuse to run without.
    os.environ.setdefault("ROBUST_JOB_ID", f"gpu-check-{os.getpid()}")
    failed = False
    for name in wanted:
        t0 = time.perf_counter()
        if time.monotonic() - t_start > args.budget_s:
            res = {"status": "skipped", "reason": f"time budget of {args.budget_s:.0f} s spent"}
        else:
            try:
                res = fns[name](ctx)
                ok = all(res.get("checks", {}).values())
                res["status"] = "ok" if ok else "FAILED"
            except Skip as why:
                res = {"status": "skipped", "reason": str(why)}
            except Exception:
                res = {"status": "FAILED", "error": traceback.format_exc()[-4000:]}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next part starts from free memory (snapshots: GBs)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        failed |= res["status"] == "FAILED"
        report["parts"][name] = res
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        why = f" ({res['reason']})" if res["status"] == "skipped" else ""
        bad_checks = [k for k, v in res.get("checks", {}).items() if not v]
        extra = f" failed checks: {bad_checks}" if bad_checks else (" error" if res.get("error") else "")
        print(f"part {name}: {res['status']}{why}{extra} [{res['seconds']} s]", flush=True)
    dist.destroy_process_group()
    counts = {k: sum(r["status"] == k for r in report["parts"].values()) for k in ("ok", "FAILED", "skipped")}
    tally = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    gap = " - the skipped parts did NOT run: not a GPU result" if counts["skipped"] else ""
    print("GPU CHECK (issues 18, 30)", "FAILED" if failed else "PASSED", f"({tally}){gap}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

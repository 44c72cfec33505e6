"""Multi-rank parts of the one-GPU check (``gpu_check_cuda.py``): two ranks on the one GPU over gloo
with CUDA tensors, through the package's own entry points.

NCCL refuses two ranks on one device ("Duplicate GPU detected"), so on a one-GPU machine the paths
that need a peer (the compressed all-reduce's all-to-all and all-gather, the coordination
collectives, the auto codec's group agreement, WireCounter's bytes) run here over gloo, which moves
CUDA tensors for the collectives it implements for them. Each rank writes what it saw to
``<out>/ranks/rank<R>.json``; a collective gloo does not implement for CUDA tensors is recorded
under ``unsupported`` (torch's limit, said, not counted against the package).

:func:`rank_checks` takes its device type, so ``tests/unit/test_gpu_check_cuda.py`` runs the same
two ranks on CPU tensors; on a GPU, :func:`part_gloo_ranks` runs them on the check's device.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_check_hosts import need_cuda

WORLD = 2

#: What gloo answers for a collective it has no CUDA implementation of (torch 2.4-2.13).
_UNSUPPORTED = ("not supported", "unsupported", "only supports cpu", "no backend type associated")


def _inputs(numel: int, device: torch.device) -> list[torch.Tensor]:
    """Every rank's input, made the same way on each (each rank can compute the expected result)."""
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)).to(device) for r in range(WORLD)]


def rank_checks(rank: int, world: int, device_type: str) -> dict:
    """The checks of one rank of an initialized gloo group of :data:`WORLD` ranks, its tensors on
    ``device_type`` (the current CUDA device for cuda): ``checks``, ``unsupported``, ``numbers``."""
    from robust_plugins.checkpoint import coord
    from robust_plugins.comm import WireCounter, _twophase, compressed_all_reduce
    from robust_plugins.comm.auto_measure import _max_over_group
    from robust_plugins.comm.collectives import bf16_all_reduce
    from robust_plugins.device import collective_device

    if world != WORLD:
        raise ValueError(f"gpu_check_ranks runs {WORLD} ranks, not {world}")
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    checks, unsupported, numbers = {}, {}, {}
    xs = _inputs(1 << 16, device)

    def attempt(name, fn):
        try:
            checks[name] = bool(fn())
        except Exception as exc:
            text = str(exc).lower()
            if any(s in text for s in _UNSUPPORTED):
                unsupported[name] = str(exc)[:300]
            else:
                checks[name] = False
                numbers[f"{name} error"] = traceback.format_exc()[-1500:]

    def compressed():
        with WireCounter() as wc:
            got = compressed_all_reduce(xs[rank].clone(), codec="int8", op="sum", block_size=256)
        numbers["int8 bytes_sent"], numbers["int8 calls"] = wc.bytes_sent, dict(wc.calls)
        want = _twophase.simulate_all_reduce([x.clone() for x in xs], codec="int8", block_size=256, op="sum")
        return got.device == device and torch.equal(got, want) and wc.bytes_sent > 0

    def bf16():
        got = bf16_all_reduce(xs[rank].clone(), op="sum")
        want = (xs[0].to(torch.bfloat16) + xs[1].to(torch.bfloat16)).float()
        return got.device == device and torch.allclose(got, want, rtol=1e-2, atol=1e-2)

    def plain():
        got = xs[rank].clone()
        dist.all_reduce(got)
        return torch.allclose(got, xs[0] + xs[1])

    attempt("all_reduce of CUDA tensors" if device.type == "cuda" else "all_reduce", plain)
    attempt("int8 compressed all-reduce equals the simulation", compressed)
    attempt("bf16 all-reduce", bf16)
    attempt("collective_device is gloo's (cpu)", lambda: collective_device().type == "cpu")
    attempt("coordination all_gather_json", lambda: coord.all_gather_json({"r": rank}, 60.0, "gpu check")
            == [{"r": r} for r in range(WORLD)])
    attempt("coordination broadcast_json", lambda: coord.broadcast_json({"step": 7} if rank == 0 else None, 60.0,
                                                                        "gpu check") == {"step": 7})
    attempt("coordination on the tensors' device", lambda: coord.all_gather_json(rank, 60.0, "gpu check",
                                                                                device=device) == [0, 1])
    attempt("auto codec's agreement (max over the group)",
            lambda: _max_over_group([float(rank), 1.0 - rank], None) == [1.0, 1.0])
    return {"checks": checks, "unsupported": unsupported, "numbers": numbers}


def merge(reports: list[dict]) -> dict:
    """The ranks' reports as one (pure): a check holds when it held on every rank."""
    names = sorted({k for rep in reports for k in rep["checks"]})
    return {"checks": {k: all(rep["checks"].get(k, False) for rep in reports) for k in names},
            "unsupported": {k: v for rep in reports for k, v in rep["unsupported"].items()},
            "numbers": reports[0]["numbers"]}


def _rank(rank: int, port: int, out: str, device_type: str) -> None:
    """One rank: gloo over TCP on this host, its tensors on ``device_type`` (the last GPU for cuda)."""
    if device_type == "cuda":
        torch.cuda.set_device(torch.cuda.device_count() - 1)  # the check's device
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        report = rank_checks(rank, WORLD, device_type)
    finally:
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report, default=str))


def run_ranks(out: Path, device_type: str, timeout_s: float = 240.0) -> dict:
    """Run the two ranks (spawned, bounded by ``timeout_s``); their reports :func:`merge`-d."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_rank, args=(port, str(out), device_type), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {WORLD} gloo ranks did not finish in {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
    return merge([json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)])


def part_gloo_ranks(ctx: dict) -> dict:
    """Two ranks on the check's GPU over gloo with CUDA tensors (module docstring)."""
    need_cuda()
    return run_ranks(Path(ctx["out"]) / "ranks", "cuda")


PARTS = {"gloo_ranks": part_gloo_ranks}

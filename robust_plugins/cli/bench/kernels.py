"""``robust bench kernels``: throughput of the codec kernels against a plain copy of the same bytes.

For each bucket (fp32 gradient bytes, 1 MB to 1 GB on a GPU), codec and kernel it times
``quantize_ef`` (gradient + residual in; codes, scales and residual out), ``dequantize`` (codes
and scales in, fp32 out) and ``reduce_requantize`` (``--world`` ranks' chunks and the residual
in; codes, scales and residual out). A kernel's bytes are the least any implementation must move
(each input read once, each output written once); GB/s is those bytes over the median time, and
"of copy" compares it with ``dst.copy_(src)`` moving the same number of bytes (half read, half
written) measured in the same run.

* On a GPU: the Triton kernels, the eager torch reference and ``torch.compile`` of the reference,
  each with "of copy" and "vs eager" (the speed-up over the eager reference).
* On CPU: the eager reference only (what CPU tensors run), relative to the copy.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from robust_plugins.cli._runs import format_table
from robust_plugins.cli.bench.writer import write_section
from robust_plugins.errors import ConfigError

SECTION = "kernels"
KERNELS = ("quantize_ef", "dequantize", "reduce_requantize")
GPU_SIZES_MB = (1, 4, 16, 64, 256, 1024)
CPU_SIZES_MB = (1, 4, 16, 64)
COLUMNS = ["bucket", "kernel", "codec", "implementation", "ms", "GB/s", "copy GB/s", "of copy", "vs eager"]
GPU_TARGET = "Targets (H100/H200): the Triton kernels at >= 80 % of copy bandwidth for buckets of 64 MB and more, and >= 3x the eager reference."
NOTES = (
    "Bucket: fp32 gradient bytes (for reduce_requantize: the chunk one rank reduces). Bytes moved: "
    "quantize_ef reads gradient and residual and writes residual, codes and scales; dequantize reads codes "
    "and scales and writes fp32; reduce_requantize reads every rank's codes and scales and the residual and "
    "writes residual, codes and scales. GB/s = those bytes / median time (1 GB = 1e9 B); of copy = that over "
    "the GB/s of `dst.copy_(src)` moving the same bytes (half read, half written), timed in the same run. "
    "Time: on a GPU the median of 20 calls (CUDA events); on CPU the fastest of at least 5 calls (and 0.3 s), "
    "because other jobs share the cores and a median there measures their load as much as the code."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``kernels`` under ``robust bench``."""
    p = sub.add_parser("kernels", help="codec kernels' GB/s against a copy of the same bytes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to run (default: cuda when available)")
    p.add_argument("--sizes-mb", type=float, nargs="+",
                   help=f"buckets in MB of fp32 gradient (default GPU {' '.join(map(str, GPU_SIZES_MB))}; "
                        f"CPU {' '.join(map(str, CPU_SIZES_MB))})")
    p.add_argument("--codecs", nargs="+", default=["int8", "int4", "sign"], choices=["int8", "int4", "sign", "bf16"])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--block-size", type=int, default=256, help="elements a scale (default 256)")
    p.add_argument("--world", type=int, default=4, help="ranks whose chunks reduce_requantize sums (default 4)")
    p.add_argument("--repeats", type=int,
                   help="timed calls a measurement (default GPU 20, median taken; CPU 5, fastest taken)")
    p.add_argument("--no-compile", action="store_true", help="GPU: skip torch.compile of the reference")
    p.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's rows in e.g. BENCHMARKS.md")
    p.set_defaults(_bench=run_kernels)


def traffic_bytes(kernel: str, n: int, codec: str, block_size: int, world: int) -> int:
    """Least bytes ``kernel`` must read plus write for ``n`` fp32 elements."""
    from triton_ops import reference as ref

    wire = ref.wire_nbytes(n, codec=codec, block_size=block_size)
    if kernel == "quantize_ef":
        return 3 * 4 * n + wire
    if kernel == "dequantize":
        return wire + 4 * n
    return world * wire + 2 * 4 * n + wire


def seconds_per_call(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Time of ``fn`` after one warm-up call: CUDA the median of ``repeats`` (events, synchronised);
    CPU the fastest of ``repeats``, since other processes preempting a call only ever add time."""
    fn()
    times: list[float] = []
    # CPU: at least `repeats` calls and 0.3 s of them (at most 100 calls), so that short calls get
    # enough chances at an unpreempted run on a shared machine.
    while len(times) < repeats or (device.type != "cuda" and sum(times) < 0.3 and len(times) < 100):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if device.type == "cuda" else min(times)


def _received(parts, device):
    """Chunks as rows ``[codes | scales]`` of one buffer, as the all-to-all delivers them."""
    rows = torch.stack([torch.cat((c.view(torch.uint8), s.view(torch.uint8))) for c, s in parts]).to(device)
    n_code = parts[0][0].view(torch.uint8).numel()
    dtype = parts[0][0].dtype
    return [r[:n_code].view(dtype) for r in rows], [r[n_code:].view(torch.float32) for r in rows]


def _callables(kernel: str, n: int, codec: str, bs: int, world: int, device: torch.device) -> dict[str, Callable]:
    """``{implementation: zero-argument call}`` for one measurement; inputs are made once here."""
    import triton_ops
    from triton_ops import reference as ref

    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen).to(device)
    residual = torch.zeros(n, device=device)
    impls = ["reference"] if device.type != "cuda" else ["reference", "compiled", "triton"]
    calls: dict[str, Callable] = {}
    if kernel == "quantize_ef":
        ops = {b: functools.partial(triton_ops.quantize_ef, codec=codec, block_size=bs, backend=b)
               for b in ("reference", "triton")}
        ops["compiled"] = _compiled(functools.partial(ref.quantize_ef, codec=codec, block_size=bs))
        calls = {i: functools.partial(ops[i], grad, residual) for i in impls}
    elif kernel == "dequantize":
        codes, scales = ref.quantize(grad, codec=codec, block_size=bs)
        out = torch.empty(n, device=device)
        ops = {b: functools.partial(triton_ops.dequantize, codec=codec, block_size=bs, numel=n, out=out, backend=b)
               for b in ("reference", "triton")}
        ops["compiled"] = _compiled(functools.partial(ref.dequantize, codec=codec, block_size=bs, numel=n, out=out))
        calls = {i: functools.partial(ops[i], codes, scales) for i in impls}
    else:
        parts = [ref.quantize(torch.randn(n, generator=gen).to(device), codec=codec, block_size=bs)
                 for _ in range(world)]
        codes_list, scales_list = _received(parts, device)
        kw = dict(codec=codec, block_size=bs, residual=residual, scale_factor=1.0 / world)
        ops = {b: functools.partial(triton_ops.reduce_requantize, backend=b, **kw) for b in ("reference", "triton")}
        ops["compiled"] = _compiled(functools.partial(ref.reduce_requantize, **kw))
        calls = {i: functools.partial(ops[i], codes_list, scales_list) for i in impls}
    return calls


def _compiled(fn: Callable) -> Callable:
    # dynamic=True: one compilation serves every bucket size instead of one per size.
    return torch.compile(fn, dynamic=True) if torch.cuda.is_available() else fn


def measure(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    """Time every (bucket, kernel, codec, implementation); return the table rows."""
    sizes = args.sizes_mb or (GPU_SIZES_MB if device.type == "cuda" else CPU_SIZES_MB)
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    rows = []
    for mb in sizes:
        n = max(args.block_size, int(mb * 2**20) // 4 // (args.block_size * args.world) * args.block_size * args.world)
        label = f"{mb:g} MB"
        copy_gbps: dict[int, float] = {}

        def copy_rate(nbytes: int) -> float:
            # The copy moves nbytes: nbytes / 2 read and nbytes / 2 written.
            if nbytes not in copy_gbps:
                src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).fill_(1)
                dst = torch.empty_like(src)
                copy_gbps[nbytes] = nbytes / seconds_per_call(lambda: dst.copy_(src), device, repeats) / 1e9
            return copy_gbps[nbytes]

        for kernel in args.kernels:
            for codec in args.codecs:
                nbytes = traffic_bytes(kernel, n, codec, args.block_size, args.world)
                copy = copy_rate(nbytes)
                calls = _callables(kernel, n, codec, args.block_size, args.world, device)
                if args.no_compile:
                    calls.pop("compiled", None)
                eager = None
                for impl, call in calls.items():
                    seconds = seconds_per_call(call, device, repeats)
                    gbps = nbytes / seconds / 1e9
                    eager = seconds if impl == "reference" else eager
                    name = {"reference": "eager reference", "compiled": "torch.compile(reference)",
                            "triton": "Triton"}[impl]
                    rows.append([label, kernel, codec, name, f"{seconds * 1e3:.3f}", f"{gbps:.2f}", f"{copy:.2f}",
                                 f"{gbps / copy * 100:.1f} %", f"{eager / seconds:.2f}x" if eager else "-"])
                    print(" | ".join(rows[-1]), flush=True)
    return rows


def device_line(device: torch.device) -> str:
    """The machine, in words."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"CPU: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs; load average "
            f"{load} at the end of the run), Python {platform.python_version()}, torch {torch.__version__}")


def run_kernels(args: argparse.Namespace) -> int:
    """Measure on the chosen device; print the table and maybe write it into the markdown file."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here; use --device cpu.")
    if args.world < 1 or args.block_size < 8 or args.block_size % 8:
        raise ConfigError(f"--world {args.world} must be >= 1 and --block-size {args.block_size} a multiple of 8.")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    rows = measure(args, device)
    print(format_table(COLUMNS, rows))
    if args.write:
        command = f"robust bench kernels --device {device.type} --block-size {args.block_size} --world {args.world}"
        if args.sizes_mb:
            command += " --sizes-mb " + " ".join(f"{s:g}" for s in args.sizes_mb)
        command += f" --write {args.write}"
        body = "\n".join([
            f"Command: `{command}`  ",
            f"Date: {datetime.date.today().isoformat()}  ",
            f"Device: {device_line(device)}",
            "",
            format_table(COLUMNS, rows, markdown=True),
        ])
        path = Path(args.write)
        ensure_kernels_section(path)
        write_section(path, f"{SECTION}-{'gpu' if use_cuda else 'cpu'}", body)
        print(f"wrote the {device.type} rows of the {SECTION} section of {args.write}")
    return 0


def ensure_kernels_section(path: Path) -> None:
    """Create the ``kernels`` section (CPU and GPU parts, GPU marked not measured) if it is missing.

    Each device's rows sit between their own inner markers, so a CPU run keeps earlier GPU rows and
    the other way round.
    """
    text = path.read_text() if path.exists() else ""
    if f"<!-- bench:{SECTION}:start -->" in text:
        return
    body = "\n".join([
        "Fused Triton kernels (`triton_ops`) against the plain-torch reference and a device copy of the same bytes.",
        "",
        NOTES,
        "",
        "### GPU",
        "",
        GPU_TARGET,
        "",
        f"<!-- bench:{SECTION}-gpu:start -->",
        "Command: `robust bench kernels --device cuda --write BENCHMARKS.md`  ",
        "Not measured yet (no GPU in this session): Triton, eager reference and torch.compile(reference) rows "
        "for buckets of 1 MB to 1 GB.",
        f"<!-- bench:{SECTION}-gpu:end -->",
        "",
        "### CPU (the reference path that CPU tensors run)",
        "",
        f"<!-- bench:{SECTION}-cpu:start -->",
        "Not measured yet.",
        f"<!-- bench:{SECTION}-cpu:end -->",
    ])
    write_section(path, SECTION, body, title="Codec kernels")

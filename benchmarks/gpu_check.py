"""The one prepared GPU check of issue 5: kernels vs the reference on the device, then their speed.

A task lent a GPU gets a few minutes of it in all, so everything the GPU has to answer is in one
command (the ``device`` tool's ``run``; $OUT is the folder whose files come back):

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT

It needs only torch and triton (the GPU image has both; deepspeed, megatron-core and wandb are not
imported), and does, in order, writing ``$OUT/gpu_check.json`` after each part so that a run cut
short still returns what it finished:

1. ``env``: GPU name, driver, torch / triton versions.
2. ``match``: each Triton kernel on the device against the plain-torch reference on the same
   device tensors (the specification): the issue's sizes (1, 31, 257, 4,099, 100,003) plus one of
   64 Mi elements, every codec, fp32 / bf16 / fp16 inputs, all-zero blocks, NaN/Inf propagation,
   ``reduce_requantize`` for 2, 3 and 8 ranks. Same criteria as ``tests/unit/triton_kernels_cases.py``:
   codes and scales bit-identical (``sign`` scales within 2**-20 relative), residuals equal to
   fp32 rounding.
3. ``compose``: ``torch.compile`` of a function calling the custom ops, and a CUDA graph capture
   and replay of ``quantize_ef``, each compared with the eager result.
4. ``bench``: ``robust bench kernels --device cuda --write $OUT/BENCHMARKS.md`` (a copy of the
   repository's file, its GPU block rewritten), bounded by ``--bench-timeout``.

Without a GPU it runs parts 1-3 on CPU tensors in Triton's interpreter (small sizes only), which is
how it was checked before any GPU was lent: ``python benchmarks/gpu_check.py --out /tmp/gc``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA_HINT = shutil.which("nvidia-smi") is not None
if not HAS_CUDA_HINT:
    # The interpreter must be chosen before the first kernel module is imported (Triton reads it
    # when @triton.jit decorates a function).
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import triton_ops  # noqa: E402
from triton_ops import reference as ref  # noqa: E402

CODECS = ("int8", "int4", "sign", "bf16")
SIGN_SCALE_RTOL = 2.0**-20


def _env() -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # reported, and every later part will say the same
        info["triton"] = f"not importable: {exc}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip()
    else:
        info["gpu"] = None
        info["note"] = "no CUDA device: Triton's CPU interpreter, small sizes only"
    return info


def _compare(name: str, got: tuple, want: tuple, codec: str) -> str | None:
    (gc, gs), (wc, ws) = got, want
    if gc.dtype == torch.bfloat16 and gc.shape == wc.shape:
        # NaN bit patterns may differ between torch's vectorised and scalar casts; any NaN is a NaN.
        nan = torch.isnan(wc)
        same = torch.equal(torch.isnan(gc), nan) and torch.equal(gc.view(torch.int16)[~nan], wc.view(torch.int16)[~nan])
    else:
        same = torch.equal(gc, wc)
    if not same:
        diff = (gc.view(torch.uint8) != wc.view(torch.uint8)).sum().item() if gc.shape == wc.shape else "shape"
        return f"{name}: codes differ ({diff} bytes of {wc.numel()})"
    if codec == "sign":
        ok = torch.allclose(gs, ws, rtol=SIGN_SCALE_RTOL, atol=0, equal_nan=True)
    else:
        ok = torch.equal(gs, ws) or torch.equal(gs.isnan(), ws.isnan()) and torch.equal(
            gs.nan_to_num(), ws.nan_to_num())
    return None if ok else f"{name}: scales differ (max {(gs - ws).abs().max().item():.3g})"


def _match(device: torch.device, big: bool) -> dict:
    sizes = [(1, 32), (31, 32), (257, 64), (4099, 96), (4099, 4096), (100_003, 512)]
    if big:
        sizes.append((64 * 2**20, 256))
    failures, cases = [], 0
    gen = torch.Generator(device="cpu").manual_seed(0)
    for numel, block in sizes:
        padded = -(-numel // block) * block
        for codec in CODECS:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                grad = torch.zeros(padded)
                grad[:numel] = torch.randn(numel, generator=gen)
                if numel > block:
                    grad[:block] = 0.0  # an all-zero block
                grad = grad.to(device=device, dtype=dtype)
                res0 = (torch.randn(padded, generator=gen) * 0.01).to(device)
                r_t, r_r = res0.clone(), res0.clone()
                got = triton_ops.quantize_ef(grad, r_t, codec=codec, block_size=block, backend="triton")
                want = triton_ops.quantize_ef(grad, r_r, codec=codec, block_size=block, backend="reference")
                cases += 1
                name = f"quantize_ef {codec} n={numel} b={block} {str(dtype)[6:]}"
                err = _compare(name, got, want, codec)
                if err is None and not torch.allclose(r_t, r_r, rtol=1e-6, atol=1e-6):
                    err = f"{name}: residual max diff {(r_t - r_r).abs().max().item():.3g}"
                if err is None:
                    d_t = triton_ops.dequantize(*want, codec=codec, block_size=block, numel=padded, backend="triton")
                    d_r = triton_ops.dequantize(*want, codec=codec, block_size=block, numel=padded,
                                                backend="reference")
                    cases += 1
                    if not torch.allclose(d_t, d_r, rtol=1e-6, atol=0):
                        err = f"dequantize {codec} n={numel} b={block}: max diff {(d_t - d_r).abs().max().item():.3g}"
                if err:
                    failures.append(err)
                del grad, res0, r_t, r_r
        # NaN / Inf propagate as the reference says, block by block.
        if padded >= 2 * block:
            for codec in CODECS:
                grad = torch.randn(padded, generator=gen)
                grad[3] = float("nan")
                grad[block + 1] = float("inf")
                grad = grad.to(device)
                got = triton_ops.quantize_ef(grad, torch.zeros_like(grad), codec=codec, block_size=block,
                                             backend="triton")
                want = triton_ops.quantize_ef(grad, torch.zeros_like(grad), codec=codec, block_size=block,
                                              backend="reference")
                cases += 1
                err = _compare(f"non-finite {codec} n={numel} b={block}", got, want, codec)
                if err:
                    failures.append(err)
    for world in (2, 3, 8):
        for codec in CODECS:
            numel, block = (4 * 2**20, 256) if big else (4096, 64)
            encoded = [ref.quantize_ef(torch.randn(numel, generator=gen).to(device), None, codec=codec,
                                       block_size=block) for _ in range(world)]
            codes = [c for c, _ in encoded]
            scales = [s for _, s in encoded]
            res = torch.zeros(numel, device=device)
            r_t, r_r = res.clone(), res.clone()
            got = triton_ops.reduce_requantize(codes, scales, codec=codec, block_size=block, residual=r_t,
                                               backend="triton")
            want = triton_ops.reduce_requantize(codes, scales, codec=codec, block_size=block, residual=r_r,
                                                backend="reference")
            cases += 1
            name = f"reduce_requantize {codec} world={world}"
            err = _compare(name, got, want, codec)
            if err is None and not torch.allclose(r_t, r_r, rtol=1e-5, atol=1e-6):
                err = f"{name}: residual max diff {(r_t - r_r).abs().max().item():.3g}"
            if err:
                failures.append(err)
    return {"cases": cases, "failures": failures, "ok": not failures}


def _compose(device: torch.device) -> dict:
    out: dict = {}
    numel, block, codec = 1 << 16, 256, "int8"
    grad = torch.randn(numel, device=device)

    def encode_decode(g, r):
        c, s = triton_ops.quantize_ef(g, r, codec=codec, block_size=block)
        return triton_ops.dequantize(c, s, codec=codec, block_size=block, numel=numel)

    eager = encode_decode(grad, torch.zeros_like(grad))
    try:
        compiled = torch.compile(encode_decode, fullgraph=True)(grad, torch.zeros_like(grad))
        out["torch_compile"] = "equal" if torch.equal(compiled, eager) else "DIFFERENT"
    except Exception as exc:
        out["torch_compile"] = f"failed: {type(exc).__name__}: {exc}"[:500]
    if device.type == "cuda":
        try:
            static_g, static_r = grad.clone(), torch.zeros_like(grad)
            encode_decode(static_g, static_r.clone())  # warm-up compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = encode_decode(static_g, static_r)
            static_r.zero_()
            graph.replay()
            torch.cuda.synchronize()
            out["cuda_graph"] = "equal" if torch.equal(static_out, eager) else "DIFFERENT"
        except Exception as exc:
            out["cuda_graph"] = f"failed: {type(exc).__name__}: {exc}"[:500]
    else:
        out["cuda_graph"] = "not run (no CUDA device)"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and BENCHMARKS.md")
    parser.add_argument("--bench-timeout", type=float, default=300.0, help="seconds for the benchmark part")
    parser.add_argument("--skip-bench", action="store_true", help="only the correctness parts")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    path = args.out / "gpu_check.json"

    def save() -> None:
        path.write_text(json.dumps(report, indent=2) + "\n")

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ[triton_ops.ENV_TRITON_ON_CPU] = "1"
    report["env"] = _env()
    save()
    print(json.dumps(report["env"]), flush=True)
    for part, fn in (("match", lambda: _match(device, big=cuda)), ("compose", lambda: _compose(device))):
        t0 = time.perf_counter()
        try:
            report[part] = fn()
        except Exception:
            report[part] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        report[part]["seconds"] = round(time.perf_counter() - t0, 1)
        save()
        print(part, json.dumps(report[part])[:3000], flush=True)
    if cuda and not args.skip_bench:
        shutil.copy(ROOT / "BENCHMARKS.md", args.out / "BENCHMARKS.md")
        cmd = [sys.executable, "-m", "robust_plugins.cli.main", "bench", "kernels", "--device", "cuda",
               "--write", str(args.out / "BENCHMARKS.md")]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.bench_timeout,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            report["bench"] = {"rc": done.returncode, "stdout": done.stdout[-8000:], "stderr": done.stderr[-3000:]}
        except subprocess.TimeoutExpired as exc:
            report["bench"] = {"rc": None, "error": f"timed out after {args.bench_timeout} s",
                               "stdout": (exc.stdout or b"")[-8000:].decode(errors="replace")
                               if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-8000:]}
        report["bench"]["seconds"] = round(time.perf_counter() - t0, 1)
        save()
        print(report["bench"].get("stdout", ""), report["bench"].get("stderr", ""), flush=True)
    ok = report["match"].get("ok") and all(
        v in ("equal", "not run (no CUDA device)") for k, v in report["compose"].items() if k != "seconds")
    print("GPU CHECK", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

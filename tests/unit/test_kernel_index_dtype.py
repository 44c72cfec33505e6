"""Index arithmetic in the Triton kernels is int64 where it can pass 2**31 (read from the source).

The interpreter cannot run rows that start past 2**31 bytes here (it would need several GB per
case), so this reads the kernels: no product with a row stride (``*_stride``) is left in int32
(an operand cast with ``.to(tl.int64)``, or no product at all: ``reduce_requantize`` advances a
64-bit pointer by one stride a rank), and the element index every kernel uses
(``_tile.tile_index``) is computed from int64 rows. Triton passes a stride below 2**31 as int32
and a loop counter is int32, so ``r * codes_stride`` wraps once ``r * stride >= 2**31``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "triton_ops" / "kernels"


def _is_int64_cast(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
            and len(node.args) == 1 and ast.unparse(node.args[0]) == "tl.int64")


def _jit_functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def stride_products_without_int64(source: str) -> list[str]:
    """``a * x_stride`` products in ``@triton.jit`` functions whose other operand is not int64 (pure)."""
    bad = []
    for fn in _jit_functions(ast.parse(source)):
        int64_names = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and _is_int64_cast(n.value)
                       for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            if not (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)):
                continue
            for side, other in ((n.left, n.right), (n.right, n.left)):
                if isinstance(side, ast.Name) and side.id.endswith("_stride"):
                    if not (_is_int64_cast(other) or (isinstance(other, ast.Name) and other.id in int64_names)):
                        bad.append(f"{fn.name}:{n.lineno}: {ast.unparse(n)}")
    return bad


def test_row_offsets_are_int64_in_every_kernel():
    sources = sorted(KERNELS.glob("*.py"))
    assert any("_stride" in p.read_text() for p in sources)  # the check has something to check
    rr = (KERNELS / "reduce_requantize.py").read_text()
    assert "codes_row += codes_stride" in rr and "scales_row += scales_stride" in rr
    bad = [f"{p.name}:{b}" for p in sources for b in stride_products_without_int64(p.read_text())]
    assert not bad, "row offsets computed in int32 (wrap past 2**31):\n" + "\n".join(bad)


def test_the_check_catches_the_int32_product():
    old = '''
@triton.jit
def k(codes_ptr, codes_stride, world):
    for r in range(world):
        x = tl.load(codes_ptr + r * codes_stride)
'''
    new = old.replace("        x = tl.load(codes_ptr + r * codes_stride)",
                      "        r64 = r.to(tl.int64)\n        x = tl.load(codes_ptr + r64 * codes_stride)")
    assert stride_products_without_int64(old) == ["k:5: r * codes_stride"]
    assert stride_products_without_int64(new) == []


def test_element_indices_come_from_int64_rows():
    fn = next(f for f in _jit_functions(ast.parse((KERNELS / "_tile.py").read_text())) if f.name == "tile_index")
    grp = next(n for n in ast.walk(fn) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "grp")
    assert any(_is_int64_cast(n) for n in ast.walk(grp.value)), ast.unparse(grp)


@pytest.mark.timeout(120)
def test_every_op_runs_its_implementation_on_the_tensors_own_device(monkeypatch):
    """Triton launches on the current device: each op makes the tensors' device current for the call
    (a CUDA device guard; nothing for the CPU), whatever the calling thread's current device is."""
    import contextlib

    import torch

    from triton_ops import ops

    guard = ops._device_guard(torch.device("cuda", 3))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 3  # built without touching CUDA
    assert isinstance(ops._device_guard(torch.device("cpu")), contextlib.nullcontext)
    entered = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device.type)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(ops, "_device_guard", Guard)
    g = torch.randn(512)
    codes, scales = ops.quantize_ef(g, None, codec="int8", block_size=256)
    ops.dequantize(codes, scales, codec="int8", block_size=256, numel=512)
    ops.reduce_requantize([codes, codes], [scales, scales], codec="int8", block_size=256)
    assert entered == ["cpu", "cpu", "cpu"]

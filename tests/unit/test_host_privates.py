"""Core (``robust_plugins/``) names no host internal by string or private import: host modules,
private attributes by literal name and private imports are found by reading the code (AST), and
every one must be on this file's list with the reason it stays in core. A new one fails here:
put it behind ``patches/`` (with a version guard) or add it below with its reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "robust_plugins"
#: Dotted module paths of hosts (plain roots such as "deepspeed" are names, not internals).
HOST_MODULE = re.compile(r"^(deepspeed|megatron|transformers|accelerate|torch\.distributed\.elastic)(\.\w+)+$")
PRIVATE_ROOTS = ("torch", "deepspeed", "megatron", "transformers", "accelerate")

#: (file under robust_plugins/, what) -> why it stays in core.
ALLOWED = {
    ("_hooks.py", "transformers.trainer"):
        "the post-import hook waits for this module to be imported; it is the patch's trigger",
    ("checkpoint/flat.py", "_fields"): "namedtuple's documented API, not a private",
    ("comm/wire.py", "_world"):
        "torch.distributed's coalescing state (the counter times a block's collective); "
        "read with getattr, None when absent: the call is timed at its launch",
    ("comm/wire.py", "_CoalescingManager"): "the same: the block's completion; absent: launch timing",
    ("comm/wire.py", "_IllegalWork"): "the same: a work without a future is timed at its launch",
    ("watchdog/flight.py", "torch._C._distributed_c10d._WorkerServer"):
        "torch's flight-recorder server has no public constructor; absent: logged, hang "
        "localisation falls back to stacks",
}


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_robust")


def found_in(path: Path) -> set[str]:
    """What ``path`` names: host module strings, private names by literal, private host imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and HOST_MODULE.match(node.value):
            out.add(node.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            out.add(node.args[1].value)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PRIVATE_ROOTS:
            for alias in node.names:
                if any(_private(p) for p in node.module.split(".")) or _private(alias.name):
                    out.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in PRIVATE_ROOTS
                       and any(_private(p) for p in a.name.split(".")))
        elif (isinstance(node, ast.Attribute) and _private(node.attr)
              and _root(node) in (*PRIVATE_ROOTS, "dist", "c10d")):
            out.add(ast.unparse(node))
    return out


def test_core_names_host_internals_only_where_listed():
    found = {(str(p.relative_to(CORE)), what) for p in sorted(CORE.rglob("*.py")) for what in found_in(p)}
    new = sorted(found - set(ALLOWED))
    assert not new, (f"core names host internals: {new}. Put them behind patches/ with a version "
                     "guard, or list them in tests/unit/test_host_privates.py with the reason.")
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"listed but no longer in core (drop them from the list): {stale}"


def test_the_reader_finds_each_kind(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch._C\nfrom torch.distributed import _x\nimport torch.distributed as dist\n"
                   "a = 'deepspeed.runtime.engine'\nb = getattr(o, '_p', None)\nc = dist._q\n"
                   "d = getattr(o, '__dict__')\ne = 'deepspeed'\n")
    assert found_in(src) == {"torch._C", "torch.distributed._x", "deepspeed.runtime.engine", "_p", "dist._q"}

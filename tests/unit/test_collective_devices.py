"""Every collective the package issues on tensors it makes itself puts them on the group's device.

NCCL moves CUDA tensors only ("No backend type associated with device type cpu"). A flag, probe,
trial or agreement tensor made with ``torch.zeros(1)`` works on gloo, where every test runs, and
fails at the first step on a GPU cluster. This test reads the source (AST) of ``robust_plugins/``,
``patches/``, ``recipes/`` (shipped as ``robust_plugins.recipes``) and ``benchmarks/`` (the GPU
checks run them): in every function that calls a ``torch.distributed`` collective, every tensor
it creates with a factory (``torch.zeros``, ``torch.tensor``, ...) must name its device with a
``device=`` that is not a literal (in the package: :func:`robust_plugins.device.collective_device`
or the device of a tensor the caller passed), or be moved with ``.to(...)``; and no such function
may default a ``device`` parameter to ``"cpu"``; and a tensor so made in one function and passed
to a function of the same module that hands that parameter to a collective is caught at the
caller. A new call site that forgets fails here.

Tensors of the caller (gradients, buckets) keep the device they have, which is right by
construction, and are not factory calls. Files that start their own gloo group (benchmark
workers, the network simulator) are exempt, and the exemption is checked against the source.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("robust_plugins", "patches", "recipes", "benchmarks")

COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "broadcast", "reduce", "send", "recv", "isend", "irecv",
    "gather", "scatter", "batch_isend_irecv",
}
FACTORIES = {
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
    "frombuffer", "from_numpy", "linspace",
}

#: Files whose collectives run on a gloo group they create themselves: "why", and the text that
#: proves it (checked below, so the exemption cannot outlive its reason).
GLOO_ONLY = {
    "robust_plugins/sim/probe.py": ('init_process_group("gloo"', "the network simulator's probe, CPU by design"),
    "robust_plugins/cli/bench/comm_worker.py": ('init_process_group("gloo"', "robust bench comm's gloo worker"),
    "robust_plugins/cli/bench/step_worker.py": ('init_process_group("gloo"', "robust bench step's gloo worker"),
    "robust_plugins/cli/bench/checkpoint_worker.py": ('dist_backend="gloo"', "the checkpoint benchmark's gloo worker"),
    "recipes/plain_gpt/train.py": ('init_process_group("gloo"', "the plain recipe trains over gloo only"),
    "benchmarks/allreduce_pieces.py": ('init_process_group("gloo"', "a gloo link benchmark"),
    "benchmarks/ds_fault_train.py": ('dist_backend="gloo"', "the CPU recovery benchmark's trainer"),
    "benchmarks/reduce_scatter_hier.py": ('init_process_group("gloo"', "a gloo simulator benchmark"),
    "benchmarks/watchdog_bench.py": ('init_process_group("gloo"', "times a gloo all-reduce on CPU"),
}


#: The package's own agreement helpers: a literal device handed to them pins every collective they run.
AGREEMENT_CALLS = {"DiskCheckpointer", "all_gather_json", "broadcast_json", "barrier", "restore_from_memory"}


def _dist_aliases(tree: ast.AST) -> set[str]:
    """Names under which the module (or its functions) import ``torch.distributed``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    names.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name == "distributed":
                    names.add(a.asname or "distributed")
    return names


def _is_dist(expr: ast.AST, aliases: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in aliases and expr.id != "torch"
    # torch.distributed.<collective>
    return (isinstance(expr, ast.Attribute) and expr.attr == "distributed" and isinstance(expr.value, ast.Name)
            and expr.value.id == "torch")


def _own_nodes(fn: ast.AST):
    """Nodes of ``fn``'s body, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _unplaced(node: ast.AST, parents: dict) -> str | None:
    """What is wrong with ``node`` if it is a ``torch`` factory call whose tensor has no device of the
    group's (no ``device=`` or a literal one, and not moved or copied onto one); None otherwise."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"):
        return None
    device = next((k.value for k in node.keywords if k.arg == "device"), None)
    parent = parents.get(node)
    # .to(device) moves it; dst.copy_(host_tensor) copies it to dst's device.
    moved = isinstance(parent, ast.Attribute) and parent.attr == "to"
    copied = (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute)
              and parent.func.attr == "copy_" and node in parent.args)
    if moved or copied:
        return None
    if device is None:
        return f"torch.{node.func.attr}(...) without device="
    if isinstance(device, ast.Constant):
        return f"torch.{node.func.attr}(..., device={device.value!r})"
    return None


def _collected_params(tree: ast.AST, aliases: set[str]) -> dict[str, list[str]]:
    """Per module-level function name: its parameters (in order) that it passes to a collective
    (``dist.all_reduce(param)``); functions passing none are left out."""
    out = {}
    for fn in _functions(tree):
        names = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
        used = {a.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in COLLECTIVES and _is_dist(n.func.value, aliases)
                for a in n.args if isinstance(a, ast.Name)}
        if used & set(names):
            out[fn.name] = [n if n in used else "" for n in names]
    return out


def _passed_to_collectives(tree: ast.AST, aliases: set[str], parents: dict, path: str) -> list[str]:
    """Tensors a function makes without the group's device and hands to a function of the same
    module that passes that parameter to a collective (``x = torch.zeros(n); reduce_it(x)``)."""
    collected = _collected_params(tree, aliases)
    found = []
    for fn in _functions(tree):
        made = {}
        for node in _own_nodes(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                values = [node.value.body, node.value.orelse] if isinstance(node.value, ast.IfExp) else [node.value]
                why = next((w for v in values if (w := _unplaced(v, parents)) is not None), None)
                if why is not None:
                    made[node.targets[0].id] = (node.lineno, why)
        for node in _own_nodes(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in collected):
                continue
            params = collected[node.func.id]
            passed = [(params[i] if i < len(params) else "", a) for i, a in enumerate(node.args)]
            passed += [(k.arg if k.arg in params else "", k.value) for k in node.keywords]
            for param, arg in passed:
                if param and isinstance(arg, ast.Name) and arg.id in made:
                    line, why = made[arg.id]
                    found.append(f"{path}:{line} {fn.name}: {why} passed to {node.func.id}({param}=...), which "
                                 f"hands it to a collective; use robust_plugins.device.collective_device(group)")
    return found


def violations(source: str, path: str) -> list[str]:
    """Every factory-made collective tensor without a device, and every ``device="cpu"`` default,
    in functions of ``source`` that issue a collective (pure; the test's rule)."""
    tree = ast.parse(source)
    aliases = _dist_aliases(tree) | {"dist"}
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            literal = [k for k in node.keywords if k.arg == "device" and isinstance(k.value, ast.Constant)]
            if name in AGREEMENT_CALLS and literal:
                found.append(f"{path}:{node.lineno} {name}(device={literal[0].value.value!r}): leave the device "
                             f"out (the group's is used) or pass collective_device(group)")
    for fn in _functions(tree):
        # A collective in this function or in a closure defined in it (a timed run, a ping).
        body = list(ast.walk(fn))
        calls = [n for n in body if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr in COLLECTIVES and _is_dist(n.func.value, aliases)]
        if not calls:
            continue
        args = fn.args
        for a, d in zip(args.args[len(args.args) - len(args.defaults):] + args.kwonlyargs,
                        list(args.defaults) + list(args.kw_defaults)):
            if a.arg == "device" and isinstance(d, ast.Constant) and d.value == "cpu":
                found.append(f"{path}:{fn.lineno} {fn.name}(device=\"cpu\"): default the device to the group's")
        for node in _own_nodes(fn):
            why = _unplaced(node, parents)
            if why is not None:
                found.append(f"{path}:{node.lineno} {fn.name}: {why} in a function that issues a collective; "
                             f"use robust_plugins.device.collective_device(group)")
    found += _passed_to_collectives(tree, aliases, parents, path)
    return found


def _sources():
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            yield p.relative_to(ROOT).as_posix(), p.read_text()


def test_every_collective_tensor_is_on_the_groups_device():
    bad = []
    for rel, text in _sources():
        if rel in GLOO_ONLY:
            continue
        bad += violations(text, rel)
    assert not bad, "collective tensors without the group's device:\n" + "\n".join(bad)


@pytest.mark.parametrize("rel", sorted(GLOO_ONLY))
def test_exempt_files_start_their_own_gloo_group(rel):
    proof, _why = GLOO_ONLY[rel]
    assert proof in (ROOT / rel).read_text(), f"{rel} no longer contains {proof!r}: its exemption is void"


def test_the_rule_catches_a_new_cpu_call_site():
    # What the fixed call sites looked like before: each is caught, the fixed form is not.
    bad = '''
import torch
import torch.distributed as dist

def flag(term):
    t = torch.tensor([1 if term else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)

def probe(group):
    def ping():
        dist.send(small, 1)
    small = torch.zeros(1, device="cpu")
    ping()

def agree(value, device="cpu"):
    dist.broadcast(torch.frombuffer(value, dtype=torch.uint8).to(device), 0)

disk = DiskCheckpointer(config, rank=0, world_size=1, device="cpu")
'''
    good = '''
import torch
from torch import distributed as tdist
from robust_plugins.device import collective_device

def flag(term, group=None):
    t = torch.tensor([1 if term else 0], dtype=torch.int32, device=collective_device(group))
    tdist.all_reduce(t, group=group)

def gradient(g, group):
    tdist.all_reduce(g, group=group)
    return torch.zeros_like(g)
'''
    found = violations(bad, "bad.py")
    assert sorted(f.split(" ")[1] for f in found) == sorted(
        ["DiskCheckpointer(device='cpu'):", "flag:", "probe:", "agree(device=\"cpu\"):"]), found
    assert violations(good, "good.py") == []


def test_the_rule_catches_the_recipes_host_tensors():
    # The recipes' call sites before they named the device: a stage's CPU loss broadcast over the
    # pipeline group, CPU statistics all-reduced after training, and a CPU tensor made in the
    # training loop and all-reduced by a helper it is passed to.
    bad = '''
import torch
import torch.distributed as dist

def train_step(losses, group):
    mean = torch.stack(losses).double().mean() if losses else torch.zeros((), dtype=torch.float64)
    dist.broadcast(mean, src=0, group=group)

def train_one(losses, val):
    stats = torch.tensor([losses], dtype=torch.float64).reshape(1, -1)
    dist.all_reduce(stats)

def global_loss(slice_losses):
    dist.all_reduce(slice_losses)
    return float(slice_losses.sum())

def run(dp, gas, batch):
    slices = torch.zeros(dp * gas, dtype=torch.float64) if batch else None
    return global_loss(slices)
'''
    good = bad.replace("dtype=torch.float64)", "dtype=torch.float64, device=dev)")
    found = violations(bad, "bad.py")
    assert sorted(f.split(" ")[1] for f in found) == ["run:", "train_one:", "train_step:"], found
    assert "global_loss(slice_losses=...)" in next(f for f in found if " run:" in f)
    assert violations(good, "good.py") == []

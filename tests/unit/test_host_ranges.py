"""pyproject's host extras name exactly the ranges the patches check (patches/_ranges.py), so
``pip install robust_plugins[deepspeed]`` never resolves to a host the guards refuse."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from robust_plugins.patches import _ranges
from robust_plugins.patches._guard import parse_version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _pad(v: tuple[int, ...]) -> tuple[int, ...]:
    return v + (0,) * (3 - len(v))


def _extras_ranges() -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    found = {}
    for req in (r for name in ("deepspeed", "megatron", "hf") for r in extras[name]):
        m = re.fullmatch(r"([A-Za-z0-9_-]+)>=([0-9.]+),<([0-9.]+)", req)
        assert m, f"{req}: a host extra must read name>=low,<high"
        found[m.group(1)] = (_pad(parse_version(m.group(2))), _pad(parse_version(m.group(3))))
    return found


def test_host_extras_equal_the_guarded_ranges():
    extras = _extras_ranges()
    for host in ("deepspeed", "megatron-core", "transformers", "accelerate"):
        r = _ranges.ALL[host]
        assert extras[host] == (_pad(r.minimum), _pad(r.below)), f"pyproject's {host} extra vs patches/_ranges.py"


def test_torch_dependency_floor_is_the_elastic_agents():
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (torch,) = [d for d in deps if d.startswith("torch")]
    assert _pad(parse_version(torch.split(">=")[1])) == _pad(_ranges.TORCH_ELASTIC.minimum)

"""Shared by ``robust demo`` and ``robust bench``: launch the GPT recipe on a plan, read results.

Everything a command runs goes through one torchrun launch (DeepSpeed's import and init cost
~10 s a launch on 2 cores) with several runs in a plan, each writing ``<out_dir>/<name>.json``.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any, Sequence

from robust_plugins.errors import RobustPluginsError
from robust_plugins.launch import run_torchrun

RECIPE_MODULE = "robust_plugins.recipes.deepspeed_gpt.train"


def recipe_dir() -> Path:
    """The recipe's folder, where the import system finds it: inside an installed wheel, or the
    top-level ``recipes/`` of a source checkout (setup.py maps it; it is not under this file)."""
    spec = importlib.util.find_spec(RECIPE_MODULE.rpartition(".")[0])
    if spec is None or not spec.submodule_search_locations:
        raise RobustPluginsError(f"{RECIPE_MODULE} is not importable; reinstall robust_plugins.")
    return Path(list(spec.submodule_search_locations)[0])


def recipe_config(name: str) -> Path:
    """Path of a config shipped with the recipe (``baseline.json``, ``plugin.json``, ...)."""
    path = recipe_dir() / name
    if not path.is_file():
        raise RobustPluginsError(f"Recipe config {path} is missing; reinstall robust_plugins.")
    return path


def timestamped_dir(base: str | Path) -> Path:
    """``base/YYYYmmdd-HHMMSS`` (not created)."""
    return Path(base) / time.strftime("%Y%m%d-%H%M%S")


def progress_line(line: str) -> bool:
    """Rank 0's progress and summary lines, for streaming while the job runs."""
    return line.startswith("[default0]:[") and ("rank 0 - step" in line or "] done:" in line)


def run_plan(
    runs: Sequence[dict[str, Any]],
    out_dir: Path,
    *,
    nproc: int,
    preset: str,
    steps: int,
    timeout_s: float,
    extra_args: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """Write ``plan.json`` in ``out_dir``, run it in one launch and return ``{name: result}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = out_dir / "plan.json"
    plan.write_text(json.dumps({"runs": list(runs)}, indent=1) + "\n")
    log = out_dir / "launch.log"
    print(f"launching {nproc} ranks, {len(runs)} runs x {steps} steps ({preset} GPT); log: {log}", flush=True)
    args = ["--plan", str(plan), "--out-dir", str(out_dir), "--preset", preset, "--steps", str(steps),
            *extra_args]
    result = run_torchrun(RECIPE_MODULE, args, nproc=nproc, timeout_s=timeout_s, log_path=log,
                          echo=progress_line)
    print(f"done in {result.wall_s:.0f} s", flush=True)
    return {r["name"]: json.loads((out_dir / f"{r['name']}.json").read_text()) for r in runs}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    """A plain-text (aligned) or markdown table."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines)


def human_bytes(n: float | None) -> str:
    """``1.23 MB`` style (decimal units, as link speeds are quoted)."""
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def wire_bytes(result: dict[str, Any]) -> float | None:
    """Median gradient bytes rank 0 sent per step (during backward), or None when not counted."""
    wire = result.get("wire") or {}
    return wire.get("rank0_median_grad_bytes_per_step")

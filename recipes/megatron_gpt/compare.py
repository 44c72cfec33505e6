"""Baseline megatron-core against megatron-core with robust_plugins, then the telemetry report.

``robust recipe compare megatron_gpt --preset cpu-tiny`` (2 ranks) or ``--preset cpu-3d`` (4 ranks:
PP 2 x DP 2, bf16, megatron's distributed optimizer) launches the recipe twice under torchrun with
the same seed, data and model: once with ``baseline.json`` (the telemetry sub-block only: the
gradient sync is megatron's own) and once with ``plugin.json`` (compression + telemetry; ``--codec``
replaces its codec). Each run's telemetry goes to ``<out>/<name>/telemetry``; then
:func:`robust_plugins.telemetry.report.build` writes ``<out>/report.html`` (the page
``robust report`` makes) and a side-by-side table is printed: final loss, median step time,
gradient bytes per step and their ratio.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from robust_plugins.errors import ConfigError
from robust_plugins.recipes._compare import report_and_table, run_summary

HERE = Path(__file__).resolve().parent
MODULE = "robust_plugins.recipes.megatron_gpt.train"


def _block(config: Path, telemetry_dir: Path, log_every: int) -> dict:
    data = json.loads(config.read_text())
    block = dict(data.get("robust_plugins", data))
    block["telemetry"] = {**block.get("telemetry", {}), "dir": str(telemetry_dir), "log_every": log_every}
    return block


def _summary(name: str, run_dir: Path) -> dict[str, Any]:
    result = json.loads((run_dir / "result.json").read_text())
    return run_summary(name, run_dir, result["losses"], result["digest"])


def compare(*, out_dir: str | Path, preset: str = "cpu-tiny", nproc: int | None = None, steps: int = 20,
            codec: str | None = None, log_every: int = 5, seed: int = 0, timeout_s: float = 600.0,
            extra: list[str] | None = None) -> dict:
    """Run baseline and plugin, write the report; returns the two summaries and the report path.
    ``nproc`` defaults to the ranks the preset is laid out for (``Preset.ranks``)."""
    from robust_plugins.launch import run_torchrun
    from robust_plugins.recipes.megatron_gpt.model import PRESETS

    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r}: allowed {', '.join(sorted(PRESETS))}.")
    nproc = PRESETS[preset].ranks if nproc is None else nproc

    if steps < log_every:
        raise ConfigError(f"--steps {steps} must be >= --log-every {log_every} (telemetry writes one record "
                          f"every log_every steps).")
    out = Path(out_dir)
    summaries = []
    for name in ("baseline", "plugin"):
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        block_path = run_dir / "robust_plugins.json"
        block_path.write_text(json.dumps(_block(HERE / f"{name}.json", run_dir / "telemetry", log_every), indent=1))
        args = ["--preset", preset, "--steps", str(steps), "--seed", str(seed), "--plugin-json", str(block_path),
                "--out", str(run_dir / "result.json"), "--log-every", str(log_every), *(extra or [])]
        if codec is not None and name == "plugin":
            args += ["--codec", codec]
        print(f"[{name}] torchrun --nproc-per-node {nproc} -m {MODULE} {' '.join(args)}", flush=True)
        run_torchrun(MODULE, args, nproc=nproc, timeout_s=timeout_s, log_path=run_dir / "launch.log")
        summaries.append(_summary(name, run_dir))
    return report_and_table(out, summaries)

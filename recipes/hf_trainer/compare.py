"""The HF Trainer recipe without and with robust_plugins, then the telemetry report.

``robust recipe compare hf_trainer --preset cpu-tiny`` launches ``train.py`` twice under torchrun
with the same seed, data and model: once with ``baseline.json`` and once with ``plugin.json``
(they differ only by the ``"robust_plugins"`` block; ``--codec`` replaces the plugin's codec). So
that both runs are measured the same way, each gets the ``telemetry`` sub-block (it observes the
engine and changes nothing: the baseline's gradients stay DeepSpeed's own) writing to
``<out>/<name>/telemetry``; then :func:`robust_plugins.telemetry.report.build` writes
``<out>/report.html`` and a side-by-side table is printed: final loss (mean of the last 5 logged
steps), median step time, gradient bytes per step on rank 0 and their ratio.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from robust_plugins.errors import ConfigError
from robust_plugins.recipes._compare import report_and_table, run_summary

HERE = Path(__file__).resolve().parent
MODULE = "robust_plugins.recipes.hf_trainer.train"


def config_for(name: str, telemetry_dir: Path, log_every: int, codec: str | None = None) -> dict:
    """``<name>.json`` with the telemetry sub-block added (and the plugin's codec replaced)."""
    data = json.loads((HERE / f"{name}.json").read_text())
    block = dict(data.get("robust_plugins", {}))
    if codec is not None and name == "plugin":
        block["compression"] = {**block.get("compression", {}), "codec": codec}
    block["telemetry"] = {**block.get("telemetry", {}), "dir": str(telemetry_dir), "log_every": log_every}
    return {**data, "robust_plugins": block}


def summary(name: str, run_dir: Path) -> dict[str, Any]:
    """Final loss, median step time and gradient bytes of one finished run."""
    result = json.loads((run_dir / "result.json").read_text())
    losses = [h["loss"] for h in result["log_history"] if "loss" in h]
    return run_summary(name, run_dir, losses, result["digest"])


def compare(*, out_dir: str | Path, preset: str = "cpu-tiny", nproc: int = 2, steps: int = 20, codec: str | None = None,
            log_every: int = 5, seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Run baseline and plugin, write the report; returns the two summaries and the report path."""
    from robust_plugins.launch import run_torchrun

    if steps < log_every:
        raise ConfigError(f"--steps {steps} must be >= --log-every {log_every} (telemetry writes one record "
                          f"every log_every steps).")
    out = Path(out_dir)
    summaries = []
    for name in ("baseline", "plugin"):
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg_path = run_dir / "ds_config.json"
        cfg_path.write_text(json.dumps(config_for(name, run_dir / "telemetry", log_every, codec), indent=1))
        args = ["--ds-config", str(cfg_path), "--preset", preset, "--steps", str(steps), "--seed", str(seed),
                "--out", str(run_dir)]
        print(f"[{name}] torchrun --nproc-per-node {nproc} -m {MODULE} {' '.join(args)}", flush=True)
        run_torchrun(MODULE, args, nproc=nproc, timeout_s=timeout_s, log_path=run_dir / "launch.log")
        summaries.append(summary(name, run_dir))
    return report_and_table(out, summaries)

"""``robust check-config ds.json``: validate the block and say what it would turn on.

Runs without DeepSpeed imported (fast, and usable on a login node). Besides the block's own
validation it points out host settings that interact with it, and an installed DeepSpeed outside
the supported range (read from pip's metadata). ``--schema`` prints the block's
JSON Schema instead (editors complete and validate the block with it).
"""

from __future__ import annotations

import argparse
import json

from robust_plugins.config import BLOCK_KEY, PluginConfig, load_json
from robust_plugins.errors import ConfigError
from robust_plugins.patches import _guard, _ranges

# ZeRO 1/2 on CPU with DeepSpeed's default 5e8-element buckets spends seconds a step allocating
# buffers, even for a tiny model; this bound keeps CPU runs fast.
_CPU_BUCKET_LIMIT = 5e7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``CONFIG`` path(s), or ``--schema``."""
    parser.add_argument("configs", nargs="*", metavar="CONFIG", help="DeepSpeed JSON config file(s)")
    parser.add_argument("--schema", action="store_true",
                        help="print the JSON Schema of the robust_plugins block (for editors) and exit")


def check(path: str) -> list[str]:
    """Validate one DeepSpeed config file; return the report lines (raises ConfigError)."""
    ds = load_json(path)
    cfg = PluginConfig.from_ds_config(ds)
    lines = []
    if BLOCK_KEY not in ds:
        lines.append(f"{path}: no '{BLOCK_KEY}' block: DeepSpeed runs unchanged.")
        return lines
    lines.append(f"{path}: OK. With `import robust_plugins` before deepspeed.initialize this turns on:")
    lines.append(f"  {cfg.describe()}")
    installed = _guard.installed_version("deepspeed")
    problem = None if installed is None else _ranges.DEEPSPEED.error(installed)
    if problem is not None:
        lines.append(f"  ERROR: {problem} deepspeed.initialize will refuse this config.")
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if cfg.compression is not None:
        if stage not in (0, 1, 2, 3):
            lines.append(f"  ERROR: zero_optimization.stage = {stage}: compression supports ZeRO 0-3 only; "
                         f"deepspeed.initialize will refuse this config.")
        elif stage == 3 and cfg.compression.codec not in ("none", "int8", "int4", "auto"):
            lines.append(f"  ERROR: compression.codec = {cfg.compression.codec!r} with ZeRO-3: its reduce-scatter "
                         f"takes none, int8, int4, auto; deepspeed.initialize will refuse this config.")
        elif stage == 3:
            route = "node first" if cfg.topology is not None and cfg.topology.hierarchical else "flat"
            lines.append(f"  on ZeRO-3's gradient reduce-scatter ({route}; the parameter all-gather stays DeepSpeed's).")
        elif cfg.compression.sign_mode == "momentum":
            if stage != 0 or any((ds.get(k) or {}).get("enabled") for k in ("fp16", "bf16")):
                lines.append(f"  ERROR: compression.sign_mode = 'momentum' (1-bit Adam) needs ZeRO stage 0 in fp32 "
                             f"(this config: stage {stage}{', fp16/bf16 on' if stage == 0 else ''}); "
                             f"deepspeed.initialize will refuse it.")
            else:
                lines.append(f"  fp32 Adam for {cfg.compression.freeze_steps} steps, then Adam's momentum averaged in "
                             f"1-bit codes (needs a torch.optim.Adam/AdamW client optimizer).")
        else:
            lines.append(f"  on ZeRO stage {stage}'s data-parallel gradient reduction.")
        if ds.get("communication_data_type") and cfg.compression.compresses:
            lines.append(f"  note: communication_data_type={ds['communication_data_type']!r} applies only to "
                         f"buckets the codec leaves uncompressed.")
    if cfg.checkpoint is not None:
        if stage not in (0, 1, 2, 3):
            lines.append(f"  ERROR: zero_optimization.stage = {stage}: verified checkpoints support ZeRO 0-3 only; "
                         f"deepspeed.initialize will refuse this config.")
        else:
            lines.append(f"  engine.save_checkpoint / load_checkpoint become verified and atomic "
                         f"(manifest + {cfg.checkpoint.verify}; load picks the newest checkpoint that verifies).")
        if cfg.checkpoint.dir is None:
            lines.append("  note: checkpoint.dir is not set: pass save_dir / load_dir to save_checkpoint / "
                         "load_checkpoint yourself.")
    if stage in (1, 2):
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if float(zero.get(key, 5e8)) > _CPU_BUCKET_LIMIT:
                lines.append(f"  warning: zero_optimization.{key} = {zero.get(key, '5e8 (default)')}: on CPU "
                             f"runs set it to 5e6 or less (buffer allocation costs seconds a step).")
    lines.append("  Reminder: DeepSpeed ignores unknown top-level keys, so without `import robust_plugins` "
                 "this block does nothing.")
    return lines


def run(args: argparse.Namespace) -> int:
    """Print the report for each config (or the schema); exit 2 on the first invalid one."""
    if args.schema:
        from robust_plugins.schema.docs import json_schema

        print(json.dumps(json_schema(), indent=2))
        return 0
    if not args.configs:
        raise ConfigError("check-config needs a DeepSpeed JSON config file (CONFIG ...) or --schema.")
    for path in args.configs:
        print("\n".join(check(path)))
    return 0

"""DeepSpeed: find the config ``deepspeed.initialize`` will use, and refuse what the plugin cannot serve.

``compression`` serves ZeRO stages 0-3 (ZeRO-3's refusals: ``patches/deepspeed_zero3_reduce.py``) and
pipeline engines (each stage's data-parallel reduction, ``auto`` and ``topology.hierarchical``
included); ``checkpoint`` stages 0-3 and pipeline engines (ZeRO 0/1, which is
what DeepSpeed allows with them).

:func:`_refuse_before_init` needs no engine and runs before DeepSpeed builds one;
:func:`_refuse_engine` (``compression``) and :func:`_refuse_checkpoint_engine` (``checkpoint``)
inspect the built engine (``patches/deepspeed.py`` calls them from ``initialize`` and ``attach``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from robust_plugins.config import PluginConfig, load_json
from robust_plugins.errors import ConfigError, UnsupportedError


def _find_ds_config(arguments: dict[str, Any]) -> Any:
    """The config DeepSpeed will use: ``config``, ``config_params`` or ``args.deepspeed_config``."""
    for name in ("config", "config_params"):
        if arguments.get(name) is not None:
            cfg = arguments[name]
            return _read_config_file(cfg) if isinstance(cfg, (str, os.PathLike)) else cfg
    args = arguments.get("args")
    path = getattr(args, "deepspeed_config", None) if args is not None else None
    return _read_config_file(path) if path else None


def _read_config_file(path: str | os.PathLike) -> dict[str, Any] | None:
    try:
        return load_json(path)
    except ConfigError:
        # DeepSpeed also accepts HJSON; parse it the way DeepSpeed does before giving up.
        try:
            import hjson

            with open(path) as f:
                return json.loads(json.dumps(hjson.load(f)))
        except Exception:
            raise ConfigError(f"Cannot parse the DeepSpeed config {path} as JSON or HJSON.") from None


def _features(plugin_cfg: PluginConfig) -> str:
    """``compression``, ``checkpoint`` or ``compression and checkpoint``: for refusal messages."""
    names = [n for n in ("compression", "checkpoint") if getattr(plugin_cfg, n) is not None]
    return " and ".join(names)


def _refuse_before_init(arguments: dict[str, Any], plugin_cfg: PluginConfig) -> None:
    """Cheap refusals that need no engine: fail before DeepSpeed spends time building one."""
    cfg = _find_ds_config(arguments) or {}
    what = _features(plugin_cfg)
    if not what:  # telemetry alone observes the engine and changes nothing it could refuse
        return
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UnsupportedError(f"robust_plugins.{what}: zero_optimization.stage = {stage!r} is not a ZeRO stage; "
                               f"allowed: 0, 1, 2, 3.")


def _refuse_engine(engine, plugin_cfg: PluginConfig) -> None:
    """Refusals that need the built engine (the config alone does not say)."""
    stage = engine.zero_optimization_stage()
    if engine.pipeline_parallelism:
        _refuse_pipeline(plugin_cfg)
    elif stage not in (0, 1, 2, 3):
        raise UnsupportedError(f"robust_plugins.compression supports ZeRO stages 0-3, not stage {stage}.")
    # A pipeline engine turns the engine's all-reduce off and reduces itself at the batch's end
    # (pipeline_enable_backward_allreduce), through the same bucket methods.
    if not (engine.pipeline_parallelism or engine.enable_backward_allreduce):
        raise UnsupportedError(
            f"The optimizer {type(engine.optimizer).__name__} communicates gradients itself "
            f"(DeepSpeed turned the engine's all-reduce off, as 1-bit Adam / 0/1 Adam do), so "
            f"robust_plugins.compression would never run. Remove one of the two."
        )
    if getattr(engine, "zenflow", False) or engine.is_deepcompile_active():
        raise UnsupportedError(
            "robust_plugins.compression does not support ZenFlow or DeepCompile engines, which "
            "reduce gradients on their own paths."
        )
    if stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if not isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
            raise UnsupportedError(
                f"ZeRO stage {stage} built a {type(engine.optimizer).__name__}, not the "
                f"DeepSpeedZeroOptimizer robust_plugins hooks into; remove the 'compression' sub-block."
            )


def _refuse_pipeline(plugin_cfg: PluginConfig) -> None:
    """What the compression of a pipeline stage's data-parallel reduction was not verified with."""
    cfg = plugin_cfg.compression
    refusals = (
        (cfg.sign_mode == "momentum", "compression.sign_mode = 'momentum'", "'gradient'"),
        (bool(cfg.overlap), "compression.overlap = true", "false or unset (the pipeline reduces at the batch's end)"),
    )
    for refused, what, allowed in refusals:
        if refused:
            raise UnsupportedError(f"robust_plugins.compression on DeepSpeed's pipeline engine does not support "
                                   f"{what}; allowed there: {allowed}.")


def _refuse_checkpoint_engine(engine) -> None:
    """Engines whose checkpoint files take paths the verified save/load does not cover."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    remove = "Remove the 'checkpoint' sub-block to use DeepSpeed's own checkpoints."
    refusals = (
        (engine.has_moe_layers, "MoE engines (expert files are loaded outside the checkpoint engine)"),
        (engine.load_universal_checkpoint(), "universal checkpoints (checkpoint.load_universal)"),
        (engine.use_node_local_storage(), "node-local storage (rank 0 must see every rank's files)"),
        (engine.zero_nvme_offload_optimizer(),
         "zero_optimization.offload_optimizer.device = 'nvme' (its swap files are copied with copytree, outside the "
         "checkpoint engine; allowed: 'none' or 'cpu')"),
        (_offload_param_device(engine) == "nvme",
         "zero_optimization.offload_param.device = 'nvme' (parameters swapped to NVMe were not verified; allowed: "
         "'none' or 'cpu')"),
        (type(engine.checkpoint_engine) is not TorchCheckpointEngine,
         f"the {type(engine.checkpoint_engine).__name__} checkpoint engine (only TorchCheckpointEngine)"),
    )
    for refused, what in refusals:
        if refused:
            raise UnsupportedError(f"robust_plugins.checkpoint does not support {what}. {remove}")


def _offload_param_device(engine) -> str:
    """``zero_optimization.offload_param.device`` (``"none"`` when not configured)."""
    offload = engine._config.zero_config.offload_param
    return "none" if offload is None else str(getattr(offload.device, "value", offload.device))

"""Telemetry: per-step metrics aggregated on rank 0 into ``metrics.jsonl`` and a W&B run, the
rank-to-rank communication heat map, and what ``robust report`` reads.

``metrics`` is pure arithmetic, ``sinks`` writes files and W&B runs, ``recorder`` is the
per-engine recorder a host integration feeds, ``heatmap`` probes links. Turned on for DeepSpeed by
the ``"telemetry"`` sub-block of the ``robust_plugins`` block (no script change).
"""

from robust_plugins.telemetry.sinks import METRICS_FILE, read_records

__all__ = ["METRICS_FILE", "read_records", "Telemetry"]


def __getattr__(name: str):
    # The recorder imports torch.distributed; keep `import robust_plugins.telemetry` light.
    if name == "Telemetry":
        from robust_plugins.telemetry.recorder import Telemetry

        return Telemetry
    raise AttributeError(name)

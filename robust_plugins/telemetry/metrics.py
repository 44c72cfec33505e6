"""Pure metric arithmetic for telemetry: no processes, no torch.distributed, no files.

Each rank keeps a fixed vector of sums over the steps since the last aggregation
(:data:`FIELDS`); rank 0 gathers the vectors (one small collective every ``log_every`` steps)
and :func:`aggregate` turns the rank x field matrix into one record. :func:`ettr` computes the
effective training time ratio from the records of every incarnation of a job.
"""

from __future__ import annotations

import datetime
import math
from typing import Any, Iterable, Mapping, Sequence

#: Per-rank sums since the last aggregation, in the order ranks send them.
FIELDS = (
    "steps",            # optimizer steps in the window
    "step_s",           # sum of step wall times (step end to step end)
    "step_s_max",       # slowest single step
    "loss_sum",         # sum of micro-batch losses
    "loss_n",           # micro-batch losses summed
    "tokens",           # tokens this rank consumed in training forwards
    "grad_bytes",       # bytes this rank sent while gradients were reduced (WireCounter)
    "grad_comm_s",      # seconds spent inside those collectives
    "grad_ref_bytes",   # what an fp32-equivalent ring all-reduce of the same gradients sends
    "mem_bytes",        # peak memory (CUDA max allocated, or peak RSS on CPU)
    "residual_sq",      # squared L2 norm of this rank's error-feedback residuals (at the window end)
    "grad_norm",        # the engine's global gradient norm at the window end (NaN if unknown)
)
INDEX = {name: i for i, name in enumerate(FIELDS)}

#: Dense bf16/fp16 tensor-core peak FLOP/s per device, matched as a substring of the CUDA device
#: name (vendor data sheets; SXM parts). Anything else, every CPU included, needs
#: ``telemetry.peak_flops``.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "V100": 125e12,
}


def peak_flops_for(device_name: str | None, override: float | None = None) -> float | None:
    """Peak FLOP/s for one rank: the override, else the table entry whose key is in the name."""
    if override is not None:
        return float(override)
    if not device_name:
        return None
    for key, value in PEAK_FLOPS.items():
        if key in device_name:
            return value
    return None


def ring_allreduce_bytes(numel: int, element_size: int, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements (the WireCounter's model)."""
    if world <= 1:
        return 0.0
    return 2.0 * (world - 1) * numel * element_size / world


def aggregate(matrix: Sequence[Sequence[float]], *, window_s: float, flops_per_token: float | None,
              peak_flops: float | None) -> dict[str, Any]:
    """One record from a rank x :data:`FIELDS` matrix of window sums.

    ``window_s`` is rank 0's wall time from the previous aggregation to this one; throughput is
    all ranks' tokens over that time. MFU is the achieved model FLOP/s per rank over
    ``peak_flops`` (None when either is unknown).
    """
    if not matrix:
        raise ValueError("aggregate() needs at least one rank's row")
    for r, row in enumerate(matrix):
        if len(row) != len(FIELDS):
            raise ValueError(f"rank {r} sent {len(row)} values; expected {len(FIELDS)} ({', '.join(FIELDS)})")
    world = len(matrix)
    col = {name: [float(row[i]) for row in matrix] for name, i in INDEX.items()}
    steps = max(col["steps"][0], 1.0)
    loss_n = sum(col["loss_n"])
    tokens = sum(col["tokens"])
    grad_bytes = sum(col["grad_bytes"])
    ref = sum(col["grad_ref_bytes"])
    comm_s = col["grad_comm_s"]
    per_rank_step_s = [s / max(n, 1.0) for s, n in zip(col["step_s"], col["steps"])]
    tokens_per_s = tokens / window_s if window_s > 0 and tokens else None
    mfu = None
    if tokens_per_s is not None and flops_per_token and peak_flops:
        mfu = tokens_per_s / world * flops_per_token / peak_flops
    return {
        "world_size": world,
        "steps_in_window": int(col["steps"][0]),
        "window_s": window_s,
        "loss": sum(col["loss_sum"]) / loss_n if loss_n else None,
        "grad_norm": _finite_or_none(col["grad_norm"][0]),
        "step_time_s": sum(per_rank_step_s) / world,
        "step_time_max_s": max(col["step_s_max"]),
        "step_time_s_by_rank": per_rank_step_s,  # with pipeline parallelism: per stage
        "slowest_rank": max(range(world), key=lambda r: per_rank_step_s[r]),
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "mem_bytes_max": max(col["mem_bytes"]),
        "grad_bytes_per_step": grad_bytes / steps,
        "grad_bytes_per_step_rank0": col["grad_bytes"][0] / steps,
        "grad_bytes_per_step_by_rank": [b / steps for b in col["grad_bytes"]],
        "grad_comm_s_per_step": sum(comm_s) / world / steps,
        "grad_bandwidth_Bps": grad_bytes / sum(comm_s) if sum(comm_s) > 0 else None,
        "compression_ratio": grad_bytes / ref if ref > 0 else None,
        "residual_norm": math.sqrt(sum(col["residual_sq"])) if any(col["residual_sq"]) else 0.0,
    }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _seconds(t: Any) -> float:
    if isinstance(t, (int, float)):
        return float(t)
    return datetime.datetime.fromisoformat(str(t)).timestamp()


def ettr(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Effective training time ratio of a job from its telemetry records (all incarnations).

    ``start`` records carry ``time`` (Unix seconds) at an incarnation's first engine; ``step``
    records carry ``step`` (the last step of their window), ``steps_in_window``, ``window_s`` and
    ``time``. Each step's time is the window time over its steps; a step run again after a
    rollback counts once, with its last run (the earlier run was lost work). ETTR is the
    productive time over the wall time from the first start to the last record.
    """
    productive: dict[int, float] = {}
    first = last = None
    for rec in records:
        kind = rec.get("kind")
        if kind not in ("start", "step"):
            continue
        t = _seconds(rec["time"])
        first = t if first is None else min(first, t)
        last = t if last is None else max(last, t)
        if kind == "step":
            n = int(rec["steps_in_window"])
            per = float(rec["window_s"]) / max(n, 1)
            for s in range(int(rec["step"]) - n + 1, int(rec["step"]) + 1):
                productive[s] = per
    if first is None or last is None or last <= first:
        return {"ettr": None, "productive_s": sum(productive.values()), "wall_s": 0.0}
    wall = last - first
    prod = sum(productive.values())
    return {"ettr": min(prod / wall, 1.0), "productive_s": prod, "wall_s": wall}

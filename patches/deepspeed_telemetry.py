"""DeepSpeed side of telemetry (``"telemetry"`` sub-block): feeds a
:class:`robust_plugins.telemetry.recorder.Telemetry` from one engine, with no change to the
training script.

- tokens: a forward pre-hook on ``engine.module`` (public ``torch.nn.Module`` API) counts the
  elements of the first integer tensor argument (token ids) of each training forward;
- gradient bytes and time: ``engine.backward`` is shadowed on the instance (DeepSpeed 0.19,
  ``deepspeed/runtime/engine.py``: ZeRO 0-2 reduce gradients inside ``backward`` at the
  accumulation boundary) and runs inside :meth:`Telemetry.grad_window`, which counts every
  collective issued there with :class:`robust_plugins.comm.WireCounter`; for a pipeline engine
  the window is its data-parallel reduction at the batch's end and the loss the last stage's
  (:func:`_bind_pipeline_window`);
- the step: the engine's step observers (``patches/deepspeed.py``) call :func:`on_step` after each
  optimizer step at an accumulation boundary;
- ZeRO-3 (:class:`Zero3Collectives`): ``engine.forward`` is shadowed too, and the collectives of
  forward and backward are counted by kind, so each record (rank 0's, summed over its window) has
  ``zero3``: the parameter all-gathers of forward and of backward, the gradient reduce-scatter
  (``reduce_scatter_tensor``, or the compressed one's ``all_to_all_single``), bytes and seconds.

The recorder is closed (W&B run finished, ``end`` record written) when the engine is garbage
collected or at interpreter exit, whichever comes first; ``engine.robust_plugins.telemetry.close()``
closes it explicitly.
"""

from __future__ import annotations

import contextlib
import weakref
from functools import partial
from typing import Any

import torch

from robust_plugins._logging import current_rank, get_logger
from robust_plugins.comm.state import residuals_sq_norm
from robust_plugins.patches import _guard, _ranges

log = get_logger(__name__)

_BACKWARD_SIGNATURE = ["self", "loss", "retain_graph", "scale_wrt_gas"]


def _first_token_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex():
            return value
    return None


def _undecorated(fn):
    # DeepSpeed 0.19 decorates backward with utils.nvtx.instrument_w_nvtx, which keeps the
    # function in its closure without functools.wraps (no __wrapped__, signature (*args, **kwargs)).
    for cell in getattr(fn, "__closure__", None) or ():
        inner = cell.cell_contents
        if callable(inner) and getattr(inner, "__name__", None) == fn.__qualname__.split(".")[-1]:
            return inner
        if callable(inner) and getattr(inner, "__name__", None) == "backward":
            return inner
    return fn


def attach_telemetry(engine, plugin) -> Any:
    """Build the recorder for ``engine`` and hook it up; returns it (also ``plugin.telemetry``)."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    from robust_plugins.telemetry.recorder import Telemetry

    _guard.check_signature("deepspeed", _undecorated(DeepSpeedEngine.backward), _BACKWARD_SIGNATURE,
                           f"deepspeed {_ranges.DEEPSPEED.spec}")
    cfg = plugin.config.telemetry
    # ZeRO-3's parameters are partitioned (numel() is this rank's share or 0): ds_numel is the whole.
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
    comm_dtype = engine.communication_data_type or engine.get_data_types()[0]
    residual_sq_fn = (partial(residuals_sq_norm, tuple(plugin.sync.states.values()))
                      if plugin.sync is not None else None)
    # SyncStats, not the GradientSync: its step function holds the engine, which the recorder must
    # not keep alive (it is closed when the engine is collected).
    stats = plugin.sync.stats if plugin.sync is not None else None

    def sync_info() -> dict[str, Any]:
        total = sum(stats.by_codec.values())
        return {"codec_share": {k: v / total for k, v in stats.by_codec.items()} if total else {},
                "auto_decisions": [d.to_dict() if hasattr(d, "to_dict") else d for d in stats.auto_decisions]}
    engine_ref = weakref.ref(engine)  # the recorder must not keep the engine alive

    def grad_norm() -> float | None:
        eng = engine_ref()
        norm = eng.get_global_grad_norm() if eng is not None else None
        return float(norm) if norm is not None else None

    run_config = {
        "robust_plugins": dict(plugin.config.raw),
        "host": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                 "zero_stage": engine.zero_optimization_stage(), "dp_world_size": engine.dp_world_size,
                 "grad_dtype": str(comm_dtype), "trainable_params": trainable,
                 "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
                 "micro_batch": engine.train_micro_batch_size_per_gpu()},
    }
    zero3 = Zero3Collectives() if engine.zero_optimization_stage() == 3 else None

    def info() -> dict[str, Any]:
        out = sync_info() if stats is not None else {}
        if zero3 is not None:
            out["zero3"] = zero3.take()
        return out

    tel = Telemetry(cfg, run_config=run_config, n_grad_elements=trainable,
                    grad_element_size=torch.empty((), dtype=comm_dtype).element_size(),
                    dp_world_size=engine.dp_world_size, device=torch.device(engine.device),
                    flops_per_token=6.0 * trainable,
                    residual_sq_fn=residual_sq_fn,
                    grad_norm_fn=grad_norm, info_fn=info if stats is not None or zero3 is not None else None)
    plugin.telemetry = tel

    def count_tokens(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            ids = _first_token_tensor(args, kwargs)
            if ids is not None:
                tel.count_tokens(ids.numel())

    handle = engine.module.register_forward_pre_hook(count_tokens, with_kwargs=True)
    original = engine.backward

    def backward(loss, retain_graph=False, scale_wrt_gas=True):
        with tel.grad_window(loss), (zero3.window("backward") if zero3 else contextlib.nullcontext()):
            return original(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    if zero3 is not None:
        forward = engine.forward

        def counted_forward(*args, **kwargs):
            with zero3.window("forward"):
                return forward(*args, **kwargs)

        _guard.bind_instance(engine, "forward", counted_forward)

    if engine.pipeline_parallelism:
        _bind_pipeline_window(engine, tel)
    else:
        _guard.bind_instance(engine, "backward", backward)
    tel.hook_handles.append(handle)
    weakref.finalize(engine, tel.close)
    if current_rank() == 0:
        log.info("robust_plugins telemetry: %s -> %s", cfg.describe(), tel.dir)
    return tel


def _bind_pipeline_window(engine, tel) -> None:
    """A pipeline engine's backward and gradient reduction run inside ``train_batch``, whose
    schedule calls its instruction methods through a class-level table; the reduction at the
    batch's end then calls ``allreduce_gradients`` (or, with DeepSpeed's BF16_Optimizer,
    ``_bf16_reduce_grads``) on the instance: that call is the window. Its loss is the last stage's
    (DeepSpeed's ``total_loss``, the sum of its micro-batch losses, over their count, as
    ``train_batch`` reports it); other stages report none, so the record's loss is the last
    stage's. Tokens are counted where token ids enter: the first stage."""
    for name in ("allreduce_gradients", "_bf16_reduce_grads"):
        inner = getattr(engine, name)

        def reduce(*args, _inner=inner, **kwargs):
            total = engine.total_loss if engine.is_last_stage() else None
            with tel.grad_window(total / engine.micro_batches if total is not None else None):
                return _inner(*args, **kwargs)

        _guard.bind_instance(engine, name, reduce, layer=f"telemetry.{name}")


#: ``WireCounter.by_op`` names, by the ZeRO-3 collective they carry.
_ALL_GATHER = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather")
_REDUCE_SCATTER = ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter",
                   "all_to_all_single")


class Zero3Collectives:
    """Bytes and seconds of ZeRO-3's collectives on this rank, by phase, since the last record.

    ``forward``: the parameter all-gathers (ZeRO-3 issues nothing else there). ``backward``: the
    all-gathers of parameters released after forward and the gradient reduce-scatter (DeepSpeed's
    ``reduce_scatter_tensor``, or the compressed one's ``all_to_all_single``); its seconds are both
    together (one counter: the two interleave inside backward).

    No host sync per window: bytes are counted at the call, seconds are read without waiting
    (:meth:`WireCounter.settled_seconds`); a window whose collectives were still running on the
    device is read again at later windows, and :meth:`take` (rank 0, every ``log_every`` steps)
    waits only for what is still running then. On CUDA, reading ``seconds`` at each window's end
    waited for every all-gather of the forward (ZeRO-3 prefetches them on its own stream)."""

    #: Windows whose seconds are kept open at most: older ones are read (waiting) once more pile
    #: up, which bounds memory on ranks that never :meth:`take` (only rank 0 records); a window is
    #: a forward or a backward, so 256 are 128 micro-batches, long finished.
    MAX_OPEN = 256

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._open: list[tuple[str, Any, float]] = []
        """(phase, counter, seconds already added) of windows with unfinished device clocks."""

    @contextlib.contextmanager
    def window(self, phase: str):
        """Count the collectives issued inside (``phase``: ``forward`` or ``backward``)."""
        from robust_plugins.comm import WireCounter

        with WireCounter() as counter:
            yield
        by_op = counter.by_op
        for kind, names in (("all_gather", _ALL_GATHER), ("reduce_scatter", _REDUCE_SCATTER)):
            key = f"{phase}_{kind}_bytes"
            self._sums[key] = self._sums.get(key, 0) + sum(by_op.get(n, 0) for n in names)
        self._open.append((phase, counter, 0.0))
        self._settle(wait=False)

    def _settle(self, wait: bool) -> None:
        """Add the seconds of open windows that finished (all, waiting, with ``wait``)."""
        still = []
        for i, (phase, counter, added) in enumerate(self._open):
            force = wait or i < len(self._open) - self.MAX_OPEN
            now = counter.seconds if force else counter.settled_seconds()
            key = f"{phase}_comm_s"
            self._sums[key] = self._sums.get(key, 0.0) + now - added
            if not force and counter.unsettled():
                still.append((phase, counter, now))
        self._open = still

    def take(self) -> dict[str, float]:
        """The sums since the last call (then reset); waits for collectives still running."""
        self._settle(wait=True)
        out, self._sums = self._sums, {}
        return out


def on_step(engine) -> None:
    """Step observer: one optimizer step of ``engine`` completed."""
    tel = getattr(getattr(engine, "robust_plugins", None), "telemetry", None)
    if tel is not None:
        tel.step_end(engine.global_steps)

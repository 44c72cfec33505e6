"""DeepSpeed side of the watchdog: step signals from the engine, with no change to the script.

Under ``robust run`` an engine built from a config with a ``"robust_plugins"`` block (any
sub-block, ``"watchdog": {}`` alone included) reports every optimizer step to the node monitor
itself, as a script would with ``robust_plugins.watchdog.step_end``:

- **step**: ``engine.global_steps`` after the step, the number a script following the resume
  contract uses (it resumes at ``global_steps + 1``); ``--inject ...,step=S`` refers to it;
- **loss**: this rank's loss, the mean of the losses passed to ``engine.backward`` since the
  previous optimizer step (one per micro-batch); for a pipeline engine, ``train_batch``'s loss
  (the last stage's, which DeepSpeed broadcasts to every stage). ``engine.backward`` is shadowed on the instance
  to keep a detached reference to each loss (no copy, no device sync); the mean is read once an
  optimizer step with ``.item()``. On a GPU that waits for the step's kernels, which DeepSpeed's
  own step has already done for ZeRO 1/2's overflow check and gradient norm;
- **grad_norm**: ``engine.get_global_grad_norm()`` (None where DeepSpeed computes none);
- **step time**: wall time between two optimizer steps.

Saves ask first: ``engine.save_checkpoint`` asks the monitor whether step ``global_steps`` may be
written (``robust_plugins.watchdog.ok_to_save``; faults are detected a little after their step,
and a checkpoint written in between would carry the NaN, the spike's update or a corrupted replica
into the rollback). The ranks agree on the answer with one all-reduce (MIN of one integer), so
every rank enters DeepSpeed's collective save or none does; a refused save logs a warning and
returns False without writing anything (the job is being rolled back).

Learned timeouts survive a relaunch: ``save_checkpoint`` adds this rank's step times to DeepSpeed's
``client_state`` under ``"robust_watchdog"`` (rank 0's is the one DeepSpeed keeps; the timeout is
one for the job), and ``load_checkpoint`` hands them back to the monitor
(``robust_plugins.watchdog.load_state_dict``), so a new ``robust run`` on the same checkpoints
needs no second warm-up before it can tell a hang.

The signal is sent by a step observer (``patches/deepspeed.py`` :func:`add_step_observer`)
registered first, so the other observers (telemetry, memory snapshots) run after it and can read
the same numbers with :func:`latest_step`. Outside ``robust run`` nothing is attached.

A script that also calls ``step_end`` with the same step numbers is harmless: the client ignores
the second report of a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from robust_plugins._logging import current_rank, get_logger
from robust_plugins.patches import _guard, _ranges

log = get_logger(__name__)

_BACKWARD_SIGNATURE = ["self", "loss", "retain_graph", "scale_wrt_gas"]

#: Key of the watchdog's state in DeepSpeed's ``client_state``.
CLIENT_STATE_KEY = "robust_watchdog"


@dataclass(frozen=True)
class StepInfo:
    """One optimizer step of one engine, as reported to the watchdog."""

    step: int
    """``engine.global_steps`` after the step."""
    loss: float | None
    """Mean of this rank's micro-batch losses of the step (None if ``engine.backward`` saw none)."""
    grad_norm: float | None
    """``engine.get_global_grad_norm()`` (None where DeepSpeed computes none)."""
    step_time: float | None
    """Seconds since the previous optimizer step (None for the first one)."""


class StepSignals:
    """Per-engine state: losses of the current accumulation window and the latest step."""

    def __init__(self) -> None:
        self.losses: list[Any] = []
        self.last_time: float | None = None
        self.latest: StepInfo | None = None


def attach_watchdog(engine, plugin) -> StepSignals | None:
    """Make ``engine`` report its steps to ``robust run``'s monitor; ``None`` outside ``robust run``.

    Call after every other feature has shadowed ``engine.backward`` (telemetry does): this wraps
    whatever is there, so the loss is recorded whichever features are on.
    """
    from robust_plugins.watchdog import client

    if client.get_client() is None:
        return None
    from deepspeed.runtime.engine import DeepSpeedEngine

    from robust_plugins.patches.deepspeed import add_step_observer
    from robust_plugins.patches.deepspeed_telemetry import _undecorated

    _guard.check_signature("deepspeed", _undecorated(DeepSpeedEngine.backward), _BACKWARD_SIGNATURE,
                           f"deepspeed {_ranges.DEEPSPEED.spec}")
    signals = StepSignals()
    plugin.watchdog = signals
    inner = engine.backward

    def backward(loss, retain_graph=False, scale_wrt_gas=True):
        signals.losses.append(loss.detach())
        return inner(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    # Called once per engine, from deepspeed.initialize; wraps telemetry's backward if it is there.
    engine.backward = _guard.wrap(inner, backward)
    save = engine.save_checkpoint

    def save_checkpoint(save_dir=None, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False):
        if signals.losses and (signals.latest is None or signals.latest.step != engine.global_steps):
            # A save inside engine.step (checkpoint.persist_every) comes before the step
            # observers: report the step first, or the monitor would wait for it.
            on_step(engine)
        if not _agreed_ok_to_save(engine):
            log.warning("robust_plugins: robust run found a fault at or before step %d; this "
                        "checkpoint is not written (the job is being rolled back).", engine.global_steps)
            return False
        state = dict(client_state or {})
        state[CLIENT_STATE_KEY] = client.state_dict()
        return save(save_dir, tag, client_state=state, save_latest=save_latest,
                    exclude_frozen_parameters=exclude_frozen_parameters)

    # Around the verified/residual save wrapper (patches/deepspeed.py), which is already bound.
    engine.save_checkpoint = _guard.wrap(save, save_checkpoint)
    load = engine.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        load_path, client_state = load(*args, **kwargs)
        if isinstance(client_state, dict) and CLIENT_STATE_KEY in client_state:
            client_state = dict(client_state)
            client.load_state_dict(client_state.pop(CLIENT_STATE_KEY))
        return load_path, client_state

    engine.load_checkpoint = _guard.wrap(load, load_checkpoint)
    add_step_observer(engine, on_step, first=True)
    _refuse_sdc_on_zero3(engine, client.get_client())
    if current_rank() == 0:
        log.info("robust_plugins: the engine reports every optimizer step to robust run's watchdog "
                 "(step, loss, grad norm)")
    return signals


def on_step(engine) -> None:
    """Step observer: report the step that just ended to the node monitor."""
    from robust_plugins.watchdog import client

    signals: StepSignals | None = getattr(getattr(engine, "robust_plugins", None), "watchdog", None)
    if signals is None or (signals.latest is not None and signals.latest.step == engine.global_steps):
        return  # no engine of ours, or this step was reported already (by a save inside step)
    now = time.perf_counter()
    loss = None
    if signals.losses:
        total = signals.losses[0].float()
        for extra in signals.losses[1:]:
            total = total + extra.float()
        loss = float(total.item()) / len(signals.losses)
        signals.losses.clear()
    elif engine.pipeline_parallelism and getattr(engine, "agg_train_loss", None) is not None:
        # A pipeline engine's backward is internal: train_batch's loss, computed on the last
        # stage and broadcast to every stage, is the step's loss on each rank.
        loss = float(engine.agg_train_loss.float().mean().item())
    norm = engine.get_global_grad_norm()
    grad_norm = float(norm.item() if hasattr(norm, "item") else norm) if norm is not None else None
    info = StepInfo(step=int(engine.global_steps), loss=loss, grad_norm=grad_norm,
                    step_time=None if signals.last_time is None else now - signals.last_time)
    signals.last_time = now
    signals.latest = info
    client.step_end(info.step, loss=info.loss, grad_norm=info.grad_norm)


def _refuse_sdc_on_zero3(engine, rank_client) -> None:
    """ZeRO-3 has no replicas to compare (``patches/deepspeed_zero3.py`` :data:`NO_REPLICA`):
    ``watchdog.check_params`` raises instead of hashing empty placeholders, and a ``bitflip`` /
    ``stuckbit`` injection, which only a replica check fires, is refused here, not left unfired."""
    from robust_plugins.errors import UnsupportedError
    from robust_plugins.patches import deepspeed_zero3

    if not deepspeed_zero3.is_zero3(engine):
        return
    rank_client.params_refused = deepspeed_zero3.NO_REPLICA
    if rank_client.injections.params:
        specs = ", ".join(f.spec() for f in rank_client.injections.params)
        raise UnsupportedError(
            f"robust run --inject {specs}: a parameter fault fires in a replica check, and "
            f"{deepspeed_zero3.NO_REPLICA}. Allowed on ZeRO-3: kill, hang, nan, spike, slow, badbatch.")


def _agreed_ok_to_save(engine) -> bool:
    """Every rank's monitor says yes (one MIN all-reduce: all ranks save, or none)."""
    import torch
    import torch.distributed as dist

    from robust_plugins.watchdog import client

    ok = client.ok_to_save(int(engine.global_steps))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def latest_step(engine) -> StepInfo | None:
    """The :class:`StepInfo` of ``engine``'s latest optimizer step (None before the first one or
    outside ``robust run``). Step observers registered after the watchdog's see the current step."""
    signals = getattr(getattr(engine, "robust_plugins", None), "watchdog", None)
    return signals.latest if signals is not None else None

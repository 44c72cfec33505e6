"""The rank side of fault injection (``robust run --inject``): what an armed injection does at its step.

The watchdog client (:mod:`.client`) calls in here only when this rank has an injection armed (or an
earlier ``slow`` one in force), so a step without any costs one check.
"""

from __future__ import annotations

import math
import os
import select
import sys
import time
from typing import TYPE_CHECKING, Any

from robust_plugins.watchdog import inject as _inject

if TYPE_CHECKING:
    from robust_plugins.watchdog.client import _Client

#: Upper bound of an injected Python hang; the monitor kills the rank long before.
HANG_INJECT_MAX_S = 3600.0


def armed(rank: int, spec: str | None) -> tuple[dict[int, _inject.Injection], list[_inject.Injection]]:
    """This rank's injections of ``spec`` (the ``ROBUST_INJECT`` value): ``({step: injection}`` fired
    by ``step_end``, ``[parameter injections by step]`` fired by ``check_params``)."""
    mine = [i for i in _inject.parse(spec) if i.rank == rank]
    injections = {i.step: i for i in mine if i.kind not in _inject.PARAM_KINDS}
    param_injections = sorted((i for i in mine if i.kind in _inject.PARAM_KINDS),
                              key=lambda i: i.step)
    return injections, param_injections


def fire_at_step(client: _Client, step: int, loss: float | None,
                 grad_norm: float | None) -> tuple[float | None, float | None]:
    """Fire the injection armed for ``step`` on this rank, if any (kill, hang, slow, or a NaN / spike
    in the loss or gradient norm, returned), after an earlier ``slow`` injection's sleep."""
    if client.slow_s:
        time.sleep(client.slow_s)  # outside any collective: compute time, as a slow GPU's
    fault = client.injections.pop(step, None)
    if fault is not None and fault.kind in _inject.RECURRING_KINDS and step in client.skip_steps:
        fault = None  # the bad batch was skipped: nothing to reproduce the spike
    if fault is not None:
        if fault.kind in ("nan", "spike", "badbatch"):
            def corrupt(v: float | None) -> float:
                return math.nan if fault.kind == "nan" else (v or 1.0) * _inject.SPIKE_MULTIPLIER
            if fault.option == "loss":
                loss = corrupt(loss)
            else:
                grad_norm = corrupt(grad_norm)
        client.send({"k": "inject", "s": step, "spec": fault.spec()}, wait=True)
        if fault.kind == "kill":
            sys.stdout.flush()
            os.kill(os.getpid(), fault.signum)
            time.sleep(5.0)  # a caught or ignored signal: say so instead of training on
            raise RuntimeError(f"injected {fault.spec()} did not end rank {client.rank}")
        if fault.kind == "hang":
            (_hang_in_syscall if fault.option == "syscall" else _hang_in_python)(HANG_INJECT_MAX_S)
        if fault.kind == "slow":
            client.slow_s = float(fault.option)
            time.sleep(client.slow_s)
    return loss, grad_norm


def fire_param_fault(client: _Client, step: int, params: list) -> None:
    """Flip the bit of the first parameter that a ``bitflip`` injection armed for ``step`` or
    earlier asks for (before the parameters are hashed)."""
    if client.param_injections and client.param_injections[0].step <= step:
        fault = client.param_injections.pop(0)
        client.send({"k": "inject", "s": step, "spec": fault.spec()}, wait=True)
        _flip_bit(params[0], int(fault.option))


def _flip_bit(param: Any, bit: int) -> None:
    import torch

    with torch.no_grad():
        flat = param.data.reshape(-1)
        raw = flat[:1].view(torch.int32) if flat.element_size() == 4 else None
        if raw is None:
            raise RuntimeError(f"bitflip injection needs a 4-byte parameter, got {param.dtype}")
        raw ^= (1 << bit) if bit < 31 else -(1 << 31)


def _hang_in_python(max_s: float) -> None:
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _hang_in_syscall(max_s: float) -> None:
    # One blocking system call: select() on a pipe nobody writes to. Signals interrupt it
    # (faulthandler still dumps) and Python resumes it with the remaining timeout (PEP 475).
    r, w = os.pipe()
    try:
        select.select([r], [], [], max_s)
    finally:
        os.close(r)
        os.close(w)

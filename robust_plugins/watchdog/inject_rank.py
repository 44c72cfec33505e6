"""The rank side of fault injection (``robust run --inject``): what an armed injection does at its step.

:class:`RankInjections` holds one rank's armed injections; the watchdog client (:mod:`.client`)
owns one and calls its hooks only when it has something due, so a step without any costs one
check. It knows the client only as a ``send`` callable: this module imports nothing of the
client's.
"""

from __future__ import annotations

import math
import os
import select
import sys
import time
from typing import Any, Callable

from robust_plugins.watchdog import inject as _inject
from robust_plugins.watchdog.protocol import MSG_INJECT

#: Upper bound of an injected Python hang; the monitor kills the rank long before.
HANG_INJECT_MAX_S = 3600.0


def armed(rank: int, spec: str | None) -> tuple[dict[int, _inject.Injection], list[_inject.Injection]]:
    """This rank's injections of ``spec`` (the ``ROBUST_INJECT`` value): ``({step: injection}`` fired
    by :meth:`RankInjections.fire_at_step`, ``[parameter injections by step]`` fired by
    :meth:`RankInjections.fire_param_fault`)."""
    mine = [i for i in _inject.parse(spec) if i.rank == rank]
    injections = {i.step: i for i in mine if i.kind not in _inject.PARAM_KINDS}
    param_injections = sorted((i for i in mine if i.kind in _inject.PARAM_KINDS),
                              key=lambda i: i.step)
    return injections, param_injections


class RankInjections:
    """The injections armed for this rank by ``spec`` (the ``ROBUST_INJECT`` value).

    ``send(msg, wait=True)`` announces a fault to the node monitor (the client's datagram, waiting
    for room) before the fault fires, so the monitor can tell an injected fault from a real one.
    A batch in ``skip_steps`` does not reproduce a recurring fault (``spike``, ``badbatch``).
    """

    def __init__(self, rank: int, spec: str | None, skip_steps: frozenset[int],
                 send: Callable[..., None]) -> None:
        self.rank = rank
        self.by_step, self.params = armed(rank, spec)
        """``{step: injection}`` not fired yet; parameter injections (``bitflip``) by step."""
        self.skip_steps = skip_steps
        self.slow_s = 0.0
        """Seconds an earlier ``slow`` injection adds to every step from then on."""
        self._send = send

    @property
    def due(self) -> bool:
        """Whether :meth:`fire_at_step` has anything to do: a step injection armed, or a ``slow`` in force."""
        return bool(self.by_step) or self.slow_s > 0

    def fire_at_step(self, step: int, loss: float | None,
                     grad_norm: float | None) -> tuple[float | None, float | None]:
        """Fire the injection armed for ``step``, if any (kill, hang, slow, or a NaN / spike in the
        loss or gradient norm, returned), after an earlier ``slow`` injection's sleep."""
        if self.slow_s:
            time.sleep(self.slow_s)  # outside any collective: compute time, as a slow GPU's
        fault = self.by_step.pop(step, None)
        if fault is not None and fault.kind in _inject.RECURRING_KINDS and step in self.skip_steps:
            fault = None  # the bad batch was skipped: nothing to reproduce the spike
        if fault is None:
            return loss, grad_norm
        if fault.kind in ("nan", "spike", "badbatch"):
            def corrupt(v: float | None) -> float:
                return math.nan if fault.kind == "nan" else (v or 1.0) * _inject.SPIKE_MULTIPLIER
            if fault.option == "loss":
                loss = corrupt(loss)
            else:
                grad_norm = corrupt(grad_norm)
        self._send({"k": MSG_INJECT, "s": step, "spec": fault.spec()}, wait=True)
        if fault.kind == "kill":
            sys.stdout.flush()
            os.kill(os.getpid(), fault.signum)
            time.sleep(5.0)  # a caught or ignored signal: say so instead of training on
            raise RuntimeError(f"injected {fault.spec()} did not end rank {self.rank}")
        if fault.kind == "hang":
            (_hang_in_syscall if fault.option == "syscall" else _hang_in_python)(HANG_INJECT_MAX_S)
        if fault.kind == "slow":
            self.slow_s = float(fault.option)
            time.sleep(self.slow_s)
        return loss, grad_norm

    def fire_param_fault(self, step: int, params: list) -> None:
        """Flip the bit of the first parameter that a ``bitflip`` injection armed for ``step`` or
        earlier asks for (before the parameters are hashed)."""
        if self.params and self.params[0].step <= step:
            fault = self.params.pop(0)
            self._send({"k": MSG_INJECT, "s": step, "spec": fault.spec()}, wait=True)
            _flip_bit(params[0], int(fault.option))


def _flip_bit(param: Any, bit: int) -> None:
    """Flip ``bit`` of ``param``'s first element. Bits are numbered as in a float32 word: a
    bfloat16 parameter (bf16 training) holds float32's bits 16 to 31, so ``bit`` 16 + k flips its
    bit k (the default 20 is a mantissa bit of both)."""
    import torch

    with torch.no_grad():
        flat = param.data.reshape(-1)
        if flat.element_size() == 4:
            flat[:1].view(torch.int32).bitwise_xor_(-(1 << 31) if bit == 31 else 1 << bit)
        elif flat.dtype == torch.bfloat16:
            if bit < 16:
                raise RuntimeError(f"bitflip injection bit={bit} is not held by a bfloat16 parameter, which "
                                   f"keeps a float32's bits 16 to 31: choose bit=16..31")
            flat[:1].view(torch.int16).bitwise_xor_(-(1 << 15) if bit == 31 else 1 << (bit - 16))
        else:
            raise RuntimeError(f"bitflip injection needs a 4-byte or bfloat16 parameter, got {param.dtype}")


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

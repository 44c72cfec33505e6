"""Which implementation runs a call: the Triton kernels or the plain-torch reference.

* CUDA tensors run the Triton kernels.
* CPU tensors run the reference, unless ``ROBUST_TRITON_ON_CPU=1``: then they run the Triton
  kernels in Triton's CPU interpreter, which needs ``TRITON_INTERPRET=1`` in the environment
  before the first kernel is imported (Triton reads it when ``@triton.jit`` decorates a
  function). This is for tests: the interpreter is slow (numpy underneath).
* ``backend="triton"`` or ``backend="reference"`` on a call overrides both.

Nothing falls back silently: if the Triton kernels were asked for (by device, switch or argument)
and cannot run, :class:`TritonUnavailableError` says what is missing.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

#: Environment switch: ``1`` sends CPU tensors to the Triton kernels (under ``TRITON_INTERPRET=1``).
ENV_TRITON_ON_CPU = "ROBUST_TRITON_ON_CPU"

BACKENDS = ("auto", "triton", "reference")


class TritonUnavailableError(RuntimeError):
    """The Triton kernels were requested but cannot run here; the message names what is missing."""


_import_error: str | None = None
_checked = False


def triton_import_error() -> str | None:
    """Why ``import triton`` fails (``None`` when it works). Checked once a process."""
    global _import_error, _checked
    if not _checked:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        except Exception as exc:  # a broken install raises more than ImportError
            _import_error = f"{type(exc).__name__}: {exc}"
        _checked = True
    return _import_error


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve(backend: str, device: torch.device) -> str:
    """Return ``"triton"`` or ``"reference"`` for a call on ``device`` (raises if Triton is asked for and missing)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is not known; allowed: {', '.join(BACKENDS)}.")
    if backend == "reference":
        return "reference"
    if backend == "auto" and device.type != "cuda":
        if os.environ.get(ENV_TRITON_ON_CPU, "0") != "1":
            return "reference"
    why = "backend='triton' was passed" if backend == "triton" else (
        "CUDA tensors run the Triton kernels" if device.type == "cuda" else f"{ENV_TRITON_ON_CPU}=1 is set"
    )
    error = triton_import_error()
    if error is not None:
        raise TritonUnavailableError(
            f"{why}, but triton cannot be imported ({error}). Install it (`pip install triton`, or "
            f"`pip install robust_plugins[triton]`), or pass backend='reference' to run the plain-torch codecs."
        )
    if device.type != "cuda" and not _interpret_env():
        raise TritonUnavailableError(
            f"{why} for {device.type} tensors, which Triton runs only in its interpreter: set "
            f"TRITON_INTERPRET=1 in the environment before the first kernel is imported, or use "
            f"backend='reference' (and leave {ENV_TRITON_ON_CPU} unset)."
        )
    return "triton"


def kernel_module(name: str, device: torch.device) -> ModuleType:
    """Import ``triton_ops.kernels.<name>`` (one kernel a module) and check it can run on ``device``."""
    module = importlib.import_module(f"triton_ops.kernels.{name}")
    if device.type != "cuda":
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(module.KERNEL, InterpretedFunction):
            raise TritonUnavailableError(
                f"triton_ops.kernels.{name} was imported before TRITON_INTERPRET=1 was set, so its kernel is "
                f"compiled for a GPU and cannot run on {device.type} tensors; set TRITON_INTERPRET=1 "
                f"before the first Triton call of the process."
            )
    return module

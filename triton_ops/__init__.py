"""Gradient codec kernels: fused Triton kernels and their plain-torch reference.

This package knows nothing of ``robust_plugins`` (the dependency points the other way) and
imports without Triton: the kernels (``triton_ops.kernels.quantize_ef``, ``.dequantize``,
``.reduce_requantize``, one a module) are imported only when a call needs them, and
then a missing Triton raises :class:`TritonUnavailableError` naming what is missing.

* :mod:`triton_ops.reference` is the specification (rounding, scales, zero blocks, NaN/Inf).
* :func:`quantize_ef`, :func:`dequantize`, :func:`dequantize_sum` and :func:`reduce_requantize`
  dispatch per call: CUDA tensors to the Triton kernels, CPU tensors to the reference;
  ``ROBUST_TRITON_ON_CPU=1`` together with ``TRITON_INTERPRET=1`` runs the kernels on CPU
  tensors in Triton's interpreter (for tests); ``backend="triton"`` / ``"reference"`` forces one.
  They are registered as ``torch.ops.robust_plugins.*`` custom ops for ``torch.compile``.
"""

from __future__ import annotations

from triton_ops import reference
from triton_ops._backend import ENV_TRITON_ON_CPU, TritonUnavailableError, triton_import_error
from triton_ops.ops import dequantize, dequantize_sum, quantize_ef, reduce_requantize

__all__ = [
    "ENV_TRITON_ON_CPU",
    "TritonUnavailableError",
    "dequantize",
    "dequantize_sum",
    "quantize_ef",
    "reduce_requantize",
    "reference",
    "triton_import_error",
]

"""Public codec entry points: each call runs the Triton kernels or the plain-torch reference.

Which one runs is decided per call by :func:`triton_ops._backend.resolve`: CUDA tensors run the
Triton kernels, CPU tensors the reference, ``ROBUST_TRITON_ON_CPU=1`` (with ``TRITON_INTERPRET=1``)
runs the kernels on CPU tensors in Triton's interpreter, and ``backend="triton"`` /
``backend="reference"`` forces one. Both implementations give the same codes and scales (see
``tests/unit/test_triton_kernels.py`` for the one documented difference: ``sign`` scales may
differ in their last bits, because the block sum runs in another order).

Each function is a ``torch.library.custom_op`` in the ``robust_plugins`` namespace
(``torch.ops.robust_plugins.quantize_ef`` ...) with a fake implementation, so that
``torch.compile`` traces through it as one opaque op instead of breaking the graph.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from triton_ops import _backend
from triton_ops import reference as ref


def _impl(kernel: str, device: torch.device, backend: str):
    """The module whose functions run this call: the reference, or ``triton_ops.kernels.<kernel>``."""
    if _backend.resolve(backend, device) == "reference":
        return ref
    return _backend.kernel_module(kernel, device)


def _device_guard(device: torch.device):
    """The tensors' own device as the current one while a call runs (a CUDA device; nothing for the
    CPU). Triton launches on the current device and stream: a caller on another thread or with
    another current device would otherwise run the kernel on the wrong GPU with these pointers."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _own(t: Tensor) -> Tensor:
    # A custom op must not return a view (the reference slices its results); the copy is made only
    # on the reference path, where it costs what the slicing already did.
    return t.clone() if t._is_view() else t


# -- quantize_ef ------------------------------------------------------------------------------------


@torch.library.custom_op("robust_plugins::quantize_ef", mutates_args=("residual",))
def _quantize_ef_op(
    grad: Tensor, residual: Optional[Tensor], codec: str, block_size: int, rounding: str, seed: Optional[int],
    backend: str,
) -> tuple[Tensor, Tensor]:
    impl = _impl("quantize_ef", grad.device, backend)
    with _device_guard(grad.device):
        codes, scales = impl.quantize_ef(grad, residual, codec=codec, block_size=block_size, rounding=rounding,
                                         seed=seed)
    return _own(codes), _own(scales)


@_quantize_ef_op.register_fake
def _quantize_ef_fake(grad, residual, codec, block_size, rounding, seed, backend):
    ref._check_block_size(block_size)
    ref._check_rounding(codec, rounding, seed)
    return ref.empty_encoded(grad.numel(), codec=codec, block_size=block_size, device=grad.device)


def quantize_ef(
    grad: Tensor,
    residual: Tensor | None = None,
    *,
    codec: str,
    block_size: int,
    rounding: str = "nearest",
    seed: int | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Quantize ``grad + residual`` blockwise in one pass; update ``residual`` in place.

    Args:
        grad: flat float tensor (fp32, bf16 or fp16) whose length is a multiple of ``block_size``.
        residual: fp32 error-feedback state of ``grad``'s shape, or ``None`` (no error feedback).
            Becomes ``grad + residual - dequantize(codes)``, with non-finite blocks reset to 0.
        codec: ``int8``, ``int4`` (two a byte), ``sign`` (eight a byte) or ``bf16``.
        block_size: elements sharing one fp32 scale (a multiple of 8).
        rounding: ``nearest`` (half to even) or ``stochastic`` (int8 / int4; needs ``seed``).
        seed: stochastic rounding's seed; the same seed gives the same codes on every device.
        backend: ``auto`` (by device), ``triton`` or ``reference``.

    Returns:
        ``(codes, scales)`` exactly as :func:`triton_ops.reference.quantize_ef` returns them.
    """
    return _quantize_ef_op(grad.detach(), residual, codec, block_size, rounding, seed, backend)


# -- dequantize -------------------------------------------------------------------------------------


@torch.library.custom_op("robust_plugins::dequantize", mutates_args=())
def _dequantize_op(codes: Tensor, scales: Tensor, codec: str, block_size: int, numel: int, backend: str) -> Tensor:
    impl = _impl("dequantize", codes.device, backend)
    with _device_guard(codes.device):
        return _own(impl.dequantize(codes, scales, codec=codec, block_size=block_size, numel=numel))


@_dequantize_op.register_fake
def _dequantize_fake(codes, scales, codec, block_size, numel, backend):
    ref._check_codec(codec)
    ref._check_block_size(block_size)
    return codes.new_empty(numel, dtype=torch.float32)


@torch.library.custom_op("robust_plugins::dequantize_into", mutates_args=("out",))
def _dequantize_into_op(
    codes: Tensor, scales: Tensor, out: Tensor, codec: str, block_size: int, accumulate: bool, backend: str
) -> None:
    impl = _impl("dequantize", codes.device, backend)
    with _device_guard(codes.device):
        impl.dequantize(codes, scales, codec=codec, block_size=block_size, numel=out.numel(), out=out,
                        accumulate=accumulate)


@_dequantize_into_op.register_fake
def _dequantize_into_fake(codes, scales, out, codec, block_size, accumulate, backend):
    ref._check_codec(codec)
    ref._check_block_size(block_size)


def dequantize(
    codes: Tensor,
    scales: Tensor,
    *,
    codec: str,
    block_size: int,
    numel: int,
    out: Tensor | None = None,
    accumulate: bool = False,
    backend: str = "auto",
) -> Tensor:
    """Decode ``(codes, scales)`` to the first ``numel`` values in fp32.

    With ``out`` (contiguous fp32 ``[numel]``) the values are written there, or added to it with
    ``accumulate=True`` (``out += q * scale``), and ``out`` is returned. ``backend`` as in
    :func:`quantize_ef`; semantics of :func:`triton_ops.reference.dequantize`.
    """
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out= (the fp32 tensor to add the decoded values to).")
        return _dequantize_op(codes, scales, codec, block_size, numel, backend)
    if out.dtype != torch.float32 or out.shape != (numel,):
        raise ValueError(f"out must be fp32 of shape ({numel},), got {out.dtype} {tuple(out.shape)}.")
    _dequantize_into_op(codes, scales, out, codec, block_size, accumulate, backend)
    return out


def dequantize_sum(
    codes_list: list[Tensor],
    scales_list: list[Tensor],
    *,
    codec: str,
    block_size: int,
    numel: int,
    scale_factor: float = 1.0,
    backend: str = "auto",
) -> Tensor:
    """Decode one tensor from each rank and add them in fp32 in list order, times ``scale_factor``.

    :func:`dequantize` into one buffer, then with ``accumulate=True``: the same operations, in
    the same order, as :func:`triton_ops.reference.dequantize_sum`.
    """
    if len(codes_list) != len(scales_list) or not codes_list:
        raise ValueError(
            f"need one scales tensor per codes tensor and at least one of each, got "
            f"{len(codes_list)} codes and {len(scales_list)} scales."
        )
    acc = torch.empty(numel, dtype=torch.float32, device=codes_list[0].device)
    for i, (codes, scales) in enumerate(zip(codes_list, scales_list)):
        dequantize(codes, scales, codec=codec, block_size=block_size, numel=numel, out=acc, accumulate=i > 0,
                   backend=backend)
    if scale_factor != 1.0:
        acc *= scale_factor
    return acc


# -- reduce_requantize ------------------------------------------------------------------------------


@torch.library.custom_op("robust_plugins::reduce_requantize", mutates_args=("residual",))
def _reduce_requantize_op(
    codes_list: list[Tensor], scales_list: list[Tensor], residual: Optional[Tensor], codec: str, block_size: int,
    scale_factor: float, valid_numel: Optional[int], rounding: str, seed: Optional[int], backend: str,
) -> tuple[Tensor, Tensor]:
    impl = _impl("reduce_requantize", codes_list[0].device, backend)
    with _device_guard(codes_list[0].device):
        codes, scales = impl.reduce_requantize(
            codes_list, scales_list, codec=codec, block_size=block_size, residual=residual,
            scale_factor=scale_factor, valid_numel=valid_numel, rounding=rounding, seed=seed,
        )
    return _own(codes), _own(scales)


@_reduce_requantize_op.register_fake
def _reduce_requantize_fake(codes_list, scales_list, residual, codec, block_size, scale_factor, valid_numel,
                            rounding, seed, backend):
    ref._check_block_size(block_size)
    ref._check_rounding(codec, rounding, seed)
    numel = ref._codes_numel(codes_list[0], codec)
    return ref.empty_encoded(numel, codec=codec, block_size=block_size, device=codes_list[0].device)


def reduce_requantize(
    codes_list: list[Tensor],
    scales_list: list[Tensor],
    *,
    codec: str,
    block_size: int,
    residual: Tensor | None = None,
    scale_factor: float = 1.0,
    valid_numel: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """The reducing side of a compressed all-reduce for one chunk, in one pass.

    Decodes the chunk each rank sent (``codes_list[r]``, ``scales_list[r]``), sums them in fp32
    in rank order, multiplies by ``scale_factor``, zeroes elements at index ``>= valid_numel``
    (padding), adds the server-side ``residual`` (fp32, updated in place as in
    :func:`quantize_ef`) and requantizes. Returns ``(codes, scales)``; semantics of
    :func:`triton_ops.reference.reduce_requantize`. ``backend`` as in :func:`quantize_ef`.
    """
    if not codes_list or len(codes_list) != len(scales_list):
        raise ValueError(
            f"need one scales tensor per codes tensor and at least one of each, got "
            f"{len(codes_list)} codes and {len(scales_list)} scales."
        )
    return _reduce_requantize_op(list(codes_list), list(scales_list), residual, codec, block_size,
                                 float(scale_factor), valid_numel, rounding, seed, backend)

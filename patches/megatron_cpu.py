"""CPU shim for megatron-core: run its GPT, DDP, TP, pipeline and optimizer code without a GPU.

For tests and CPU presets. megatron-core 0.16 assumes CUDA in places that a CPU run reaches:

* Buffers are allocated on ``torch.cuda.current_device()``: DDP's contiguous grad (and
  distributed-optimizer param) buffers, the global memory buffer attention uses, TP all-gather
  outputs, the distributed optimizer's buckets, and more: about 30 call sites in 0.16.
* The tensor-parallel RNG tracker (``tensor_parallel/random.py``) stores and swaps CUDA generator
  states: ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``, and ``CudaRNGStatesTracker.add`` and
  ``model_parallel_cuda_manual_seed`` call ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed``.
* ``device="cuda"`` literals in tensor factories: the pipeline schedules' token counters
  (``pipeline_parallel/schedules.py``), the optimizers' found-inf / loss-scale tensors
  (``optimizer/optimizer.py``, ``grad_scaler.py``), ``clip_grads.py`` and the pure-torch
  ``local_multi_tensor_l2_norm`` (``utils.py``) that replaces apex/TE kernels.
* ``param.type() == 'torch.cuda.FloatTensor'`` (and Half/BFloat16) decides how
  ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer`` build their main parameters
  (anything else raises "Wrapped parameters must be one of torch.cuda.FloatTensor...");
  ``clip_grad_by_total_norm_fp32`` asserts it on every gradient.
* ``Tensor.cuda()``: tied embeddings with pipeline parallelism move the output-layer weight
  (``language_module.py``), the grad scaler's ``load_state_dict`` its scale.
* Mixture of experts (both token dispatchers, alltoall and allgather): the alltoall dispatcher
  makes a ``torch.cuda.Stream`` at construction and moves its split sizes to the host on it
  (``token_dispatcher.py``, ``_maybe_dtoh_and_synchronize``); ``moe_utils.maybe_move_tensor_to_cpu``
  turns split sizes into numpy arrays for CUDA tensors only, so on the CPU they reach
  ``all_to_all_single`` as tensors, which it rejects; the router's GEMM reads ``te_general_gemm``,
  a name bound only when Transformer Engine imports (a megatron-core 0.16 bug without TE); the
  aux-loss tracker has a ``device="cuda"`` literal (``moe_utils.py``).

It refuses to install when CUDA is available: on a GPU machine megatron-core must run unchanged,
and a shim that moved its buffers to the CPU would silently cost orders of magnitude. It is
idempotent, keeps every original in ``__wrapped__``, and :func:`undo` restores them.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from robust_plugins._logging import get_logger
from robust_plugins.errors import UnsupportedError
from robust_plugins.patches import _guard

log = get_logger(__name__)

_installed: list[tuple[object, str, object]] = []  # (owner, attribute, original) to restore


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    """CPU stand-in for ``_get_cuda_rng_state``: the CPU generator's state (always a fresh copy)."""
    if graph_safe:
        raise UnsupportedError("megatron CPU shim: graph-safe (CUDA graph) RNG states need a GPU; "
                               "set use_cudagraphable_rng=False for CPU runs.")
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    """CPU stand-in for ``_set_cuda_rng_state``."""
    if graph_safe:
        raise UnsupportedError("megatron CPU shim: graph-safe (CUDA graph) RNG states need a GPU; "
                               "set use_cudagraphable_rng=False for CPU runs.")
    torch.set_rng_state(new_state)


class _CpuRngFacade:
    """What ``tensor_parallel.random`` sees as ``torch.cuda`` for the RNG calls it makes on CPU."""

    get_rng_state = staticmethod(lambda device="cuda": torch.get_rng_state())
    set_rng_state = staticmethod(lambda new_state, device="cuda": torch.set_rng_state(new_state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchWithCpuRng:
    """A view of the ``torch`` module whose ``cuda`` attribute is :class:`_CpuRngFacade`.

    ``tensor_parallel/random.py`` reaches CUDA's RNG as ``torch.cuda.<fn>`` through its module
    global ``torch``; replacing that global (not ``torch.cuda`` itself) keeps the redirect inside
    that one module.
    """

    cuda = _CpuRngFacade()

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_synchronize(device=None):
    """Stand-in for ``torch.cuda.synchronize``: CPU work is already synchronous."""


def _cpu_current_device():
    """Stand-in for ``torch.cuda.current_device`` on machines without CUDA (see the docstring)."""
    return "cpu"


def _cpu_tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """Stand-in for ``Tensor.cuda`` without CUDA: the tensor stays where it is (the CPU)."""
    return self


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


def _on_cpu(factory):
    """``factory`` with a ``device`` naming CUDA read as the CPU (keyword-only in every factory)."""
    def make(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return make


class _TorchOnCpu:
    """A view of the ``torch`` module whose tensor factories put ``device="cuda"`` on the CPU.

    Replaces the module global ``torch`` of :data:`_CUDA_LITERAL_MODULES` only, so the redirect
    stays inside the modules whose literals it is for; every other attribute is torch's own.
    """

    zeros = staticmethod(_on_cpu(torch.zeros))
    ones = staticmethod(_on_cpu(torch.ones))
    empty = staticmethod(_on_cpu(torch.empty))
    full = staticmethod(_on_cpu(torch.full))
    tensor = staticmethod(_on_cpu(torch.tensor))
    arange = staticmethod(_on_cpu(torch.arange))

    def __getattr__(self, name):
        return getattr(torch, name)


#: Modules of megatron-core 0.16 with ``device="cuda"`` literals on the paths a CPU run takes.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens of every schedule
    "megatron.core.optimizer.optimizer",  # found_inf, _dummy_overflow_buf, _scale_one, _scale
    "megatron.core.optimizer.clip_grads",  # total norm, overflow buffers, zero counts
    "megatron.core.optimizer.grad_scaler",  # scale, min_scale, growth and backoff factors
    "megatron.core.utils",  # local_multi_tensor_l2_norm (the fallback for apex/TE kernels)
    "megatron.core.transformer.moe.moe_utils",  # the MoE aux-loss tracker's values
)


class _CpuEvent:
    """Stand-in for a CUDA event on the CPU: work before it is already done."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream=None) -> None:
        """Nothing to wait for."""


class _CpuStream:
    """Stand-in for a CUDA stream on the CPU, where every op runs synchronously in program order."""

    def wait_stream(self, stream) -> None:
        """Program order already holds."""

    def record_event(self, event=None) -> _CpuEvent:
        """An event that is complete at once."""
        return _CpuEvent()

    def synchronize(self) -> None:
        """Nothing to wait for."""


_CPU_STREAM = _CpuStream()


class _CpuStreamFacade:
    """What ``token_dispatcher`` sees as ``torch.cuda``: streams that order nothing (CPU ops are
    synchronous), everything else torch.cuda's own."""

    Stream = _CpuStream
    current_stream = staticmethod(lambda device=None: _CPU_STREAM)
    stream = staticmethod(lambda stream=None: contextlib.nullcontext())

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchWithCpuStreams:
    """A view of the ``torch`` module whose ``cuda`` attribute is :class:`_CpuStreamFacade`
    (the module global of ``token_dispatcher`` only)."""

    cuda = _CpuStreamFacade()

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for CPU tensors: what the CUDA branch returns (a
    host copy, a numpy array with ``as_numpy``), so split sizes reach ``all_to_all_single`` as
    the integer sequence it accepts."""
    if torch.is_tensor(tensor):
        tensor = tensor.detach().clone()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor

_ABSENT = object()  # an attribute the owner's own __dict__ did not have (inherited): delete on undo

_CUDA_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
               "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}
_type_scope = {"depth": 0, "original": None}
_type_lock = threading.RLock()


@contextlib.contextmanager
def _cuda_type_names():
    """While inside, ``Tensor.type()`` (no arguments) names CPU float tensors ``torch.cuda.*``.

    Process-wide for the duration (``Tensor.type`` is one method of one class): held only around
    optimizer construction and gradient clipping, on the training thread; nested uses are counted.
    """
    with _type_lock:
        if _type_scope["depth"] == 0:
            original = torch.Tensor.type
            _type_scope["original"] = vars(torch.Tensor).get("type", _ABSENT)

            def type_(self, dtype=None, non_blocking=False, **kwargs):
                name = original(self, dtype, non_blocking, **kwargs)
                return _CUDA_NAMES.get(name, name) if dtype is None and not kwargs else name

            torch.Tensor.type = type_
        _type_scope["depth"] += 1
    try:
        yield
    finally:
        with _type_lock:
            _type_scope["depth"] -= 1
            if _type_scope["depth"] == 0:
                own, _type_scope["original"] = _type_scope["original"], None
                if own is _ABSENT:
                    del torch.Tensor.type
                else:
                    torch.Tensor.type = own


def _with_cuda_type_names(original):
    """``original`` run inside :func:`_cuda_type_names` (its CUDA type checks pass on CPU)."""
    def replacement(*args, **kwargs):
        with _cuda_type_names():
            return original(*args, **kwargs)
    return replacement


_MODULE_VIEWS = (_TorchOnCpu, _TorchWithCpuRng, _TorchWithCpuStreams)


def active() -> bool:
    """True while the shim is installed."""
    return bool(_installed)


def _targets() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) of every function the shim replaces."""
    import importlib

    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    float16 = mcore_optimizer.Float16OptimizerWithFloat16Params
    distopt = distrib_optimizer.DistributedOptimizer
    targets = [
        (torch.cuda, "current_device", _cpu_current_device),
        (torch.cuda, "synchronize", _cpu_synchronize),
        (torch.Tensor, "cuda", _cpu_tensor_cuda),
        (tp_random, "_get_cuda_rng_state", _cpu_get_rng_state),
        (tp_random, "_set_cuda_rng_state", _cpu_set_rng_state),
        (float16, "__init__", _with_cuda_type_names(float16.__init__)),
        (distopt, "__init__", _with_cuda_type_names(distopt.__init__)),
        # optimizer.py calls the name it imported from clip_grads: both bindings.
        (clip_grads, "clip_grad_by_total_norm_fp32", _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)),
        (mcore_optimizer, "clip_grad_by_total_norm_fp32",
         _with_cuda_type_names(mcore_optimizer.clip_grad_by_total_norm_fp32)),
    ]
    for name in _CUDA_LITERAL_MODULES:
        targets.append((importlib.import_module(name), "torch", _TorchOnCpu()))
    targets.append((tp_random, "torch", _TorchWithCpuRng()))
    targets += [
        (token_dispatcher, "torch", _TorchWithCpuStreams()),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _cpu_maybe_move_tensor_to_cpu),
    ]
    if "te_general_gemm" not in vars(moe_utils):  # the router's GEMM then takes its torch branch
        targets.append((moe_utils, "te_general_gemm", None))
    return targets


def install() -> None:
    """Install the CPU shim (idempotent). Raises UnsupportedError when CUDA is available.

    Makes ``torch.cuda.current_device()`` answer ``"cpu"``, ``torch.cuda.synchronize()`` (called
    by ``dist_checkpointing``'s writer) return at once and ``Tensor.cuda()`` return the tensor
    itself; gives the RNG tracker CPU generator states (through a stand-in for the ``torch``
    global of ``tensor_parallel.random`` only); replaces the ``torch`` global of the five
    modules with the literals (:data:`_CUDA_LITERAL_MODULES`) by a view whose tensor factories
    read ``device="cuda"`` as the CPU; and runs the three functions that test ``Tensor.type()``
    with CPU tensors named ``torch.cuda.*`` for their duration (:func:`_cuda_type_names`). The
    process-wide redirects are safe exactly because the shim only installs when CUDA is not
    available: there the originals can only raise "Torch not compiled with CUDA enabled" (or "no
    CUDA GPUs"), so no working code path changes. ``Tensor.type()`` does work on CPU, so it is
    renamed only inside those three calls (construction of the two optimizers and gradient
    clipping, on the training thread). With the shim, megatron's own
    ``get_forward_backward_func`` schedules (1F1B and interleaved) and
    ``get_megatron_optimizer`` (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
    ``DistributedOptimizer``, ``ChainedOptimizer``; torch's Adam where TE and apex are missing)
    run unchanged over gloo, and megatron's RNG semantics (separate default, model-parallel and
    expert streams, forked around TP-region dropout) hold on the CPU generator.
    """
    if torch.cuda.is_available():
        raise UnsupportedError(
            "megatron CPU shim: CUDA is available, so megatron-core must run on the GPU unchanged. "
            "Do not call robust_plugins.patches.megatron_cpu.install() on GPU machines (the "
            "megatron_gpt recipe only calls it for --device cpu)."
        )
    from robust_plugins.patches.megatron import check_megatron_version

    check_megatron_version()
    if active():
        return
    for owner, name, replacement in _targets():
        original = getattr(owner, name, _ABSENT)
        own = vars(owner).get(name, _ABSENT) if isinstance(owner, type) else original
        if callable(original) and not isinstance(replacement, _MODULE_VIEWS):  # functions; views as they are
            replacement = _guard.wrap(original, replacement)
        setattr(owner, name, replacement)
        _installed.append((owner, name, own))
    log.info("robust_plugins: megatron CPU shim installed: replaced torch.cuda.current_device (-> 'cpu'), "
             "torch.cuda.synchronize, Tensor.cuda (no move), the RNG tracker's CUDA state calls (CPU "
             "generator), the torch global of %s (device='cuda' factories -> CPU), and "
             "Float16OptimizerWithFloat16Params.__init__, DistributedOptimizer.__init__ and "
             "clip_grad_by_total_norm_fp32 (CPU tensors typed torch.cuda.* inside), and for MoE the token "
             "dispatcher's streams, its split sizes' host copies and moe_utils.te_general_gemm (None without TE)",
             ", ".join(m.rsplit(".", 1)[-1] for m in _CUDA_LITERAL_MODULES))


def undo() -> None:
    """Restore everything :func:`install` replaced."""
    while _installed:
        owner, name, original = _installed.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)

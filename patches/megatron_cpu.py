"""CPU shim for megatron-core: run its GPT, DDP and TP code without a GPU (tests, CPU presets).

megatron-core 0.16 assumes CUDA in two places that a CPU run reaches (``../shared/HOSTS.md``):

* Buffers are allocated on ``torch.cuda.current_device()``: DDP's contiguous grad (and
  distributed-optimizer param) buffers in ``_ParamAndGradBuffer.__init__``, the global memory
  buffer attention uses (``utils.GlobalMemoryBuffer.get_tensor``), TP all-gather outputs
  (``tensor_parallel/mappings.py``), and more: about 30 call sites in 0.16.
* The tensor-parallel RNG tracker (``tensor_parallel/random.py``) stores and swaps CUDA generator
  states: ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``, and ``CudaRNGStatesTracker.add`` and
  ``model_parallel_cuda_manual_seed`` call ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed``.

:func:`install` makes ``torch.cuda.current_device()`` answer ``"cpu"`` and
``torch.cuda.synchronize()`` (called by ``dist_checkpointing``'s writer before it copies tensors)
return at once, and gives the RNG tracker
CPU generator states (``torch.get_rng_state`` / ``torch.set_rng_state`` / ``torch.manual_seed``,
through a stand-in for the ``torch`` global of ``tensor_parallel.random`` only). Redirecting
these two process-wide is safe exactly because the shim only installs when CUDA is not
available: there the original can only raise "Torch not compiled with CUDA enabled" (or "no CUDA
GPUs"), so no working code path changes; one at a time would mean patching every call site. With
it a 2-rank (TP 1 or 2) GPT + DDP run over gloo trains with its loss going down, and megatron's
RNG semantics (separate default, model-parallel and expert streams, forked around TP-region
dropout) hold on the CPU generator.

It refuses to install when CUDA is available: on a GPU machine megatron-core must run unchanged,
and a shim that moved its buffers to the CPU would silently cost orders of magnitude. It is
idempotent, keeps every original in ``__wrapped__``, and :func:`undo` restores them.
"""

from __future__ import annotations

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


def active() -> bool:
    """True while the shim is installed."""
    return bool(_installed)


def install() -> None:
    """Install the CPU shim (idempotent). Raises UnsupportedError when CUDA is available."""
    if torch.cuda.is_available():
        raise UnsupportedError(
            "megatron CPU shim: CUDA is available, so megatron-core must run on the GPU unchanged. "
            "Do not call robust_plugins.patches.megatron_cpu.install() on GPU machines (the "
            "megatron_gpt recipe only calls it for --device cpu)."
        )
    from megatron.core.tensor_parallel import random as tp_random

    from robust_plugins.patches.megatron import check_megatron_version

    check_megatron_version()
    if active():
        return
    targets = [
        (torch.cuda, "current_device", _cpu_current_device),
        (torch.cuda, "synchronize", _cpu_synchronize),
        (tp_random, "_get_cuda_rng_state", _cpu_get_rng_state),
        (tp_random, "_set_cuda_rng_state", _cpu_set_rng_state),
    ]
    for owner, name, replacement in targets:
        original = getattr(owner, name)
        setattr(owner, name, _guard.wrap(original, replacement))
        _installed.append((owner, name, original))
    _installed.append((tp_random, "torch", tp_random.torch))
    tp_random.torch = _TorchWithCpuRng()
    log.info("robust_plugins: megatron CPU shim installed (torch.cuda.current_device -> 'cpu', RNG "
             "tracker on the CPU generator); replaced torch.cuda.current_device, torch.cuda.synchronize, _get_cuda_rng_state, "
             "_set_cuda_rng_state and tensor_parallel.random's torch.cuda RNG calls")


def undo() -> None:
    """Restore everything :func:`install` replaced."""
    while _installed:
        owner, name, original = _installed.pop()
        setattr(owner, name, original)

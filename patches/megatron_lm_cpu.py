"""CPU shim for Megatron-LM's own loop (``megatron/training``): run ``pretrain_gpt.py`` without a GPU.

For tests and CPU trials; on top of :mod:`robust_plugins.patches.megatron_cpu` (megatron-core's
buffers, RNG tracker, optimizers), which :func:`install` installs first. Megatron-LM
``core_v0.16.1`` assumes CUDA in its loop where megatron-core does not:

* ``training/initialize.py``: ``assert torch.cuda.is_available()`` (``pretrain`` never passes
  ``allow_no_cuda``); ``torch.cuda.device_count() == 0`` skips ``initialize_model_parallel`` and
  the tensor-parallel RNG seeding; ``set_device``; fused kernels built with ``nvcc``
  (``fused_kernels.load``); the JIT warm-up makes ``device="cuda"`` tensors.
* ``device='cuda'`` literals in ``training/training.py`` (start-time broadcast, loss sums,
  exit-duration and dataloader flags), ``training/checkpointing.py`` (max iteration),
  ``core/rerun_state_machine.py`` and ``core/transformer/utils.py`` (the causal mask).
* CUDA streams around DDP wrapping (``training.py``, ``get_model``), ``torch.cuda.empty_cache``,
  and the CUDA RNG state in checkpoints (``checkpointing.py``, ``rerun_state_machine.py``).
* ``distrib_optimizer.py``'s ``load_state_dict`` asserts one shared ``step`` for torch Adam
  (``assert len(steps) == 1``), which :mod:`robust_plugins.patches.megatron_optim` unshares:
  its install is part of this shim.

Each redirect replaces the module global ``torch`` of the modules listed in :data:`_MODULES` by a
view (tensor factories read ``device="cuda"`` as the CPU; ``torch.cuda`` answers streams, the RNG
state and the device questions for the CPU), so nothing outside those modules changes. Like the
megatron-core shim it refuses to install when CUDA is available, is idempotent and undoable.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch

from robust_plugins._logging import get_logger
from robust_plugins.errors import UnsupportedError
from robust_plugins.patches import megatron_cpu, megatron_optim

log = get_logger(__name__)

_installed: list[tuple[object, str, object]] = []


class _NullStream:
    """A CUDA stream on the CPU: work is already ordered, so waiting does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event


def _noop(*args, **kwargs) -> None:
    return None


class _CudaOnCpu:
    """What Megatron-LM's loop sees as ``torch.cuda`` on a CPU machine.

    ``device_count`` answers 1 and ``is_available`` True only for ``initialize.py`` (``gpu_like``):
    there they decide whether model-parallel groups and the RNG tracker are set up, which a CPU
    run needs. Everything else is torch's own (and raises as on any CPU machine).
    """

    def __init__(self, gpu_like: bool):
        self._gpu_like = gpu_like

    Stream = _NullStream
    current_device = staticmethod(lambda: "cpu")
    synchronize = staticmethod(_noop)
    empty_cache = staticmethod(_noop)
    set_device = staticmethod(_noop)
    set_stream = staticmethod(_noop)
    current_stream = staticmethod(lambda device=None: _NullStream())
    stream = staticmethod(lambda stream=None: contextlib.nullcontext())
    get_rng_state = staticmethod(lambda device="cuda": torch.get_rng_state())
    set_rng_state = staticmethod(lambda new_state, device="cuda": torch.set_rng_state(new_state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))

    def is_available(self) -> bool:
        return self._gpu_like or torch.cuda.is_available()

    def device_count(self) -> int:
        return 1 if self._gpu_like else torch.cuda.device_count()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _on_cpu(factory):
    """``factory`` with a ``device`` naming CUDA read as the CPU."""
    def make(*args, **kwargs):
        device = kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cuda" or (
                isinstance(device, str) and device.split(":")[0] == "cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return make


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "zeros_like",
              "ones_like", "empty_like")


class _TorchView(types.SimpleNamespace):
    """A view of the ``torch`` module for one Megatron-LM module (see the module docstring)."""

    def __init__(self, gpu_like: bool):
        super().__init__(cuda=_CudaOnCpu(gpu_like), **{n: _on_cpu(getattr(torch, n)) for n in _FACTORIES})

    def __getattr__(self, name):
        return getattr(torch, name)


#: Megatron-LM modules whose ``torch`` global is replaced, and whether they see a "GPU" (see
#: :class:`_CudaOnCpu`).
_MODULES = (
    ("megatron.training.initialize", True),
    ("megatron.training.training", False),
    ("megatron.training.checkpointing", False),
    ("megatron.training.utils", False),
    ("megatron.core.rerun_state_machine", False),
    ("megatron.core.transformer.utils", False),
)


def _skip_fused_kernels():
    """``fused_kernels`` as ``initialize.py`` sees it on CPU: nothing to build (no nvcc, no GPU)."""
    return types.SimpleNamespace(load=_noop)


def active() -> bool:
    """True while the shim is installed."""
    return bool(_installed)


def install() -> None:
    """Install the megatron-core CPU shim, the distributed optimizer's step fix and the
    redirects above (idempotent). Raises UnsupportedError when CUDA is available."""
    if torch.cuda.is_available():
        raise UnsupportedError(
            "Megatron-LM CPU shim: CUDA is available, so Megatron-LM must run on the GPU unchanged. "
            "robust_plugins.megatron_lm installs it only where torch.cuda.is_available() is False.")
    megatron_cpu.install()
    megatron_optim.install()
    if active():
        return
    for name, gpu_like in _MODULES:
        module = importlib.import_module(name)
        _installed.append((module, "torch", module.torch))
        module.torch = _TorchView(gpu_like)
    initialize = importlib.import_module("megatron.training.initialize")
    _installed.append((initialize, "fused_kernels", initialize.fused_kernels))
    initialize.fused_kernels = _skip_fused_kernels()
    log.info("robust_plugins: Megatron-LM CPU shim installed: the torch global of %s (device='cuda' -> CPU, "
             "CUDA streams and RNG on the CPU) and initialize.fused_kernels (nothing to build)",
             ", ".join(n for n, _ in _MODULES))


def undo() -> None:
    """Restore what :func:`install` replaced (the megatron-core shim stays: undo it separately)."""
    while _installed:
        owner, name, original = _installed.pop()
        setattr(owner, name, original)


__all__ = ["install", "undo", "active"]

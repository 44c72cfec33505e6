"""DeepSpeed's universal-checkpoint converter and loader with loads that run no code from files.

Resharding a ZeRO 1-3 checkpoint (``checkpoint/elastic.py``) goes through DeepSpeed 0.19's
universal checkpoint: ``deepspeed.checkpoint.ds_to_universal`` converts the checkpoint, then the
engine loads the converted files. Both read files with ``torch.load(weights_only=False)`` (the
converter about a dozen times, the engine in ``universal_checkpoint.load_hp_checkpoint_state``),
i.e. any pickle in the checkpoint could run code. Here every such read becomes
``torch.load(weights_only=True)`` with the allowlist :data:`SAFE_GLOBALS`:

* :func:`main` is the converter's entry point, run in a child process by ``patches/deepspeed.py``
  (``python -m robust_plugins.patches.deepspeed_universal --input_folder ...``): it replaces
  ``torch.load`` for the whole (single-purpose) process, then calls DeepSpeed's own ``main``.
  The converter runs with one extract and one merge worker, so no pool process escapes the patch.
* :func:`safe_universal_loads` shadows the ``torch`` global of
  ``deepspeed.checkpoint.universal_checkpoint`` and of ``deepspeed.runtime.zero.stage3`` (ZeRO-3's
  ``load_hp_checkpoint_state`` reads the converted files itself) for one load, so only those
  modules' reads change (other threads' ``torch.load`` calls are left alone).

A file holding any other global is refused with :class:`CheckpointError` naming the type.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import re
import sys
import types
from typing import Any, Iterator

import torch

from robust_plugins.errors import CheckpointError
from robust_plugins.patches import _guard, _ranges

RANGE = _ranges.DEEPSPEED
SUPPORTED = f"deepspeed {RANGE.spec}"

#: (module, name) of the only non-builtin types in DeepSpeed 0.19 ZeRO 0-2 checkpoint files and in
#: the universal checkpoints converted from them (found by loading fp32 and bf16 checkpoints of
#: every stage with weights_only=True). Each is plain data: a loss-scale holder, an enum, a
#: (numel, start) dataclass. Nothing else may load.
SAFE_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)

#: torch's own load, held before :func:`main` replaces ``torch.load`` in the converter process.
_torch_load = torch.load


def safe_globals() -> list:
    """The classes of :data:`SAFE_GLOBALS` (imports DeepSpeed)."""
    return [getattr(importlib.import_module(module), name) for module, name in SAFE_GLOBALS]


def _refused(path: Any, exc: pickle.UnpicklingError) -> CheckpointError:
    # torch's message ends in advice to allowlist the type; the type's name is the news.
    found = re.search(r"GLOBAL (\S+)", str(exc))
    what = f"the global {found.group(1)}" if found else str(exc).splitlines()[0]
    return CheckpointError(
        f"{path} needs {what} to load, which is not tensors or plain data. robust_plugins reads "
        f"checkpoints with torch.load(weights_only=True) and allows only "
        f"{', '.join(m + '.' + n for m, n in SAFE_GLOBALS)}, so no code from a file runs; it was not "
        f"loaded. Load it only if you trust it, with DeepSpeed alone (no 'checkpoint' sub-block).")


def safe_load(f: Any, map_location: Any = None, **_ignored: Any) -> Any:
    """``torch.load(f, weights_only=True)`` with :data:`SAFE_GLOBALS`; CheckpointError naming the type.

    Keyword arguments other than ``map_location`` (a caller's ``weights_only=False`` above all)
    are ignored on purpose: this is the load every DeepSpeed read is routed to.
    """
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return _torch_load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refused(f, exc) from exc


@contextlib.contextmanager
def safe_universal_loads() -> Iterator[None]:
    """During the block, ``universal_checkpoint.load_hp_checkpoint_state`` reads with :func:`safe_load`."""
    import deepspeed
    from deepspeed.checkpoint import universal_checkpoint as uc

    RANGE.check(deepspeed.__version__)
    if getattr(uc, "torch", None) is not torch:
        raise CheckpointError(
            f"deepspeed.checkpoint.universal_checkpoint does not read files through the module-level "
            f"torch.load robust_plugins expects ({SUPPORTED}); its loads cannot be made safe, so the "
            f"resharded load was refused. Resume at the saved data-parallel size.")
    from deepspeed.runtime.zero import stage3

    if getattr(stage3, "torch", None) is not torch:
        raise CheckpointError(
            f"deepspeed.runtime.zero.stage3 does not read files through the module-level torch.load "
            f"robust_plugins expects ({SUPPORTED}); its universal loads cannot be made safe, so the "
            f"resharded load was refused. Resume at the saved data-parallel size.")
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: v for k, v in torch.__dict__.items() if not k.startswith("__")})
    proxy.load = safe_load
    uc.torch = proxy
    stage3.torch = proxy  # ZeRO-3 reads the converted files itself (load_hp_checkpoint_state)
    try:
        yield
    finally:
        uc.torch = torch
        stage3.torch = torch


def main(argv: list[str] | None = None) -> int:
    """Run DeepSpeed's ``ds_to_universal`` with every ``torch.load`` made :func:`safe_load`."""
    import deepspeed
    from deepspeed.checkpoint import ds_to_universal

    RANGE.check(deepspeed.__version__)
    original = torch.load
    torch.load = _guard.wrap(original, safe_load)
    sys.argv = [ds_to_universal.__file__, *(sys.argv[1:] if argv is None else argv)]
    try:
        args = ds_to_universal.parse_arguments()
        if args.num_extract_workers != 1 or args.num_merge_workers != 1:
            # Pool workers would be new processes without this patch (spawn) on some platforms.
            raise CheckpointError("the safe converter runs with --num_extract_workers 1 --num_merge_workers 1 "
                                  f"only, got {args.num_extract_workers} and {args.num_merge_workers}.")
        ds_to_universal.main(args)
    except CheckpointError as exc:
        print(f"robust_plugins: {exc}", file=sys.stderr)
        return 3
    finally:
        torch.load = original
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Post-import hooks: patch a host when (and only when) it is imported.

Importing DeepSpeed costs seconds and may not be installed at all, so ``import robust_plugins``
must not import it. Instead a ``sys.meta_path`` finder waits for ``import deepspeed`` and, right
after the module has executed, calls :func:`robust_plugins.patches.deepspeed.install`; likewise
``transformers.trainer`` (imported lazily by ``from transformers import Trainer``) gets
:func:`robust_plugins.patches.transformers_trainer.install`, and ``accelerate`` its version guard
(:func:`robust_plugins.patches.accelerate.install`). A host already imported is patched at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading

_TARGET = "deepspeed"
#: Module name -> the patch module whose ``install()`` runs right after it is imported.
_TARGETS = {_TARGET: "deepspeed", "transformers.trainer": "transformers_trainer", "accelerate": "accelerate"}
_lock = threading.Lock()
_pending: set[str] = set()


def _apply(name: str = _TARGET) -> None:
    import importlib

    importlib.import_module(f"robust_plugins.patches.{_TARGETS[name]}").install()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of a pending host to run its patch after it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending:
            return None
        # Ask the rest of sys.meta_path for the real spec, skipping ourselves.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, name: str):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _done(self._name)
        _apply(self._name)

    def __getattr__(self, name):  # e.g. get_resource_reader, is_package
        return getattr(self._inner, name)


_finder: _PostImportFinder | None = None


def _done(name: str) -> None:
    # The finder leaves sys.meta_path once every host it waits for was imported.
    global _finder
    with _lock:
        _pending.discard(name)
        if not _pending and _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
            _finder = None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # "transformers.trainer" without transformers
        return False


def install_deepspeed_hook() -> None:
    """Patch DeepSpeed and the HF Trainer now if imported, else as soon as they are. Idempotent."""
    global _finder
    for name in _TARGETS:
        if name in sys.modules:
            _apply(name)
            continue
        # Not installed: nothing to hook, and nothing a config block could ask for (find_spec of a
        # top-level name imports nothing).
        if not _installed(name.split(".")[0]):
            continue
        with _lock:
            _pending.add(name)
            if _finder is None:
                _finder = _PostImportFinder()
                sys.meta_path.insert(0, _finder)

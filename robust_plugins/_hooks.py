"""Post-import hook: patch ``deepspeed.initialize`` when (and only when) DeepSpeed is imported.

Importing DeepSpeed costs seconds and may not be installed at all, so ``import robust_plugins``
must not import it. Instead a ``sys.meta_path`` finder waits for ``import deepspeed`` and, right
after the module has executed, calls :func:`robust_plugins.patches.deepspeed.install`. If DeepSpeed
is already imported, the patch is installed at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading

_TARGET = "deepspeed"
_lock = threading.Lock()


def _apply() -> None:
    from robust_plugins.patches import deepspeed as ds_patch

    ds_patch.install()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of ``deepspeed`` to run the patch after it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        # Ask the rest of sys.meta_path for the real spec, skipping ourselves.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _remove_finder()
        _apply()

    def __getattr__(self, name):  # e.g. get_resource_reader, is_package
        return getattr(self._inner, name)


_finder: _PostImportFinder | None = None


def _remove_finder() -> None:
    global _finder
    with _lock:
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None


def install_deepspeed_hook() -> None:
    """Patch DeepSpeed now if imported, else as soon as it is. Idempotent."""
    global _finder
    if _TARGET in sys.modules:
        _apply()
        return
    if importlib.util.find_spec(_TARGET) is None:
        return  # DeepSpeed not installed: nothing to hook, and nothing a config block could ask for
    with _lock:
        if _finder is None:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)

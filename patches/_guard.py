"""Shared guards for host patches: version ranges, signature checks, reversible rebinding.

Every patch in this folder follows the same rules: import the host lazily,
check its version and the target's signature, mark what it replaced so a second install is a
no-op, keep the original in ``__wrapped__``, log what was replaced, and be undoable.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from robust_plugins.errors import HostVersionError

MARKER = "__robust_plugins_patch__"
LAYER = "__robust_plugins_layer__"


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.19.8+abc"`` -> ``(0, 19, 8)``; non-numeric tails are ignored."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_version(host: str, installed: str, minimum: tuple[int, ...], below: tuple[int, ...]) -> None:
    """Raise :class:`HostVersionError` unless ``minimum <= installed < below``."""
    v = parse_version(installed)
    if not (minimum <= v < below):
        lo = ".".join(map(str, minimum))
        hi = ".".join(map(str, below))
        raise HostVersionError(
            f"robust_plugins supports {host} >={lo},<{hi}; found {host} {installed}. "
            f"Install a supported version (pip install '{host}>={lo},<{hi}') or remove the "
            f"robust_plugins block from your config."
        )


def check_signature(host: str, target: Callable, expected: list[str], supported: str) -> None:
    """Raise :class:`HostVersionError` if ``target``'s parameter names differ from ``expected``."""
    got = list(inspect.signature(target).parameters)
    if got != expected:
        raise HostVersionError(
            f"{host}: {target.__qualname__}{inspect.signature(target)} does not have the parameters "
            f"robust_plugins was written for ({', '.join(expected)}). Supported: {supported}."
        )


def is_patched(fn: Any) -> bool:
    """True if ``fn`` is a wrapper installed by robust_plugins."""
    return bool(getattr(fn, MARKER, False))


def wrap(original: Callable, replacement: Callable) -> Callable:
    """Give ``replacement`` the name/doc of ``original``, ``__wrapped__`` and the patch marker."""
    functools.update_wrapper(replacement, original)
    replacement.__wrapped__ = original
    setattr(replacement, MARKER, True)
    return replacement


def bind_instance(obj: Any, name: str, replacement: Callable, *, layer: str | None = None) -> None:
    """Shadow the method ``name`` on one instance only (other instances keep the host's code).

    ``layer`` names the feature doing it (default: the replacement's qualified name, which is
    the same for every closure a patch function builds). Installing a layer that is already in
    the instance's wrapper chain is a no-op, so installs are idempotent; a *different* layer is
    stacked on top of the wrappers already there. Before, any existing robust_plugins wrapper
    made the call a silent no-op, so a second feature on the same method was dropped unseen.
    """
    # The code object's name, not ``__qualname__``: wrap() overwrites that with the host's.
    code = getattr(replacement, "__code__", None)
    layer = layer or (code.co_qualname if code is not None else repr(replacement))
    original = getattr(obj, name)
    fn = original
    while is_patched(fn):
        if getattr(fn, LAYER, None) == layer:
            return
        fn = getattr(fn, "__wrapped__", None)
    setattr(obj, name, wrap(original, replacement))
    setattr(getattr(obj, name), LAYER, layer)


def unbind_instance(obj: Any, name: str) -> None:
    """Undo :func:`bind_instance`: the instance falls back to its class's method."""
    if is_patched(obj.__dict__.get(name)):
        del obj.__dict__[name]

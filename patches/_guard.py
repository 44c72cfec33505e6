"""Shared guards for host patches: version ranges, signature checks, reversible rebinding.

Every patch in this folder follows the same rules: import the host lazily,
check its version and the target's signature, mark what it replaced so a second install is a
no-op, keep the original in ``__wrapped__``, log what was replaced, and be undoable.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

from robust_plugins._logging import current_rank, get_logger, warn_once
from robust_plugins.errors import HostVersionError

log = get_logger(__name__)

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


@dataclass(frozen=True)
class HostRange:
    """The versions of one host a patch was tested on: ``minimum <= version < below``.

    ``instead`` completes a refusal: what the user can do other than installing a supported
    version, in that host's own terms (a DeepSpeed config block, a megatron ``rpm.enable`` call).
    ``note``: said after the range when the found version is at or above ``below``. ``pip``: the
    refusal suggests installing a supported version (not for torch, which the user's cluster owns).
    """

    host: str
    minimum: tuple[int, ...]
    below: tuple[int, ...]
    instead: str
    note: str = ""
    pip: bool = True

    @property
    def spec(self) -> str:
        """The pip specifier, e.g. ``>=0.19.0,<0.20.0``."""
        return f">={'.'.join(map(str, self.minimum))},<{'.'.join(map(str, self.below))}"

    def error(self, installed: str) -> HostVersionError | None:
        """The refusal for ``installed`` (a version string), or None inside the range."""
        v = parse_version(installed)
        if self.minimum <= v < self.below:
            return None
        note = f" {self.note}" if self.note and v >= self.below else ""
        action = (f"Install a supported version (pip install '{self.host}{self.spec}') or {self.instead}"
                  if self.pip else self.instead[0].upper() + self.instead[1:])
        return HostVersionError(
            f"robust_plugins supports {self.host} {self.spec}; found {self.host} {installed}.{note} {action}.")

    def check(self, installed: str) -> None:
        """Raise :meth:`error` for ``installed`` outside the range."""
        exc = self.error(installed)
        if exc is not None:
            raise exc


def check_version(host: str, installed: str, minimum: tuple[int, ...], below: tuple[int, ...],
                  instead: str = "remove the robust_plugins block from your config") -> None:
    """Raise :class:`HostVersionError` unless ``minimum <= installed < below``."""
    HostRange(host, minimum, below, instead).check(installed)


def installed_version(distribution: str) -> str | None:
    """The version pip installed of ``distribution`` (``"deepspeed"``), read from its metadata
    without importing it; None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_off(host: str, error: Exception, off: str) -> None:
    """An unsupported ``host``: the plugin's parts for it are off, said once per process on rank 0
    as one warning line (``error`` names the version and the supported range; ``off`` what is off
    and what still works). The host itself runs unchanged; what asks for those parts is refused."""
    if current_rank() == 0:
        warn_once(log, f"host-off:{host}", "%s Off: %s", error, off)


def check_signature(host: str, target: Callable, expected: list[str], supported: str) -> None:
    """Raise :class:`HostVersionError` if ``target``'s parameter names differ from ``expected``."""
    got = list(inspect.signature(target).parameters)
    if got != expected:
        raise HostVersionError(
            f"{host}: {target.__qualname__}{inspect.signature(target)} does not have the parameters "
            f"robust_plugins was written for ({', '.join(expected)}). Supported: {supported}."
        )


def caller_instance(cls: type, depth: int = 64) -> Any:
    """The nearest ``self`` on the call stack (``depth`` frames up) that is a ``cls``, or None: who
    is building an engine when no patch of that caller registered it (an unsupported host)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, cls):
            return obj
        frame = frame.f_back
    return None


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

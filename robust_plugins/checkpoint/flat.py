"""A state serializer that never unpickles: tensors plus a JSON schema of the nested structure.

:func:`flatten` turns a nested state (dicts, lists, tuples, tensors, numpy arrays, numbers,
strings, ``None`` and a caller-given allowlist of plain-data classes) into

* a JSON-able ``schema`` describing the structure, every scalar value and, for every tensor, its
  dtype and shape, and
* the list of tensors, in the order the schema refers to them.

:func:`unflatten` rebuilds the state from the two. Reading a schema never imports a module or
calls a constructor by a name found in the data: an object is rebuilt only if its ``module:Name``
is in the ``allowed`` mapping the *caller* passes (``{"module:Name": cls}``), by creating an
empty instance and restoring its ``__dict__`` (enums by value). Anything else is a
:class:`~robust_plugins.errors.CheckpointError` naming the path inside the state.

Encoding (every container is wrapped, so a bare JSON value is always a scalar)::

    {"T": i}                      tensor number i        {"N": i, "np": "uint32"}  numpy array
    {"D": [[key, value], ...]}    dict (keys encoded too: optimizer states use int keys)
    {"L": [...]} / {"U": [...]}   list / tuple            {"dtype": "float32"}      torch.dtype
    {"O": "mod:Name", "S": {...}} allowlisted object      {"E": "mod:Name", "V": v} allowlisted enum
    {"F": "nan" | "inf" | "-inf"} non-finite float (strict JSON has none)
"""

from __future__ import annotations

import enum
import math
from typing import Any, Mapping

import torch

from robust_plugins.errors import CheckpointError

#: Scalar types stored as JSON values as they are.
_SCALARS = (str, int, bool, type(None))


def class_name(cls: type) -> str:
    """The ``module:Name`` key of a class in an ``allowed`` mapping."""
    return f"{cls.__module__}:{cls.__qualname__}"


def allow(*classes: type) -> dict[str, type]:
    """An ``allowed`` mapping for :func:`flatten` / :func:`unflatten` from classes."""
    return {class_name(c): c for c in classes}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; CheckpointError for anything that is not a dtype."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"Snapshot schema names dtype {name!r}, which is not a torch dtype.")
    return dtype


def flatten(state: Any, allowed: Mapping[str, type] | None = None,
            paths: list[Any] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """(schema, tensors) of ``state``; tensors are returned as they are (not copied).

    ``paths``: a list that receives each tensor's place in ``state``, in tensor order, for error
    messages; :func:`path_text` turns one into ``state['module']['w']``."""
    allowed = allowed or {}
    tensors: list[torch.Tensor] = []
    table: list[list] = []

    def add(t: torch.Tensor, path: Any) -> int:
        tensors.append(t.detach())
        table.append([_dtype_name(t.dtype), list(t.shape)])
        if paths is not None:
            paths.append(path)
        return len(tensors) - 1

    # A path is ("state" or a parent path, key, is_item), rendered only for an error: formatting
    # one string per value cost a third of flatten on a ZeRO-1 GPT state (done every snapshot).
    def enc(x: Any, path: Any) -> Any:
        t = type(x)
        if t is int or t is str or t is bool or x is None:  # most values: one type test
            return x
        if t is float:
            return x if math.isfinite(x) else {"F": repr(x)}
        if isinstance(x, torch.Tensor):
            return {"T": add(x, path)}
        if isinstance(x, enum.Enum):
            name = class_name(type(x))
            if name not in allowed:
                raise _not_allowed(path, x)
            return {"E": name, "V": enc(x.value, (path, ".value", False))}
        if isinstance(x, float):
            return x if math.isfinite(x) else {"F": repr(x)}
        if isinstance(x, _SCALARS):
            return x
        if isinstance(x, dict):
            return {"D": [[enc(k, (path, ".<key>", False)), enc(v, (path, k, True))] for k, v in x.items()]}
        if isinstance(x, list):
            return {"L": list(x) if _plain(x) else [enc(v, (path, i, True)) for i, v in enumerate(x)]}
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return {"U": list(x) if _plain(x) else [enc(v, (path, i, True)) for i, v in enumerate(x)]}
        if isinstance(x, torch.dtype):
            return {"dtype": _dtype_name(x)}
        np = _numpy()
        if np is not None:
            if isinstance(x, np.ndarray):
                # torch has no uint16/32/64 arithmetic on every version: carry the bytes as a
                # same-width signed type and restore the numpy dtype on the way out.
                arr = np.ascontiguousarray(x)
                kind = {"u2": np.int16, "u4": np.int32, "u8": np.int64}.get(arr.dtype.str[1:])
                t = torch.from_numpy(arr.view(kind) if kind is not None else arr)
                return {"N": add(t, path), "np": arr.dtype.name}
            if isinstance(x, np.generic):
                return enc(x.item(), path)
        name = class_name(type(x))
        if name in allowed and hasattr(x, "__dict__"):
            return {"O": name, "S": enc(dict(vars(x)), (path, ".__dict__", False))}
        raise _not_allowed(path, x)

    schema = enc(state, "state")
    return {"tensors": table, "root": schema}, tensors


def path_text(path: Any) -> str:
    """A path recorded by :func:`flatten` as text, e.g. ``state['optimizer']['state'][0]``."""
    parts = []
    while isinstance(path, tuple):
        path, key, item = path
        parts.append(f"[{key!r}]" if item else key)
    return str(path) + "".join(reversed(parts))


def _plain(seq: Any) -> bool:
    """All items are JSON scalars as they are: Python's RNG state is 625 ints, encoded on every
    snapshot; one pass here instead of one encoder call an item."""
    for v in seq:
        t = type(v)
        if not (t is int or t is str or t is bool or v is None or (t is float and math.isfinite(v))):
            return False
    return True


def _not_allowed(path: Any, x: Any) -> CheckpointError:
    return CheckpointError(
        f"Cannot snapshot {path_text(path)}: a {class_name(type(x))} is neither a tensor, a numpy array, plain "
        f"data (dict, list, tuple, str, int, float, bool, None) nor an allowlisted class. Convert it to "
        f"plain data in the state function, or pass its class in `allowed`."
    )


def _numpy():
    try:
        import numpy
    except ImportError:  # numpy is optional for torch; without it no state holds arrays
        return None
    return numpy


def tensor_specs(schema: Mapping[str, Any]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of every tensor a schema refers to, in order."""
    table = schema.get("tensors") if isinstance(schema, Mapping) else None
    if not isinstance(table, list):
        raise CheckpointError("Snapshot schema has no tensor table: it is not a robust_plugins snapshot.")
    out = []
    for i, entry in enumerate(table):
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[1])):
            raise CheckpointError(f"Snapshot schema tensor {i} is {entry!r}, expected [dtype, [dims]].")
        out.append((dtype_from_name(entry[0]), tuple(entry[1])))
    return out


def unflatten(schema: Mapping[str, Any], tensors: list[torch.Tensor],
              allowed: Mapping[str, type] | None = None) -> Any:
    """The state :func:`flatten` described; ``tensors`` are used as they are (clone them first if
    they alias a buffer that will be overwritten)."""
    allowed = allowed or {}
    if len(tensor_specs(schema)) != len(tensors):
        raise CheckpointError(f"Snapshot schema lists {len(schema['tensors'])} tensors, {len(tensors)} were given.")
    np = _numpy()

    def dec(x: Any, path: str) -> Any:
        if isinstance(x, _SCALARS) or isinstance(x, float):
            return x
        if not isinstance(x, dict) or len(x) not in (1, 2):
            raise CheckpointError(f"Snapshot schema at {path} is {str(x)[:80]!r}, not an encoded value.")
        if "T" in x:
            return tensors[_index(x["T"], len(tensors), path)]
        if "N" in x:
            if np is None:
                raise CheckpointError(f"Snapshot holds a numpy array at {path}, but numpy is not installed.")
            arr = tensors[_index(x["N"], len(tensors), path)].numpy()
            return arr.view(np.dtype(str(x.get("np"))))
        if "D" in x:
            return {dec(k, f"{path}.<key>"): dec(v, f"{path}[{k!r}]") for k, v in _pairs(x["D"], path)}
        if "L" in x:
            return [dec(v, f"{path}[{i}]") for i, v in enumerate(_items(x["L"], path))]
        if "U" in x:
            return tuple(dec(v, f"{path}[{i}]") for i, v in enumerate(_items(x["U"], path)))
        if "F" in x:
            if x["F"] not in ("nan", "inf", "-inf"):
                raise CheckpointError(f"Snapshot schema at {path}: {x['F']!r} is not nan, inf or -inf.")
            return float(x["F"])
        if "dtype" in x:
            return dtype_from_name(x["dtype"])
        if "E" in x or "O" in x:
            name = x.get("E", x.get("O"))
            cls = allowed.get(name)
            if cls is None:
                raise CheckpointError(
                    f"Snapshot holds a {name!r} at {path}, which this loader does not allow "
                    f"(allowed: {', '.join(sorted(allowed)) or 'none'}). It was not loaded."
                )
            if "E" in x:
                return cls(dec(x["V"], f"{path}.value"))
            obj = cls.__new__(cls)
            obj.__dict__.update(dec(x["S"], f"{path}.__dict__"))
            return obj
        raise CheckpointError(f"Snapshot schema at {path} has unknown tag {sorted(x)}.")

    return dec(schema.get("root"), "state")


def _index(i: Any, n: int, path: str) -> int:
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
        raise CheckpointError(f"Snapshot schema at {path} refers to tensor {i!r}; there are {n}.")
    return i


def _items(v: Any, path: str) -> list:
    if not isinstance(v, list):
        raise CheckpointError(f"Snapshot schema at {path} should hold a list, got {type(v).__name__}.")
    return v


def _pairs(v: Any, path: str) -> list:
    items = _items(v, path)
    if not all(isinstance(p, list) and len(p) == 2 for p in items):
        raise CheckpointError(f"Snapshot schema at {path} should hold [key, value] pairs.")
    return items

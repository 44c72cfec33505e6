"""The sections' pydantic base: strict, frozen, unknown keys refused, and pydantic's
``ValidationError`` turned into one :class:`~robust_plugins.errors.ConfigError` whose lines name
the key path, the bad value, what is allowed and, for a near miss, "did you mean".

A user never sees a pydantic trace: every constructor and ``parse`` raise ConfigError only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import sys
import types
import typing
from typing import Any, ClassVar, Mapping

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from robust_plugins.errors import ConfigError
from robust_plugins.schema.common import did_you_mean

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_CONSTRAINT_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number")
_NOT_AN_OBJECT = ("model_type", "model_attributes_type", "dict_type")


@dataclasses.dataclass(frozen=True)
class Hint:
    """Message parts of one field, kept beside its type (``Annotated[int, Field(ge=0), Hint(...)]``).

    ``expect``: what the value must be, for a wrong type ("a directory path (string)"); default
    from the type. ``why``: the reason appended to a range error ("(0: off)", or a clause after a
    colon). ``rule``: the whole range sentence, for rules pydantic cannot state ("must be 0 (off)
    or a finite number > 1"); field validators of such a field raise ``ValueError(rule)``.
    """

    expect: str | None = None
    why: str | None = None
    rule: str | None = None


class Section(BaseModel):
    """Base of every sub-block: strict types (``true`` is no 1, ``"5"`` no 5), frozen, no extra keys."""

    # defer_build: the validators are built at the first parse, after __pydantic_init_subclass__
    # has set the descriptions (pydantic's own use_attribute_docstrings tokenizes each class's
    # source in Python: 40 % of building the seven models).
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid", defer_build=True)

    #: The section's key path in a DeepSpeed config (``robust_plugins.compression``): the prefix of
    #: every message about it, when it is built on its own.
    where: ClassVar[str] = ""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        docs = _attribute_docstrings(sys.modules[cls.__module__].__file__).get(cls.__name__, {})
        for name, info in cls.model_fields.items():
            if info.description is None and name in docs:
                info.description = docs[name]

    def __init__(self, /, **data: Any) -> None:
        _check_string_keys(data, self.where)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise to_config_error(exc, type(self)) from None

    @classmethod
    def parse(cls, data: Any) -> "Section":
        """Validate a JSON value (a dict for a valid block); raises ConfigError only."""
        _check_string_keys(data, cls.where)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise to_config_error(exc, cls) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            return super().__setattr__(name, value)
        # dataclasses' FrozenInstanceError is an AttributeError too; pydantic's would be a trace.
        raise AttributeError(f"{self.where}.{name}: configs are frozen; build a new one with "
                             f"cfg.replace({name}=...).")

    def replace(self, **changes: Any) -> "Section":
        """A validated copy with ``changes`` (what ``dataclasses.replace`` did for the dataclasses)."""
        data = {name: getattr(self, name) for name in type(self).model_fields}
        data.update(changes)
        return type(self)(**data)

    def as_dict(self) -> dict[str, Any]:
        """Plain values, nested sections as dicts (what ``dataclasses.asdict`` gave)."""
        return self.model_dump()


def _check_string_keys(data: Any, where: str) -> None:
    # JSON keys are strings; pydantic-core raises a bare TypeError on others (a Python-built block).
    if not isinstance(data, Mapping):
        return
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"Unknown key {where}.{key!r}: keys must be strings.")
        _check_string_keys(value, f"{where}.{key}")


@functools.lru_cache(maxsize=None)
def _attribute_docstrings(path: str) -> dict[str, dict[str, str]]:
    """``{class: {field: docstring}}`` for the string right under each annotated class attribute."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, TypeError):  # no source (a frozen or zipped install): no descriptions
        return {}
    found: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = found.setdefault(node.name, {})
        for stmt, after in zip(node.body, node.body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                fields[stmt.target.id] = inspect.cleandoc(after.value.value)
    return found


def to_config_error(exc: ValidationError, model: type[BaseModel]) -> ConfigError:
    """One ConfigError for all of ``exc``'s errors, one line each, in the block's key order."""
    lines = [_message(err, model) for err in exc.errors(include_url=False)]
    return ConfigError("\n".join(dict.fromkeys(lines)))


def _message(err: Mapping[str, Any], root: type[BaseModel]) -> str:
    loc = tuple(err["loc"])
    owner, name = _owner_of(root, loc)
    path = root.where + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in loc)
    path = path.lstrip(".")
    kind, value = err["type"], err.get("input")
    info: FieldInfo | None = owner.model_fields.get(name) if name is not None else None
    hint = next((m for m in info.metadata if isinstance(m, Hint)), Hint()) if info else Hint()
    if kind == "extra_forbidden":
        allowed = list(owner.model_fields)
        return f"Unknown key {path}.{did_you_mean(str(name), allowed)} Allowed keys: {', '.join(allowed)}."
    if kind in _NOT_AN_OBJECT:
        null = " or null" if info is not None and _optional(info.annotation) else ""
        return f"{path} must be a JSON object{null}, got {type(value).__name__}: {value!r}."
    if kind == "value_error":
        error = err.get("ctx", {}).get("error")
        if isinstance(error, ConfigError):  # a cross-field check: the message is whole
            return str(error)
        return f"{path} = {value!r} {error}."
    if kind == "literal_error" and isinstance(value, str) and info is not None:
        allowed = _literal_values(info.annotation)
        return f"{path} = {value!r} is not allowed.{did_you_mean(value, allowed)} Allowed: {', '.join(allowed)}."
    if kind in ("string_too_short", "too_short") and info is not None:
        return f"{path} = {value!r} {hint.rule or 'must not be empty'}."
    if kind in _CONSTRAINT_ERRORS and info is not None:
        return f"{path} = {value!r} {hint.rule or _range_rule(info, hint)}."
    if kind.endswith("_type") or kind == "literal_error":
        expect = hint.expect or _expect(info.annotation if info else None)
        got = f"a boolean: {value!r}" if isinstance(value, bool) else f"{type(value).__name__}: {value!r}"
        return f"{path} must be {expect}, got {got}."
    return f"{path}: {err['msg']} (got {value!r})."


def _owner_of(root: type[BaseModel], loc: tuple) -> tuple[type[BaseModel], str | None]:
    """The model holding the key ``loc`` is about, and that key (sections are descended into)."""
    owner = root
    for i, key in enumerate(loc):
        if not isinstance(key, str):
            break
        info = owner.model_fields.get(key)
        sub = _model_in(info.annotation) if info is not None else None
        if sub is None or i == len(loc) - 1:
            return owner, key
        owner = sub
    return owner, next((k for k in reversed(loc) if isinstance(k, str)), None)


def _members(annotation: Any) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _optional(annotation: Any) -> bool:
    return type(None) in _members(annotation)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    return next((m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)), None)


def _literal_values(annotation: Any) -> list[str]:
    for m in _members(annotation):
        if typing.get_origin(m) is typing.Literal:
            return [str(v) for v in typing.get_args(m)]
    return []


def _expect(annotation: Any) -> str:
    base = [m for m in _members(annotation) if m is not type(None)]
    if len(base) == 1 and typing.get_origin(base[0]) is typing.Literal:
        what = "a string"
    elif len(base) == 1 and base[0] in _TYPE_WORDS:
        what = _TYPE_WORDS[base[0]]
    else:
        what = "a list" if base and typing.get_origin(base[0]) in (tuple, list) else "a valid value"
    if _optional(annotation):
        return "true, false or null" if base == [bool] else f"{what} or null"
    return what


def num(x: float) -> str:
    """A bound or setting as written: ``30`` for 30.0, ``0.5``, ``inf``."""
    return str(int(x)) if float(x).is_integer() and not math.isinf(x) else repr(x)


def _range_rule(info: FieldInfo, hint: Hint) -> str:
    """"must be >= 0", "must be a finite number > 0", "must lie in [0, 1)", from the field's bounds."""
    lo = next(((m.ge, "[", ">=") for m in info.metadata if isinstance(m, Ge)), None)
    lo = lo or next(((m.gt, "(", ">") for m in info.metadata if isinstance(m, Gt)), None)
    hi = next(((m.le, "]") for m in info.metadata if isinstance(m, Le)), None)
    hi = hi or next(((m.lt, ")") for m in info.metadata if isinstance(m, Lt)), None)
    number = float in _members(info.annotation)
    if lo and hi:
        rule = f"must lie in {lo[1]}{num(lo[0])}, {num(hi[0])}{hi[1]}"
    elif lo:
        rule = f"must be {'a finite number ' if number else ''}{lo[2]} {num(lo[0])}"
    elif hi:
        rule = f"must be {'a finite number ' if number else ''}<= {num(hi[0])}"
    else:
        rule = "must be a finite number"
    why = hint.why or (None if not _optional(info.annotation) else "(or null)")
    if why:
        rule += f" {why}" if why.startswith("(") else f": {why}"
    return rule

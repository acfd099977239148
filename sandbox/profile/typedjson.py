"""Parsed JSON to typed values, checked against type hints: what ``spec.load`` reads a
resolved spec file with (dataclasses with their fields' hints, tuples, unions, int, str,
bool). A value that does not fit is a ``SpecError`` naming it by its path.

One checking function is made per type, once (a 1,000-GPU spec is ~116,000 values), and
a path is only put together for a value that does not fit, on the way out of the error.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from sandbox.errors import SpecError

Loc = tuple[str | int, ...]  # a field path: ("nodes", 0, "devices", 2)


def where(at: Loc) -> str:
    """``("spec", "devices", 0, "numa_node")`` as ``spec.devices[0].numa_node``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in at).lstrip(".")


_SCALARS = (int, str, bool)


@functools.cache
def _shape(hint: Any) -> tuple[str, tuple[Any, ...]]:
    """What kind of type ``hint`` is, and its arguments (once per hint)."""
    origin = typing.get_origin(hint)
    kind = ("scalar" if hint in _SCALARS else "dataclass" if dataclasses.is_dataclass(hint)
            else "union" if origin is types.UnionType or origin is typing.Union
            else "tuple" if origin is tuple else "other")  # fmt: skip
    return kind, typing.get_args(hint)


class _Bad(Exception):
    """A value that does not fit: the message and the path below the decoder that
    raised it (each enclosing decoder puts its key in front: no path is built for the
    values that fit)."""

    def __init__(self, message: str, path: list[str | int] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path or []  # innermost key first


def decode(hint: Any, value: Any, at: Loc) -> Any:
    """``value`` (parsed JSON) as a ``hint``: dataclasses by their fields' hints, tuples
    from lists, unions tried in order, int/str/bool exactly; SpecError naming the first
    value that does not fit by its path below ``at``."""
    try:
        return _decoder(hint)(value)
    except _Bad as bad:
        raise SpecError(f"{where((*at, *reversed(bad.path)))}: {bad.message}") from None


Decoder = Callable[[Any], Any]


@functools.cache
def _decoder(hint: Any) -> Decoder:
    """The function that checks and converts a JSON value of type ``hint`` (once per hint:
    a 1,000-GPU spec is ~116,000 values)."""
    shape, args = _shape(hint)
    if shape == "scalar":
        return functools.partial(_scalar, hint)
    if shape == "dataclass":
        return _dataclass_decoder(hint)
    if shape == "union":
        options = [_decoder(a) for a in args if a is not type(None)]
        nullable = type(None) in args
        return functools.partial(_union, hint, options, nullable)
    if shape == "tuple":
        if len(args) == 2 and args[1] is Ellipsis:
            return functools.partial(_tuple_of, _decoder(args[0]))
        return functools.partial(_fixed_tuple, [_decoder(a) for a in args])
    if hint is type(None):
        return _none
    return functools.partial(_other, hint)


def _scalar(hint: type, value: Any) -> Any:
    if type(value) is hint:
        return value
    raise _Bad(f"expected {hint.__name__}, got {value!r}")


def _none(value: Any) -> None:
    if value is None:
        return None
    raise _Bad(f"expected NoneType, got {value!r}")


def _other(hint: Any, value: Any) -> Any:
    raise _Bad(f"expected {getattr(hint, '__name__', hint)}, got {value!r}")


def _union(hint: Any, options: Sequence[Decoder], nullable: bool, value: Any) -> Any:
    if value is None and nullable:
        return None
    for option in options:
        try:
            return option(value)
        except _Bad:
            continue
    raise _Bad(f"{value!r} is none of {hint}")


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise _Bad(f"expected a list, got {value!r}")
    return value


def _tuple_of(item: Decoder, value: Any) -> tuple[Any, ...]:
    i = 0
    try:
        out = []
        for i, v in enumerate(_list(value)):  # noqa: B007 - i names the failing item
            out.append(item(v))
        return tuple(out)
    except _Bad as bad:
        if isinstance(value, list):  # an item's problem, not the list's
            bad.path.append(i)
        raise


def _fixed_tuple(items: Sequence[Decoder], value: Any) -> tuple[Any, ...]:
    if len(_list(value)) != len(items):
        raise _Bad(f"expected {len(items)} items, got {len(value)}")
    i = 0
    try:
        out = []
        for i, (item, v) in enumerate(zip(items, value, strict=True)):  # noqa: B007
            out.append(item(v))
        return tuple(out)
    except _Bad as bad:
        bad.path.append(i)
        raise


def _dataclass_decoder(cls: Any) -> Decoder:
    hints = _hints(cls)
    names = frozenset(hints)
    fields: list[tuple[str, Decoder]] | None = None  # on first use: a hint may name cls

    def decode(value: Any) -> Any:
        nonlocal fields
        if not isinstance(value, dict):
            raise _Bad(f"expected an object, got {value!r}")
        if fields is None:  # a whole list at once: threads may race here harmlessly
            fields = [(name, _decoder(h)) for name, h in hints.items()]
        if len(value) != len(names) or not names.issuperset(value):
            unknown = sorted(set(value) - names)
            if unknown:
                raise _Bad("unknown field", [unknown[0]])
            missing = next(name for name in hints if name not in value)
            raise _Bad("missing", [missing])
        name = ""
        try:
            kwargs = {}
            for name, field in fields:
                kwargs[name] = field(value[name])
        except _Bad as bad:
            bad.path.append(name)
            raise
        return cls(**kwargs)

    return decode


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    """Field name -> type of a dataclass, in field order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

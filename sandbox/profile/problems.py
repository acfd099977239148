"""Pydantic's validation errors as located problems: field paths as the document writes
them (no union or discriminator steps), did-you-mean hints for unknown fields and
literals, the patterns said in words."""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterator
from typing import Any

import pydantic

from sandbox.errors import Problem
from sandbox.profile import model
from sandbox.profile.document import Positions, format_loc, problem
from sandbox.profile.spec import Loc


def dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[tuple[int, int, str, str]] = set()
    out = []
    for p in problems:
        k = (p.line, p.column, p.path, p.message)
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


def real_loc(data: Any, loc: tuple[Any, ...]) -> Loc:
    """Drop pydantic's union/discriminator steps so the path names fields of the document."""
    out: list[str | int] = []
    cur = data
    for part in loc:
        if isinstance(cur, dict) and isinstance(part, str):
            if part in cur:
                out.append(part)
                cur = cur[part]
                continue
            if cur.get("type") == part or part.startswith(("function-", "int", "str", "list[")):
                continue  # discriminator tag or a union member's name
            out.append(part)
            cur = None
        elif isinstance(cur, list) and isinstance(part, int):
            out.append(part)
            cur = cur[part] if 0 <= part < len(cur) else None
        elif isinstance(part, str) and (part.startswith(("function-", "int", "str"))
                                        or "[" in part):
            continue
        else:
            out.append(part)
            cur = None
    return tuple(out)


def _fields_of(data: Any, loc: Loc) -> list[str]:
    """The field names a model at ``loc`` accepts, for did-you-mean hints."""
    cls: Any = model.Profile
    cur = data
    for part in loc:
        if cls is None:
            return []
        if isinstance(part, int):
            cur = cur[part] if isinstance(cur, list) and part < len(cur) else None
            continue
        info = cls.model_fields.get(_snake(part))
        if info is None:
            return []
        cur = cur.get(part) if isinstance(cur, dict) else None
        cls = _model_in(info.annotation, cur)
    if cls is None:
        return []
    return [f.alias or n for n, f in cls.model_fields.items()]


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def _model_in(annotation: Any, value: Any) -> Any:
    """The BaseModel class inside an annotation (through lists, optionals, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    candidates = []
    for arg in typing.get_args(annotation):
        found = _model_in(arg, value)
        if found is not None:
            candidates.append(found)
    if len(candidates) > 1 and isinstance(value, dict):
        for c in candidates:
            tag = c.model_fields.get("type")
            if tag is not None and value.get("type") in typing.get_args(tag.annotation):
                return c
    return candidates[0] if candidates else None


_PATTERNS = {
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$":
        "a DNS label: lowercase letters, digits and '-', starting and ending alphanumeric",
    r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-1][0-9a-fA-F]\.[0-7]$":
        "a full PCI address DDDD:BB:DD.F, like 0000:3b:00.0",
    r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$": "a lowercase MAC address, like 0c:42:a1:00:00:00",
    r"^[0-9a-f]{32}$": "32 lowercase hex digits (an AFU UUID without dashes)",
    r"^[^\x00-\x1f\x7f]*$": "one line of text without control characters",
    r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$":
        "a driver name: letters, digits, '_', '.', '+' and '-', not starting with '.'",
    r"^[A-Za-z0-9_+{}-][A-Za-z0-9_.+{}-]*(/[A-Za-z0-9_+{}-][A-Za-z0-9_.+{}-]*)*$":
        "a /dev path like accel/accel{i}: letters, digits, '_', '.', '+', '-', '{', '}' "
        "separated by '/', no part empty or starting with '.'",
    model.LABEL_KEY_PATTERN:
        "a label key: [prefix/]name, the name at most 63 letters, digits, '-', '_' or '.'",
    r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$":
        "a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending "
        "alphanumeric",
}


def translate(name: str, data: Any, pos: Positions, err: Any) -> Iterator[Problem]:
    loc = real_loc(data, tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        key = str(loc[-1])
        fields = _fields_of(data, loc[:-1])
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        if not close and fields:
            hint = f" (allowed: {', '.join(sorted(fields))})"
        yield problem(name, pos, loc, f"unknown field {key!r}{hint}", key=True)
    elif kind == "missing":
        parent = loc[:-1]
        yield Problem(name, *pos.of_value(parent), format_loc(loc),
                      f"required field {loc[-1]!r} is missing")
    elif kind == "union_tag_invalid":
        ctx = err.get("ctx", {})
        yield problem(
            name, pos, (*loc, "type"),
            f"unknown device type {ctx.get('tag')!r}; want one of {ctx.get('expected_tags')}",
        )
    elif kind == "union_tag_not_found":
        yield Problem(name, *pos.of_value(loc), format_loc((*loc, "type")),
                      "required field 'type' is missing (gpu, nic, fpga or generic)")
    elif kind == "literal_error" and isinstance(err.get("input"), str):
        expected = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        close = difflib.get_close_matches(err["input"], expected, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        yield problem(
            name, pos, loc,
            f"{err['input']!r} is not one of {', '.join(map(repr, expected))}{hint}",
        )
    else:
        msg = str(err["msg"])
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        msg = msg[:1].lower() + msg[1:]
        msg = msg.replace("input should be", "must be").replace("Input should be", "must be")
        if kind == "string_pattern_mismatch":
            pattern = str(err.get("ctx", {}).get("pattern", ""))
            msg = "must be " + _PATTERNS.get(pattern, f"text matching {pattern}")
        if "input" in err and kind not in {"dict_type", "list_type", "model_type"}:
            shown = repr(err["input"])
            if len(shown) <= 40 and shown not in msg:
                msg += f", got {shown}"
        yield problem(name, pos, loc, msg, key=tuple(err["loc"])[-1:] == ("[key]",))

"""Reading a profile file: YAML with positions -> model -> resolved cluster.

``load_profile(path)`` returns a ``LoadedProfile`` (the model as written and the fully
resolved cluster) or raises ``ProfileError`` listing every problem it found, each as
``file:line:col: field.path: message``. Structural problems (types, unknown keys,
missing fields) are all reported together; cross-field rules run once the structure is
sound, and are all reported together too.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import yaml

from sandbox.errors import Problem, ProfileError
from sandbox.profile import bundled, model
from sandbox.profile.resolve import ResolveFailed, resolve
from sandbox.profile.spec import Cluster, Loc

MAX_BYTES = 4 * 2**20
STDIN_NAME = "<stdin>"  # how problems in a profile read from `-` are located
MAX_NODES = 200_000  # YAML aliases can multiply a small file (the "billion laughs")


@dataclass(frozen=True)
class LoadedProfile:
    path: str  # the file read, or STDIN_NAME
    profile: model.Profile
    cluster: Cluster
    text: str = ""  # the document as read


@dataclass
class _Positions:
    """Where each value (and each mapping key) of the document starts, by field path."""

    values: dict[Loc, tuple[int, int]]
    keys: dict[Loc, tuple[int, int]]
    visited: int = 0

    def of_value(self, loc: Loc) -> tuple[int, int]:
        while loc not in self.values and loc:
            loc = loc[:-1]
        return self.values.get(loc, (1, 1))

    def of_key(self, loc: Loc) -> tuple[int, int]:
        return self.keys.get(loc) or self.of_value(loc)


def format_loc(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def load_profile(path: str | os.PathLike[str]) -> LoadedProfile:
    """``path``: a file, ``-`` for standard input, or a bundled profile's name
    (``sandbox.profile.bundled``)."""
    name = str(path)
    if name == bundled.STDIN:
        return load_profile_text(_read_stdin(), STDIN_NAME)
    located = bundled.locate(name)
    return load_profile_text(_read(located), located)


def load_profile_text(text: str, name: str = "<string>") -> LoadedProfile:
    """Like ``load_profile`` for text already in memory (tests, stdin)."""
    data, positions = _parse(name, text)
    profile = _validate(name, data, positions)
    try:
        cluster = resolve(profile)
    except ResolveFailed as exc:
        problems = [_problem(name, positions, loc, msg) for loc, msg in exc.problems]
        raise ProfileError(sorted(problems, key=lambda p: (p.line, p.column))) from None
    problems = [_problem(name, positions, loc, msg) for loc, msg in _check_dev_nodes(profile,
                                                                                     cluster)]
    if problems:
        raise ProfileError(problems)
    return LoadedProfile(name, profile, cluster, text)


def _check_dev_nodes(profile: model.Profile, cluster: Cluster) -> Iterator[tuple[Loc, str]]:
    """Generic devices' ``devNodes`` are the only paths a profile names itself: build the
    first replica of each node that has some, so a clash with another device's node (or a
    node that is also used as a directory) is a located error, not a crash of the builder."""
    from sandbox.fakehw.build import build_tree  # the builder imports the profile package
    from sandbox.fakehw.tree import TreeError

    for i, node in enumerate(profile.nodes):
        with_nodes = [j for j, d in enumerate(node.devices)
                      if isinstance(d, model.Generic) and d.dev_nodes]
        spec = cluster.node(node.name, 0)
        if not with_nodes or spec is None:
            continue
        try:
            build_tree(spec)
        except TreeError as exc:
            yield ("nodes", i, "devices", with_nodes[0], "devNodes"), f"cannot build: {exc}"


def _one(name: str, message: str, line: int = 1, column: int = 1) -> ProfileError:
    return ProfileError([Problem(name, line, column, "", message)])


def _read(name: str) -> str:
    p = Path(name)
    try:
        if p.is_dir():
            raise _one(name, "is a directory, not a profile file")
        if p.exists() and not p.is_file() and name != "/dev/stdin":
            # a FIFO or a device would block or never end: not a profile file
            raise _one(name, "not a regular file")
        with p.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise _one(name, f"no such file{bundled.did_you_mean(name)}") from None
    except PermissionError:
        raise _one(name, "permission denied") from None
    except OSError as exc:
        raise _one(name, f"cannot read: {exc.strerror or exc}") from None
    return _decode(name, raw)


def _read_stdin() -> str:
    try:
        raw = sys.stdin.buffer.read(MAX_BYTES + 1)
    except (AttributeError, ValueError):  # no standard input (closed, or not a file)
        raise _one(STDIN_NAME, "no standard input to read the profile from") from None
    except OSError as exc:
        raise _one(STDIN_NAME, f"cannot read: {exc.strerror or exc}") from None
    return _decode(STDIN_NAME, raw)


def _decode(name: str, raw: bytes) -> str:
    if len(raw) > MAX_BYTES:
        raise _one(name, f"larger than {MAX_BYTES // 2**20} MiB; not a profile")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _one(name, f"not UTF-8 text (byte {exc.start})") from None


class _Loader(yaml.SafeLoader):
    pass


def _parse(name: str, text: str) -> tuple[Any, _Positions]:
    if not text.strip() or all(
        not line.strip() or line.lstrip().startswith("#") for line in text.splitlines()
    ):
        raise _one(name, "empty file: expected a HardwareProfile document")
    try:
        loader = _Loader(text)
    except yaml.YAMLError as exc:  # the reader rejects control characters up front
        raise _one(name, f"invalid YAML: {getattr(exc, 'reason', exc)}") from None
    try:
        root = loader.get_single_node()
    except RecursionError:
        raise _one(name, "invalid YAML: nested too deeply (a profile nests at most 64 "
                   "levels)") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        what = exc.problem or exc.context or "invalid YAML"
        raise _one(name, f"invalid YAML: {what}", line, col) from None
    except yaml.YAMLError as exc:
        raise _one(name, f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if root is None:
        raise _one(name, "empty file: expected a HardwareProfile document")
    positions = _Positions({}, {})
    problems: list[Problem] = []
    try:
        data = _construct(loader, root, (), positions, problems, name)
    except (yaml.YAMLError, ValueError, TypeError, RecursionError) as exc:
        mark = getattr(exc, "problem_mark", None) or root.start_mark
        raise _one(name, f"invalid YAML: {exc}", mark.line + 1, mark.column + 1) from None
    if problems:
        raise ProfileError(problems)
    return data, positions


def _construct(
    loader: _Loader, node: yaml.Node, loc: Loc, pos: _Positions,
    problems: list[Problem], name: str, depth: int = 0,
) -> Any:
    if depth > 64:
        raise ValueError("nesting deeper than 64 levels")
    pos.visited += 1
    if pos.visited > MAX_NODES:
        raise ValueError(f"more than {MAX_NODES} values (aliases expanding too far?)")
    pos.values[loc] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                problems.append(
                    Problem(name, key_node.start_mark.line + 1, key_node.start_mark.column + 1,
                            format_loc(loc), "merge keys (<<) are not supported; use an "
                            "alias of the whole value (key: *anchor) instead")
                )
                continue
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | bool | float) or key is None:
                problems.append(
                    Problem(name, key_node.start_mark.line + 1, key_node.start_mark.column + 1,
                            format_loc(loc), "mapping keys must be plain scalars")
                )
                continue
            key_s = key if isinstance(key, str) else str(key)
            child: Loc = (*loc, key_s)
            pos.keys[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if key_s in out:
                problems.append(
                    Problem(name, key_node.start_mark.line + 1, key_node.start_mark.column + 1,
                            format_loc(child), "duplicate key")
                )
                continue
            out[key_s] = _construct(loader, value_node, child, pos, problems, name, depth + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [
            _construct(loader, item, (*loc, i), pos, problems, name, depth + 1)
            for i, item in enumerate(node.value)
        ]
    return loader.construct_object(node, deep=True)


def _problem(name: str, pos: _Positions, loc: Loc, message: str, key: bool = False) -> Problem:
    line, col = pos.of_key(loc) if key else pos.of_value(loc)
    return Problem(name, line, col, format_loc(loc), message)


def _validate(name: str, data: Any, pos: _Positions) -> model.Profile:
    if not isinstance(data, dict):
        kind = type(data).__name__ if data is not None else "null"
        raise ProfileError(
            [_problem(name, pos, (), f"expected a mapping (a HardwareProfile), got {kind}")]
        )
    head: list[Problem] = []
    api = data.get("apiVersion")
    if api != model.API_VERSION:
        msg = (
            f"unsupported apiVersion {api!r}; this sandbox reads {model.API_VERSION!r}"
            if api is not None else f"missing apiVersion (want {model.API_VERSION!r})"
        )
        head.append(_problem(name, pos, ("apiVersion",) if api is not None else (), msg))
    kind_ = data.get("kind")
    if kind_ != model.KIND:
        msg = (
            f"kind {kind_!r} is not a profile; want {model.KIND!r}"
            if kind_ is not None else f"missing kind (want {model.KIND!r})"
        )
        head.append(_problem(name, pos, ("kind",) if kind_ is not None else (), msg))
    if head:
        raise ProfileError(head)
    try:
        return model.Profile.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = [p for err in exc.errors() for p in _translate(name, data, pos, err)]
        problems = _dedupe(problems)
        raise ProfileError(sorted(problems, key=lambda p: (p.line, p.column, p.path))) from None


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[tuple[int, int, str, str]] = set()
    out = []
    for p in problems:
        k = (p.line, p.column, p.path, p.message)
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


def _real_loc(data: Any, loc: tuple[Any, ...]) -> Loc:
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
    import typing

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


def _translate(name: str, data: Any, pos: _Positions, err: Any) -> Iterator[Problem]:
    loc = _real_loc(data, tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        key = str(loc[-1])
        fields = _fields_of(data, loc[:-1])
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        if not close and fields:
            hint = f" (allowed: {', '.join(sorted(fields))})"
        yield _problem(name, pos, loc, f"unknown field {key!r}{hint}", key=True)
    elif kind == "missing":
        parent = loc[:-1]
        yield Problem(name, *pos.of_value(parent), format_loc(loc),
                      f"required field {loc[-1]!r} is missing")
    elif kind == "union_tag_invalid":
        ctx = err.get("ctx", {})
        yield _problem(
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
        yield _problem(
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
        yield _problem(name, pos, loc, msg, key=tuple(err["loc"])[-1:] == ("[key]",))

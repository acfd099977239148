"""A profile document as YAML with positions: reading a file or standard input (bounded,
UTF-8, regular files only), parsing it without merge keys, duplicate keys or runaway
aliases, and where each value and key starts (``Positions``), so that every problem is
located ``file:line:col: field.path: message``."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sandbox.errors import Problem, ProfileError
from sandbox.profile import bundled
from sandbox.profile.spec import Loc
from sandbox.yamlnodes import compose_fast

MAX_BYTES = 4 * 2**20
STDIN_NAME = "<stdin>"  # how problems in a profile read from `-` are located
MAX_NODES = 200_000  # YAML aliases can multiply a small file (the "billion laughs")


@dataclass
class Positions:
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


def file_error(name: str, message: str, line: int = 1, column: int = 1) -> ProfileError:
    return ProfileError([Problem(name, line, column, "", message)])


def read_file(name: str) -> str:
    p = Path(name)
    try:
        if p.is_dir():
            raise file_error(name, "is a directory, not a profile file")
        if p.exists() and not p.is_file() and name != "/dev/stdin":
            # a FIFO or a device would block or never end: not a profile file
            raise file_error(name, "not a regular file")
        with p.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise file_error(name, f"no such file{bundled.did_you_mean(name)}") from None
    except PermissionError:
        raise file_error(name, "permission denied") from None
    except OSError as exc:
        raise file_error(name, f"cannot read: {exc.strerror or exc}") from None
    return _decode(name, raw)


def read_stdin() -> str:
    try:
        raw = sys.stdin.buffer.read(MAX_BYTES + 1)
    except (AttributeError, ValueError):  # no standard input (closed, or not a file)
        raise file_error(STDIN_NAME, "no standard input to read the profile from") from None
    except OSError as exc:
        raise file_error(STDIN_NAME, f"cannot read: {exc.strerror or exc}") from None
    return _decode(STDIN_NAME, raw)


def _decode(name: str, raw: bytes) -> str:
    if len(raw) > MAX_BYTES:
        raise file_error(name, f"larger than {MAX_BYTES // 2**20} MiB; not a profile")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise file_error(name, f"not UTF-8 text (byte {exc.start})") from None


class _Loader(yaml.SafeLoader):
    pass


def parse(name: str, text: str) -> tuple[Any, Positions]:
    if not text.strip() or all(
        not line.strip() or line.lstrip().startswith("#") for line in text.splitlines()
    ):
        raise file_error(name, "empty file: expected a HardwareProfile document")
    fast = compose_fast(text)
    loader, root = fast if fast is not None else _compose(name, text)
    if root is None:
        raise file_error(name, "empty file: expected a HardwareProfile document")
    positions = Positions({}, {})
    problems: list[Problem] = []
    try:
        data = _construct(loader, root, (), positions, problems, name)
    except (yaml.YAMLError, ValueError, TypeError, RecursionError) as exc:
        mark = getattr(exc, "problem_mark", None) or root.start_mark
        raise file_error(name, f"invalid YAML: {exc}", mark.line + 1, mark.column + 1) from None
    if problems:
        raise ProfileError(problems)
    return data, positions


def _compose(name: str, text: str) -> tuple[_Loader, yaml.Node | None]:
    """The pure-Python parser's node tree, or its error located (``yamlnodes``)."""
    try:
        loader = _Loader(text)
    except yaml.YAMLError as exc:  # the reader rejects control characters up front
        raise file_error(name, f"invalid YAML: {getattr(exc, 'reason', exc)}") from None
    try:
        root = loader.get_single_node()
    except RecursionError:
        raise file_error(name, "invalid YAML: nested too deeply (a profile nests at most 64 "
                   "levels)") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        what = exc.problem or exc.context or "invalid YAML"
        raise file_error(name, f"invalid YAML: {what}", line, col) from None
    except yaml.YAMLError as exc:
        raise file_error(name, f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    return loader, root


def _construct(
    loader: yaml.constructor.SafeConstructor, node: yaml.Node, loc: Loc, pos: Positions,
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


def problem(name: str, pos: Positions, loc: Loc, message: str, key: bool = False) -> Problem:
    line, col = pos.of_key(loc) if key else pos.of_value(loc)
    return Problem(name, line, col, format_loc(loc), message)

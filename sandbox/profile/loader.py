"""Reading a profile file: YAML with positions -> model -> resolved cluster.

``load_profile(path)`` returns a ``LoadedProfile`` (the model as written and the fully
resolved cluster) or raises ``ProfileError`` listing every problem it found, each as
``file:line:col: field.path: message``, sorted by position.

One run reports every problem, in three stages:

1. YAML: syntax, duplicate and merge keys. Any of these stops here: what the document's
   values are is not known, so nothing below could be judged soundly.
2. Structure: the pydantic model (types, ranges, unknown and missing keys), every
   problem at once. A wrong ``apiVersion`` or ``kind`` stops here (not a profile).
3. Cross-field rules (``resolve``: models, NUMA nodes, CPU lists, PCI, kubelet...).
   When stage 2 found problems, these still run on the parts that validated, so that
   structural and semantic problems come out of the same run, and never on a value
   that failed, so that no problem is a follow-on of another:

   - a device entry with a structural problem is left out of its node;
   - a node field with one that no other rule reads (``role``, ``labels``, ``system``,
     ``kubelet``, ``swap``) is left to its default, which breaks no rule;
   - a node entry with one elsewhere (``cpu``, ``numa``, ``memory``, ``pci``, ``name``,
     ``count``) is not resolved, as its CPUs, NUMA nodes or PCI layout are unknown; its
     valid devices still get the checks that need nothing but the device itself
     (``resolve.check_device``: catalogue model, SR-IOV, partitions...);
   - the other nodes are resolved together (duplicate names, limits over the profile), as
     a profile of their own whose field paths map back to the document's (``_Kept``); a
     ``metadata`` that failed is replaced by a placeholder name (it only seeds
     identities).

   Leaving parts out can hide a problem (a PCI address clash with a device that was left
   out) but must not invent one: the rules hold for a subset of the devices or nodes if
   they hold for all of them, with two exceptions, avoided. A device left out that gives
   ``pciAddresses`` may add the host bridge another device needs: its node is treated as
   one whose own fields failed. Leaving a device out renumbers the next ones (gpu1 becomes
   gpu0), and with them the ``{i}`` in generic devices' ``devNodes``: the build that
   checks those runs only on nodes that lost no device.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import yaml

from sandbox.errors import Problem, ProfileError
from sandbox.profile import bundled, model
from sandbox.profile.resolve import ResolveFailed, check_device, resolve
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
    _check_head(name, data, positions)
    try:
        profile = model.Profile.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        structural = _dedupe([p for err in errors for p in _translate(name, data, positions,
                                                                          err)])
        structural.sort(key=lambda p: (p.line, p.column, p.path))
        failed = [_real_loc(data, tuple(err["loc"])) for err in errors]
        semantic = [_problem(name, positions, loc, msg)
                    for loc, msg in _check_what_validated(data, failed)]
        raise ProfileError(_by_position(structural + semantic)) from None
    cluster, problems = _check(profile)
    if cluster is None or problems:
        raise ProfileError(_by_position([_problem(name, positions, loc, msg)
                                         for loc, msg in problems]))
    return LoadedProfile(name, profile, cluster, text)


def _by_position(problems: list[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.line, p.column))  # stable: same place, same order


def _same(loc: Loc) -> Loc:
    return loc


def _check(profile: model.Profile, origin: Callable[[Loc], Loc] = _same,
           build: Callable[[int], bool] = lambda _i: True,
           ) -> tuple[Cluster | None, list[tuple[Loc, str]]]:
    """Stage 3 on a profile that validated: its cluster, or None and the problems.
    ``build(i)``: whether to build ``nodes[i]`` to check its devNodes."""
    try:
        cluster = resolve(profile, origin)
    except ResolveFailed as exc:
        return None, exc.problems
    return cluster, [(origin(loc), msg)
                     for loc, msg in _check_dev_nodes(profile, cluster, build)]


@dataclass
class _Kept:
    """The nodes and devices of a document that validated, as a profile of their own:
    ``nodes[k]`` is the document's ``nodes[node_index[k]]``, its ``devices[j]`` the
    document's ``devices[device_index[k][j]]``."""

    nodes: list[model.Node]
    node_index: list[int]
    device_index: list[list[int]]
    complete: list[bool]  # no device of the node was left out

    def origin(self, loc: Loc) -> Loc:
        if len(loc) < 2 or loc[0] != "nodes" or not isinstance(loc[1], int) \
                or not 0 <= loc[1] < len(self.nodes):
            return loc
        k, rest = loc[1], loc[2:]
        if len(rest) >= 2 and rest[0] == "devices" and isinstance(rest[1], int) \
                and 0 <= rest[1] < len(self.device_index[k]):
            rest = ("devices", self.device_index[k][rest[1]], *rest[2:])
        return ("nodes", self.node_index[k], *rest)


# The fields of a node entry that no rule about anything else reads (and whose defaults
# break no rule): one that failed is left to its default and the node is still resolved.
_READ_BY_NONE = frozenset({"role", "labels", "system", "kubelet", "swap"})


@functools.cache
def _device_adapter() -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(model.Device)


def _valid(validate: Callable[[Any], Any], value: Any) -> Any:
    try:
        return validate(value)
    except pydantic.ValidationError:
        return None


def _check_what_validated(data: dict[str, Any], failed: list[Loc]) -> list[tuple[Loc, str]]:
    """Stage 3 on the parts of a document that validated, ``failed`` the field paths of
    its structural problems (see the module docstring)."""
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or ("nodes",) in failed:
        return []
    problems: list[tuple[Loc, str]] = []
    kept = _Kept([], [], [], [])
    for i, raw in enumerate(nodes):
        inside = [loc[2:] for loc in failed if loc[:2] == ("nodes", i)]
        bad_devices = {j for loc in inside if (j := _device_index(loc)) is not None}
        bad_fields = {loc[0] if loc else "" for loc in inside if _device_index(loc) is None}
        if not isinstance(raw, dict):
            continue
        devices = raw.get("devices", [])
        if not isinstance(devices, list):
            devices = []
        good = [j for j in range(len(devices)) if j not in bad_devices]
        addressed = any(isinstance(devices[j], dict) and "pciAddresses" in devices[j]
                        for j in bad_devices if 0 <= j < len(devices))
        if bad_fields - _READ_BY_NONE or addressed:
            for j in good:
                device = _valid(_device_adapter().validate_python, devices[j])
                if device is not None:
                    problems += check_device(device, ("nodes", i, "devices", j))
            continue
        entry = {k: v for k, v in raw.items() if k not in bad_fields}
        if "devices" in raw:
            entry["devices"] = [devices[j] for j in good]
        node = _valid(model.Node.model_validate, entry)
        if node is not None:
            kept.nodes.append(node)
            kept.node_index.append(i)
            kept.device_index.append(good)
            kept.complete.append(not bad_devices)
    if not kept.nodes:
        return problems
    metadata = data.get("metadata")
    if any(loc[:1] == ("metadata",) for loc in failed):
        metadata = {"name": "profile"}  # only seeds identities, which no rule reads
    profile = _valid(model.Profile.model_validate, {
        "apiVersion": model.API_VERSION, "kind": model.KIND, "metadata": metadata,
        "nodes": kept.nodes})
    if profile is not None:
        problems += _check(profile, kept.origin, lambda k: kept.complete[k])[1]
    return problems


def _device_index(loc: Loc) -> int | None:
    """j for a path ``devices[j]...`` within a node entry."""
    return loc[1] if len(loc) >= 2 and loc[0] == "devices" and isinstance(loc[1], int) \
        else None


def _check_dev_nodes(profile: model.Profile, cluster: Cluster, build: Callable[[int], bool]
                     ) -> Iterator[tuple[Loc, str]]:
    """Generic devices' ``devNodes`` are the only paths a profile names itself: build the
    first replica of each node that has some, so a clash with another device's node (or a
    node that is also used as a directory) is a located error, not a crash of the builder."""
    from sandbox.fakehw.builder import build_tree  # the builder imports the profile package
    from sandbox.fakehw.tree import TreeError

    for i, node in enumerate(profile.nodes):
        with_nodes = [j for j, d in enumerate(node.devices)
                      if isinstance(d, model.Generic) and d.dev_nodes]
        spec = cluster.node(node.name, 0)
        if not with_nodes or spec is None or not build(i):
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


def _check_head(name: str, data: Any, pos: _Positions) -> None:
    """A mapping with this sandbox's apiVersion and kind, or not a profile at all."""
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

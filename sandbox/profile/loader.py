"""Reading a profile file: YAML with positions -> model -> resolved cluster.

``load_profile(path)`` returns a ``LoadedProfile`` (the model as written and the fully
resolved cluster) or raises ``ProfileError`` listing every problem it found, each as
``file:line:col: field.path: message``, sorted by position. Reading and parsing the YAML
with positions is ``document``'s; pydantic's errors in the document's words ``problems``'.

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
   gpu0), and with them the ``{i}`` in generic devices' ``devNodes``: their check
   (``devnames``) runs only on nodes that lost no device.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pydantic

from sandbox.errors import Problem, ProfileError
from sandbox.profile import bundled, model
from sandbox.profile.devnames import dev_node_problems
from sandbox.profile.document import (
    STDIN_NAME,
    Positions,
    parse,
    problem,
    read_file,
    read_stdin,
)
from sandbox.profile.problems import dedupe, real_loc, translate
from sandbox.profile.resolve import ResolveFailed, check_device, resolve
from sandbox.profile.spec import Cluster, Loc


@dataclass(frozen=True)
class LoadedProfile:
    path: str  # the file read, or STDIN_NAME
    profile: model.Profile
    cluster: Cluster
    text: str = ""  # the document as read



def load_profile(path: str | os.PathLike[str]) -> LoadedProfile:
    """``path``: a file, ``-`` for standard input, or a bundled profile's name
    (``sandbox.profile.bundled``)."""
    name = str(path)
    if name == bundled.STDIN:
        return load_profile_text(read_stdin(), STDIN_NAME)
    located = bundled.locate(name)
    return load_profile_text(read_file(located), located)


def load_profile_text(text: str, name: str = "<string>") -> LoadedProfile:
    """Like ``load_profile`` for text already in memory (tests, stdin)."""
    data, positions = parse(name, text)
    _check_head(name, data, positions)
    try:
        profile = model.Profile.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        structural = dedupe([p for err in errors for p in translate(name, data, positions,
                                                                          err)])
        structural.sort(key=lambda p: (p.line, p.column, p.path))
        failed = [real_loc(data, tuple(err["loc"])) for err in errors]
        semantic = [problem(name, positions, loc, msg)
                    for loc, msg in _check_what_validated(data, failed)]
        raise ProfileError(_by_position(structural + semantic)) from None
    cluster, problems = _check(profile)
    if cluster is None or problems:
        raise ProfileError(_by_position([problem(name, positions, loc, msg)
                                         for loc, msg in problems]))
    return LoadedProfile(name, profile, cluster, text)


def _by_position(problems: list[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.line, p.column))  # stable: same place, same order


def _same(loc: Loc) -> Loc:
    return loc


def _check(profile: model.Profile, origin: Callable[[Loc], Loc] = _same,
           check: Callable[[int], bool] = lambda _i: True,
           ) -> tuple[Cluster | None, list[tuple[Loc, str]]]:
    """Stage 3 on a profile that validated: its cluster, or None and the problems.
    ``check(i)``: whether to check the devNodes of ``nodes[i]``."""
    try:
        cluster = resolve(profile, origin)
    except ResolveFailed as exc:
        return None, exc.problems
    return cluster, [(origin(loc), msg)
                     for loc, msg in _check_dev_nodes(profile, cluster, check)]


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


def _check_dev_nodes(profile: model.Profile, cluster: Cluster, check: Callable[[int], bool]
                     ) -> Iterator[tuple[Loc, str]]:
    """Generic devices' ``devNodes`` are the only /dev paths and numbers a profile names
    itself: each that takes what a driver on its node owns, or clashes with another, is a
    located problem (``devnames``), checked on the first replica of each node."""
    for i, node in enumerate(profile.nodes):
        if not any(isinstance(d, model.Generic) and d.dev_nodes for d in node.devices):
            continue
        spec = cluster.node(node.name, 0)
        if spec is None or not check(i):
            continue
        seen: set[tuple[Loc, int]] = set()  # an entry's replicas: its first problem only
        for dev, k, field, message in dev_node_problems(spec):
            if (dev.source, k) not in seen:
                seen.add((dev.source, k))
                yield (*dev.source, "devNodes", k, field), message


def _check_head(name: str, data: Any, pos: Positions) -> None:
    """A mapping with this sandbox's apiVersion and kind, or not a profile at all."""
    if not isinstance(data, dict):
        kind = type(data).__name__ if data is not None else "null"
        raise ProfileError(
            [problem(name, pos, (), f"expected a mapping (a HardwareProfile), got {kind}")]
        )
    head: list[Problem] = []
    api = data.get("apiVersion")
    if api != model.API_VERSION:
        msg = (
            f"unsupported apiVersion {api!r}; this sandbox reads {model.API_VERSION!r}"
            if api is not None else f"missing apiVersion (want {model.API_VERSION!r})"
        )
        head.append(problem(name, pos, ("apiVersion",) if api is not None else (), msg))
    kind_ = data.get("kind")
    if kind_ != model.KIND:
        msg = (
            f"kind {kind_!r} is not a profile; want {model.KIND!r}"
            if kind_ is not None else f"missing kind (want {model.KIND!r})"
        )
        head.append(problem(name, pos, ("kind",) if kind_ is not None else (), msg))
    if head:
        raise ProfileError(head)

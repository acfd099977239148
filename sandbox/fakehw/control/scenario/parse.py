"""Fault scenario files: reading, parsing and validating them into a ``Scenario``.

``load_scenario`` (a path), ``parse_scenario_text`` (YAML text) and ``parse_scenario`` (a
decoded document) check the whole file and report every problem at once
(``ScenarioError``), each located like a profile problem: ``file:line:col: path: message``.
The locations come from the YAML nodes' marks (``_construct`` records where each value and
key starts); a document given as a Python object has no lines to name. The bounds below
refuse a file before anything is expanded in memory or sent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from sandbox.errors import ScenarioError
from sandbox.fakehw.changes import FAULT_OPS as OPS
from sandbox.fakehw.tree import Health, Reason
from sandbox.yamlnodes import compose_fast

ACTIONS = (*OPS, "storm")
EXPECT_KEYS = ("health", "reason", "plugged", "num_vfs")
POD_EXPECT_KEYS = ("pod", "device", "health", "container")
POD_HEALTH = ("Healthy", "Unhealthy", "Unknown")  # as the kubelet writes it
# Bounds: a scenario is a test plan, not a workload generator. Past these it is refused
# before anything is expanded in memory or sent.
MAX_BYTES = 1 << 20
MAX_DEPTH = 64  # nesting levels; a scenario needs 4
MAX_VALUES = 600_000  # YAML values in all: more than 1 MiB of plain YAML holds, so only
# aliases re-used over and over (the "billion laughs") reach it
MAX_SECONDS = 7 * 24 * 3600.0  # at, every, over
MAX_ACTIONS = 100_000  # every change of every step, repeats and storms included
MAX_SEED = 2**64
MAX_VFS = 4096  # as the control API
MAX_PORT = 255
_STEP_KEYS = {
    "health": {"device", "health", "reason"},
    "unplug": {"device"},
    "plug": {"device"},
    "set-vfs": {"device", "num_vfs", "port"},
    "storm": {"changes", "over", "devices", "ops", "seed", "max_vfs"},
}
_COMMON = {"at", "do", "repeat", "every", "expect"}


@dataclass(frozen=True)
class Step:
    at: float
    do: str | None  # an op, "storm", or None for an expect-only step
    args: Mapping[str, Any]
    repeat: int = 1
    every: float = 0.0
    expect: Mapping[str, Mapping[str, Any]] | None = None
    where: str = ""  # "line:col" of the step in its file, when it came from one
    pod_expect: PodExpect | None = None  # expect: {pod: ..., device: ..., health: ...}


@dataclass(frozen=True)
class PodExpect:
    """What a pod's status should say of a device: ``expect: {pod: default/train,
    device: gpu3, health: Unhealthy}`` (the kubelet's allocatedResourcesStatus)."""

    namespace: str
    pod: str
    device: str  # the profile's device id, or the kubelet's resource id itself
    health: str  # Healthy | Unhealthy | Unknown
    container: str | None = None

    def __str__(self) -> str:
        container = f" container {self.container}" if self.container else ""
        return f"pod {self.namespace}/{self.pod}{container} {self.device} health {self.health}"


@dataclass(frozen=True)
class Scenario:
    steps: tuple[Step, ...]
    seed: int = 0
    source: str = "<scenario>"



# -- loading ------------------------------------------------------------------------------
class _Positions:
    """Where each value and each mapping key of a scenario file starts (1-based line and
    column), by the path problems name: ``steps``, ``steps[0]``, ``steps[0].at``."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[int, int]] = {}
        self.keys: dict[str, tuple[int, int]] = {}
        self.visited = 0
        self.last = (1, 1)  # the value or key constructed last

    def of(self, where: str, *, key: bool = False) -> tuple[int, int]:
        if key and where in self.keys:
            return self.keys[where]
        while where not in self.values and where:
            where = where[:max(where.rfind("."), where.rfind("["), 0)]
        return self.values.get(where, (1, 1))


class _Problems:
    def __init__(self, source: str, positions: _Positions | None = None) -> None:
        self.source = source
        self.positions = positions
        self.lines: list[str] = []

    def at(self, where: str, *, key: bool = False) -> str:
        """``source:line:col`` of ``where`` (just ``source`` without positions)."""
        if self.positions is None:
            return self.source
        line, col = self.positions.of(where, key=key)
        return f"{self.source}:{line}:{col}"

    def __call__(self, where: str, msg: str, *, key: bool = False) -> None:
        """One problem with the value at ``where`` (with its key, for an unknown field)."""
        self.lines.append(f"{self.at(where, key=key)}: {where}: {msg}")

    def __len__(self) -> int:
        return len(self.lines)


def _whole(source: str, msg: str, line: int = 1, col: int = 1) -> ScenarioError:
    return ScenarioError([f"{source}:{line}:{col}: {msg}"])


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        if p.is_dir():
            raise _whole(str(p), "is a directory, not a scenario file")
        if p.exists() and not p.is_file():
            raise _whole(str(p), "not a regular file")  # a FIFO would block forever
        with p.open("rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise _whole(str(p), f"cannot read: {exc.strerror}") from exc
    if len(raw) > MAX_BYTES:
        raise _whole(str(p), f"larger than {MAX_BYTES >> 20} MiB; not a scenario")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise _whole(str(p), f"not UTF-8 text (byte {exc.start})", line, col) from None
    return parse_scenario_text(text, source=str(p))


class _Loader(yaml.SafeLoader):
    pass


def _mark(mark: yaml.Mark | None) -> tuple[int, int]:
    return (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)


def parse_scenario_text(text: str, *, source: str = "<scenario>") -> Scenario:
    """Parse and validate a scenario's YAML text; ScenarioError for any problem, each
    with the line and column it is about."""
    fast = compose_fast(text)
    loader, root = fast if fast is not None else _compose(text, source)
    if root is None:
        raise _whole(source, "empty file: expected a mapping with `steps`")
    positions = _Positions()
    problems: list[str] = []
    try:
        doc = _construct(loader, root, "", positions, problems, source)
    except _TooMuch as exc:
        raise _whole(source, f"not YAML: {exc.message}", *exc.where) from None
    except yaml.MarkedYAMLError as exc:
        line, col = _mark(exc.problem_mark or exc.context_mark)
        raise _whole(source, f"not YAML: {exc.problem or exc}", line, col) from None
    except (yaml.YAMLError, ValueError, TypeError, RecursionError) as exc:
        # e.g. an integer past Python's digit limit: its node was the last one recorded
        raise _whole(source, f"not YAML: {exc}", *positions.last) from None
    if problems:
        raise ScenarioError(problems)
    return parse_scenario(doc, source=source, positions=positions)


def _compose(text: str, source: str) -> tuple[_Loader, yaml.Node | None]:
    """The pure-Python parser's node tree, or its error located (``yamlnodes``)."""
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as exc:  # control characters, rejected up front
        pos = exc.position
        line = text.count("\n", 0, pos) + 1
        col = pos - (text.rfind("\n", 0, pos) + 1) + 1
        raise _whole(source, f"not YAML: {exc.reason}", line, col) from None
    try:
        root = loader.get_single_node()
    except RecursionError:
        raise _whole(source, f"not YAML: nested too deeply (at most {MAX_DEPTH} "
                             "levels)") from None
    except yaml.MarkedYAMLError as exc:
        line, col = _mark(exc.problem_mark or exc.context_mark)
        what = exc.problem or exc.context or "invalid YAML"
        raise _whole(source, f"not YAML: {what}", line, col) from None
    except (yaml.YAMLError, ValueError) as exc:
        raise _whole(source, f"not YAML: {exc}") from None
    finally:
        loader.dispose()
    return loader, root


class _TooMuch(Exception):
    def __init__(self, message: str, where: tuple[int, int]) -> None:
        self.message = message
        self.where = where


def _construct(loader: yaml.constructor.SafeConstructor, node: yaml.Node, where: str,
               pos: _Positions, problems: list[str], source: str, depth: int = 0) -> Any:
    """The document below ``node``, recording where each value and key starts."""
    start = _mark(node.start_mark)
    if depth > MAX_DEPTH:
        raise _TooMuch(f"nested deeper than {MAX_DEPTH} levels", start)
    pos.visited += 1
    if pos.visited > MAX_VALUES:
        raise _TooMuch(f"more than {MAX_VALUES} values (aliases expanding too far?)", start)
    pos.values.setdefault(where, start)
    pos.last = start
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            kline, kcol = _mark(key_node.start_mark)
            here = f"{source}:{kline}:{kcol}: {where}" if where else f"{source}:{kline}:{kcol}"
            if key_node.tag == "tag:yaml.org,2002:merge":
                problems.append(f"{here}: merge keys (<<) are not supported")
                continue
            pos.last = (kline, kcol)
            key = loader.construct_object(key_node, deep=True)
            if isinstance(key, list | dict | set) or key is None:
                problems.append(f"{here}: mapping keys must be plain scalars")
                continue
            child = f"{where}.{key}" if where else str(key)
            if key in out:
                problems.append(f"{source}:{kline}:{kcol}: {child}: duplicate key")
                continue
            pos.keys.setdefault(child, (kline, kcol))
            out[key] = _construct(loader, value_node, child, pos, problems, source, depth + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(loader, item, f"{where}[{i}]", pos, problems, source, depth + 1)
                for i, item in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


def _num(v: object) -> TypeGuard[int | float]:
    """A finite number of seconds within MAX_SECONDS (NaN, inf and 1e300 are not)."""
    return (isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v) and -MAX_SECONDS <= v <= MAX_SECONDS)


def _int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and -MAX_SEED <= v <= MAX_SEED


def parse_scenario(doc: object, *, source: str = "<scenario>",
                   positions: _Positions | None = None) -> Scenario:
    """Validate a decoded scenario document; raises ScenarioError listing every problem
    (located when ``positions`` of the file it came from are given)."""
    bad = _Problems(source, positions)
    if not isinstance(doc, dict):
        raise ScenarioError([f"{bad.at('')}: expected a mapping with `steps`"])
    for key in sorted(set(doc) - {"version", "seed", "steps", "name", "description"}, key=str):
        bad(str(key), "unknown field", key=True)
    if not _int(doc.get("version", 1)) or doc.get("version", 1) != 1:
        bad("version", f"unsupported version {doc.get('version')!r} (have 1)")
    seed = doc.get("seed", 0)
    if not _int(seed):
        bad("seed", "expected an integer")
        seed = 0
    raw_steps = doc.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        bad("steps", "expected a non-empty list")
        raw_steps = []
    steps = []
    for i, raw in enumerate(raw_steps):
        step = _parse_step(raw, f"steps[{i}]", bad)
        if step is not None:
            steps.append(step)
    total = count_changes(steps)
    if total > MAX_ACTIONS:
        bad("steps", f"{total} changes in all (repeats and storms included); at most "
                     f"{MAX_ACTIONS}")
    if bad.lines:
        raise ScenarioError(bad.lines)
    return Scenario(tuple(steps), seed, source)


def count_changes(steps: Sequence[Step]) -> int:
    """How many changes ``steps`` make in all (repeats and storms included)."""
    return sum(st.repeat * (st.args["changes"] if st.do == "storm" else 1)
               for st in steps if st.do is not None)


def _parse_step(raw: object, where: str, bad: _Problems) -> Step | None:
    if not isinstance(raw, dict):
        bad(where, "expected a mapping")
        return None
    n_before = len(bad)
    at = raw.get("at")
    if not _num(at) or at < 0:
        bad(f"{where}.at", f"expected a number of seconds, 0 to {MAX_SECONDS:g}")
    do = raw.get("do")
    expect = raw.get("expect")
    if do is None and expect is None:
        bad(where, "needs `do` or `expect`")
    if do is not None and do not in ACTIONS:
        bad(f"{where}.do", f"unknown action {do!r} (expected {', '.join(ACTIONS)})")
        do = None
    allowed = _COMMON | (_STEP_KEYS[do] if do else set())
    for key in sorted(set(raw) - allowed, key=str):
        bad(f"{where}.{key}", "unknown field" + (f" for {do}" if do else ""), key=True)
    repeat = raw.get("repeat", 1)
    every = raw.get("every", 0.0)
    if not _int(repeat) or not 1 <= repeat <= MAX_ACTIONS:
        bad(f"{where}.repeat", f"expected an integer 1..{MAX_ACTIONS}")
        repeat = 1
    if not _num(every) or every < 0:
        bad(f"{where}.every", f"expected a number of seconds, 0 to {MAX_SECONDS:g}")
    elif repeat > 1 and every <= 0:
        bad(f"{where}.every", "required (> 0) when repeat > 1")
    if do in OPS:
        _check_op_args(do, raw, where, bad)
    if do == "storm":
        _check_storm(raw, where, bad)
    pod_expect = None
    if is_pod_expect(expect):
        pod_expect = _check_pod_expect(expect, f"{where}.expect", bad)
        expect = None
    elif expect is not None:
        _check_expect(expect, f"{where}.expect", bad)
    if len(bad) != n_before or not _num(at) or not _num(every):
        return None
    args = {k: v for k, v in raw.items() if k not in _COMMON}
    located = bad.at(where)[len(bad.source) + 1:]
    return Step(float(at), do, args, repeat, float(every), expect, located, pod_expect)


def is_pod_expect(expect: object) -> TypeGuard[Mapping[str, Any]]:
    """``expect`` is about a pod's status (a ``pod`` key with a string value), not the
    state of devices by id (``{gpu0: {plugged: true}}``, whose values are mappings)."""
    return isinstance(expect, dict) and isinstance(expect.get("pod"), str)


def _check_pod_expect(expect: Mapping[str, Any], where: str, bad: _Problems
                      ) -> PodExpect | None:
    n_before = len(bad)
    for key in sorted(set(expect) - set(POD_EXPECT_KEYS), key=str):
        bad(f"{where}.{key}", f"unknown field (expected {', '.join(POD_EXPECT_KEYS)})",
            key=True)
    namespace, _, pod = str(expect["pod"]).rpartition("/")
    namespace = namespace or "default"
    if not pod or "/" in namespace:
        bad(f"{where}.pod", "expected NAMESPACE/NAME or NAME (namespace default), e.g. "
                            "default/train")
    device = expect.get("device")
    if not isinstance(device, str) or not device:
        bad(f"{where}.device", "expected a device id such as gpu3 (or the kubelet's "
                               "resource id)")
    health = expect.get("health")
    if health not in POD_HEALTH:
        bad(f"{where}.health", f"expected one of {', '.join(POD_HEALTH)} (as the kubelet "
                               "writes it)")
    container = expect.get("container")
    if container is not None and (not isinstance(container, str) or not container):
        bad(f"{where}.container", "expected a container name")
    if len(bad) != n_before:
        return None
    return PodExpect(namespace, pod, str(device), str(health),
                     str(container) if container is not None else None)


def _check_op_args(op: str, raw: Mapping[str, Any], where: str, bad: _Problems) -> None:
    device = raw.get("device")
    if not isinstance(device, str) or not device:
        bad(f"{where}.device", "expected a device id such as gpu0")
    if op == "health":
        h = raw.get("health")
        if h not in [x.value for x in Health]:
            bad(f"{where}.health", "expected healthy or unhealthy")
        reason = raw.get("reason")
        reasons = [r.value for r in Reason]
        if h == "unhealthy" and reason not in reasons:
            bad(f"{where}.reason", f"expected one of {', '.join(reasons)}")
        if h == "healthy" and reason is not None:
            bad(f"{where}.reason", "a healthy device takes no reason")
    if op == "set-vfs":
        n = raw.get("num_vfs")
        if not _int(n) or not 0 <= n <= MAX_VFS:
            bad(f"{where}.num_vfs", f"expected an integer 0..{MAX_VFS}")
        port = raw.get("port")
        if port is not None and (not _int(port) or not 0 <= port <= MAX_PORT):
            bad(f"{where}.port", f"expected an integer 0..{MAX_PORT}")


def _check_storm(raw: Mapping[str, Any], where: str, bad: _Problems) -> None:
    changes = raw.get("changes")
    if not _int(changes) or not 1 <= changes <= MAX_ACTIONS:
        bad(f"{where}.changes", f"expected an integer 1..{MAX_ACTIONS}")
    over = raw.get("over", 0.0)
    if not _num(over) or over < 0:
        bad(f"{where}.over", f"expected a number of seconds, 0 to {MAX_SECONDS:g}")
    devices = raw.get("devices")
    if devices is not None and (
        not isinstance(devices, list)
        or not devices
        or not all(isinstance(d, str) and d for d in devices)
    ):
        bad(f"{where}.devices", "expected a non-empty list of device ids")
    ops = raw.get("ops")
    if ops is not None and (not isinstance(ops, list) or not ops
                            or not all(isinstance(o, str) and o in OPS for o in ops)):
        bad(f"{where}.ops", f"expected a non-empty list of {', '.join(OPS)}")
    if "seed" in raw and not _int(raw["seed"]):
        bad(f"{where}.seed", "expected an integer")
    if "max_vfs" in raw and (not _int(raw["max_vfs"]) or not 0 <= raw["max_vfs"] <= MAX_VFS):
        bad(f"{where}.max_vfs", f"expected an integer 0..{MAX_VFS}")


def _check_expect(expect: object, where: str, bad: _Problems) -> None:
    if not isinstance(expect, dict) or not expect:
        bad(where, "expected a mapping of device id to expected state, or {pod: NAME, "
                   "device: ID, health: Healthy|Unhealthy|Unknown}")
        return
    for dev, want in expect.items():
        w = f"{where}.{dev}"
        if not isinstance(want, dict) or not want:
            bad(w, f"expected a mapping with some of {', '.join(EXPECT_KEYS)}")
            continue
        for key in sorted(set(want) - set(EXPECT_KEYS), key=str):
            bad(f"{w}.{key}", f"unknown field (expected {', '.join(EXPECT_KEYS)})", key=True)
        if "health" in want and want["health"] not in [h.value for h in Health]:
            bad(f"{w}.health", "expected healthy or unhealthy")
        if "reason" in want and want["reason"] not in [*(r.value for r in Reason), None]:
            bad(f"{w}.reason", "expected a reason or null")
        if "plugged" in want and not isinstance(want["plugged"], bool):
            bad(f"{w}.plugged", "expected true or false")
        if "num_vfs" in want and want["num_vfs"] is not None and not (
                _int(want["num_vfs"]) and 0 <= want["num_vfs"] <= MAX_VFS):
            bad(f"{w}.num_vfs", "expected an integer or null")


"""The control API's wire format: where a node's socket lives, and its requests.

One JSON object per line of strict UTF-8 (docs/control-api.md); ``decode_request`` and
``decode_reply`` turn a line into a JSON value, ``parse_request`` turns a decoded request
into the ``Change`` it asks for, refusing anything else with a ControlError that names
the field. Both ends (``serve.controlserver`` the server, ``client`` the client) use it.

Where things live (``control_paths``): for a mount at ``ROOT`` the socket is
``ROOT.sock`` and the saved states ``ROOT.state.json``, next to the mount point; with an
explicit ``state_dir`` they are ``state_dir/control.sock`` and ``state_dir/state.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sandbox.errors import ControlError, MountError, SandboxError
from sandbox.fakehw.changes import OPS, Change, Op
from sandbox.fakehw.tree import Health, Reason

PROTOCOL_VERSION = 1
MAX_LINE = 64 * 1024
MAX_REPLY = 16 * MAX_LINE  # a reply (a big node's `get`) may be longer than a request
SUN_PATH_MAX = 107  # bytes in a unix socket path: sun_path is 108 with its NUL
# Bounds that keep a hostile line cheap to refuse:
MAX_DIGITS = 20  # integers in a request (ids, num_vfs) or a reply (seq, pid) are small
MAX_DEPTH = 8  # requests are flat objects; deeper JSON is refused before it is decoded
MAX_REPLY_DEPTH = 16  # a `get` reply nests 4 levels
# "node": the node the client means; a server serving another refuses the request
_COMMON_KEYS = frozenset({"v", "op", "id", "node"})
MAX_NODE_NAME = 253  # a Kubernetes node name
_OP_KEYS: dict[str, frozenset[str]] = {
    "get": frozenset(),
    "watch": frozenset(),
    "health": frozenset({"device", "health", "reason"}),
    "unplug": frozenset({"device"}),
    "plug": frozenset({"device"}),
    "set-vfs": frozenset({"device", "num_vfs", "port"}),
    # MIG lifecycle (sandbox.fakehw.mig): what our NVML's create/destroy calls send
    "mig-mode": frozenset({"device", "enabled"}),
    "gi-create": frozenset({"device", "profile", "start"}),
    "gi-destroy": frozenset({"device", "gi"}),
    "ci-create": frozenset({"device", "gi", "profile"}),
    "ci-destroy": frozenset({"device", "gi", "ci"}),
    "mig-reset": frozenset({"device"}),  # back to the profile's mode and instances
}
MAX_MIG_ID = 63  # profile ids, placements and instance ids are small
MAX_VFS = 4096
MAX_PORT = 255  # physical functions of one device (a PCI device has at most 256)


@dataclass(frozen=True)
class ControlPaths:
    """Where a live node's control socket and saved states are."""

    socket: Path
    state: Path


def control_paths(
    root: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None = None
) -> ControlPaths:
    """The socket and state-file paths for a mount at ``root`` (see the module doc).
    MountError if the socket path is too long to bind."""
    if state_dir is not None:
        base = Path(state_dir).absolute()
        paths = ControlPaths(base / "control.sock", base / "state.json")
    else:
        r = Path(root).absolute()
        paths = ControlPaths(r.parent / f"{r.name}.sock", r.parent / f"{r.name}.state.json")
    check_socket_path(paths.socket, MountError)
    return paths


def check_socket_path(
    path: str | os.PathLike[str], error: type[SandboxError] = ControlError
) -> None:
    """Raise ``error`` if ``path`` is longer than a unix socket address can hold."""
    size = len(os.fsencode(path))
    if size > SUN_PATH_MAX:
        raise error(f"{os.fspath(path)}: socket path is {size} bytes long; a unix socket "
                    f"path (sun_path) holds at most {SUN_PATH_MAX} bytes")


# -- requests -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    op: str
    id: str | int | None
    change: Change | None
    node: str | None = None


def parse_request(obj: object) -> Request:
    """Validate one decoded request. Raises ControlError naming the first problem."""
    if not isinstance(obj, dict):
        raise ControlError("a request must be a JSON object")
    rid = obj.get("id")
    if rid is not None and (not isinstance(rid, str | int) or isinstance(rid, bool)):
        raise ControlError("id: expected a string or an integer")
    if "v" not in obj:
        raise ControlError(f'v: missing protocol version (send "v": {PROTOCOL_VERSION})')
    if type(obj["v"]) is not int or obj["v"] != PROTOCOL_VERSION:
        raise ControlError(
            f"v: unsupported protocol version {obj['v']!r} (have {PROTOCOL_VERSION})"
        )
    op = obj.get("op")
    if not isinstance(op, str) or op not in _OP_KEYS:
        raise ControlError(f"op: expected one of {', '.join(_OP_KEYS)}, got {op!r}")
    extra = set(obj) - _COMMON_KEYS - _OP_KEYS[op]
    if extra:
        raise ControlError(f"{op}: unexpected field(s) {', '.join(sorted(extra))}")
    node = obj.get("node")
    if node is not None and not (isinstance(node, str) and 0 < len(node) <= MAX_NODE_NAME
                                 and node.isprintable()):
        raise ControlError(f"{op}: node: expected a node name")
    return replace(_parse_op(obj, op, rid), node=node)


def _parse_op(obj: dict[str, Any], op: str, rid: str | int | None) -> Request:
    if op in ("get", "watch"):
        return Request(op, rid, None)
    device = obj.get("device")
    if not isinstance(device, str) or not device:
        raise ControlError(f"{op}: device: expected a device id such as gpu0")
    assert op in OPS
    change_op: Op = op
    if op == "health":
        return Request(op, rid, _health_change(obj, device))
    if op == "set-vfs":
        return Request(op, rid, _vfs_change(obj, device))
    if op == "mig-mode":
        enabled = obj.get("enabled")
        if not isinstance(enabled, bool):
            raise ControlError("mig-mode: enabled: expected true or false")
        return Request(op, rid, Change(change_op, device, enabled=enabled))
    if op in ("gi-create", "gi-destroy", "ci-create", "ci-destroy"):
        n = {k: _small_int(obj, op, k, required=k != "start") for k in _OP_KEYS[op] - {"device"}}
        return Request(op, rid, Change(change_op, device, profile=n.get("profile"),
                                       start=n.get("start"), gi=n.get("gi"), ci=n.get("ci")))
    return Request(op, rid, Change(change_op, device))


def _small_int(obj: dict[str, Any], op: str, key: str, *, required: bool) -> int | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_MIG_ID:
        raise ControlError(f"{op}: {key}: expected an integer 0..{MAX_MIG_ID}")
    return value


def _health_change(obj: dict[str, Any], device: str) -> Change:
    health_s = obj.get("health")
    health_values = [h.value for h in Health]
    if health_s not in health_values:
        raise ControlError(f"health: health: expected one of {', '.join(health_values)}")
    health = Health(health_s)
    reason_s = obj.get("reason")
    reason_values = [r.value for r in Reason]
    if health is Health.HEALTHY:
        if reason_s is not None:
            raise ControlError("health: reason: a healthy device takes no reason")
        return Change("health", device, health=health)
    if reason_s not in reason_values:
        raise ControlError(f"health: reason: expected one of {', '.join(reason_values)}")
    return Change("health", device, health=health, reason=Reason(reason_s))


def _vfs_change(obj: dict[str, Any], device: str) -> Change:
    n = obj.get("num_vfs")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_VFS:
        raise ControlError(f"set-vfs: num_vfs: expected an integer 0..{MAX_VFS}")
    port = obj.get("port")
    if port is not None and (
        not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= MAX_PORT
    ):
        raise ControlError(f"set-vfs: port: expected an integer 0..{MAX_PORT}")
    return Change("set-vfs", device, num_vfs=n, port=port)


def decode_request(raw: bytes) -> object:
    """One request line -> JSON value, refusing what no client sends: text that is not
    strict UTF-8 (a byte order mark, lone surrogates), nesting deeper than MAX_DEPTH,
    integers longer than MAX_DIGITS, NaN/Infinity, duplicate keys. Raises ControlError
    with the reason."""
    return _decode(raw, MAX_DEPTH, "request")


def decode_reply(raw: bytes) -> object:
    """One reply or event line -> JSON value, as strict as ``decode_request`` but nested
    up to MAX_REPLY_DEPTH. Raises ControlError with the reason."""
    return _decode(raw, MAX_REPLY_DEPTH, "reply")


def _decode(raw: bytes, max_depth: int, what: str) -> object:
    if _depth(raw, max_depth) > max_depth:
        raise ControlError(f"not a {what}: JSON nested deeper than {max_depth} levels")
    try:
        text = raw.decode("utf-8")  # json.loads(bytes) would take UTF-16 and UTF-32 too
    except UnicodeDecodeError as exc:
        raise ControlError(f"not a JSON line: not UTF-8 ({exc.reason} at byte {exc.start})"
                           ) from None
    if text.startswith("\ufeff"):
        raise ControlError("not a JSON line: a byte order mark (send UTF-8 without one)")
    try:
        value = json.loads(text, parse_int=_parse_int, parse_constant=_no_constant,
                           object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ControlError(f"not a JSON line: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ControlError(f"not a {what}: {exc}") from None
    # Strict UTF-8 text holds no surrogates: only a \u escape can make one.
    bad = _lone_surrogate(value) if "\\u" in text else None
    if bad is not None:
        raise ControlError(f"not a JSON line: lone surrogate U+{ord(bad):04X} (not UTF-8)")
    return value


def _depth(raw: bytes, limit: int) -> int:
    """The deepest nesting of [ and { outside strings, up to just past ``limit`` (a cheap
    scan, no recursion)."""
    deepest = depth = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _lone_surrogate(value: object) -> str | None:
    """The first surrogate code point in any string (key or value) of ``value``."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
            stack.extend(item.keys())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return item[exc.start]
    return None


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"integer with more than {MAX_DIGITS} digits")
    return int(text)


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def encode_line(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def error_reply(rid: str | int | None, message: str, code: str | None = None
                ) -> dict[str, Any]:
    reply: dict[str, Any] = {"v": PROTOCOL_VERSION, "ok": False, "id": rid, "error": message}
    if code is not None:  # what kind of refusal (errors.ControlError.code)
        reply["code"] = code
    return reply

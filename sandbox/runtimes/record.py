"""The sandbox record, ``<state dir>/sandbox.json``: what ``up`` made, typed, read and
written here alone (``read_record``, ``write_record``).

Every runtime records its name, runtime, profile and nodes (each node's tree root and
control socket: what ``sandbox fault`` talks to); the backend-specific keys are optional
fields (``local``: processes and status files; ``kind``: cluster, network, kubeconfig;
``native``: ports, host paths and sysctls to put back). The JSON keeps the shape earlier
versions wrote (one quirk: ``created`` is the creation time, or for ``native`` the host
paths ``up`` created). A record that is not one this version can read is a
``RecordError`` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from sandbox.errors import RecordError, SandboxError

RECORD = "sandbox.json"
STATE_MARKER = ".hw-sandbox-state"


@dataclass(frozen=True)
class NodeRecord:
    """One node replica: where its tree is mounted and its control socket."""

    root: str
    socket: str
    kubelet_dir: str | None = None  # local, native: the device plugins' kubelet dir
    status_file: str | None = None  # local: what the kubelet harness advertises
    # local: the node's processes by role (kubelet, mount, plugin), ``Proc.to_json``
    procs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def with_proc(self, what: str, proc: Mapping[str, Any]) -> NodeRecord:
        return replace(self, procs={**self.procs, what: proc})


@dataclass(frozen=True)
class SandboxRecord:
    name: str = ""
    runtime: str = ""
    profile: str = ""
    created_at: float | None = None  # local, kind (``created``)
    nodes: Mapping[str, NodeRecord] = field(default_factory=dict)
    kubeconfig: str | None = None  # kind, native
    spec: str | None = None  # local: the resolved spec every server serves
    # kind
    image: str | None = None
    bind_mount: str | None = None
    kind_cluster: str | None = None
    network: str | None = None
    transport: str | None = None  # how the CLI reaches node sockets: host | exec (kind/transport)
    # native
    cluster: str | None = None
    version: str | None = None
    bin_dir: str | None = None
    ports: Mapping[str, int] | None = None
    host_ip: str | None = None
    kubelet_root: str | None = None
    created_paths: tuple[str, ...] | None = None  # (``created``) removed by ``down``
    sysctls: Mapping[str, str | None] | None = None  # values to put back
    netns: tuple[str, ...] | None = None
    dra_driver: bool | None = None
    containerd: str | None = None
    feature_gates: Mapping[str, bool] | None = None
    dra_options: tuple[str, ...] | None = None

    def with_node(self, name: str, node: NodeRecord) -> SandboxRecord:
        return replace(self, nodes={**self.nodes, name: node})

    def node(self, name: str) -> NodeRecord | None:
        return self.nodes.get(name)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "nodes":
                value = {n: _node_json(v) for n, v in value.items()}
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[{"created_at": "created", "created_paths": "created"}.get(f.name, f.name)] = value
        return out

    @classmethod
    def from_json(cls, data: Any) -> SandboxRecord:
        """The record of a parsed ``sandbox.json``; ValueError saying what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        known = {f.name for f in fields(cls)} - {"created_at", "created_paths", "nodes"}
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        for key in ("netns", "dra_options"):
            if kwargs.get(key) is not None:
                kwargs[key] = tuple(_strings(kwargs[key], key))
        created = data.get("created")
        if isinstance(created, list):
            kwargs["created_paths"] = tuple(_strings(created, "created"))
        elif isinstance(created, int | float) and not isinstance(created, bool):
            kwargs["created_at"] = float(created)
        elif created is not None:
            raise ValueError("created: neither a time nor a list of paths")
        nodes = data.get("nodes", {})
        if not isinstance(nodes, dict):
            raise ValueError("nodes: not an object")
        kwargs["nodes"] = {str(n): _node(n, v) for n, v in nodes.items()}
        for key in ("name", "runtime", "profile"):
            if not isinstance(kwargs.get(key, ""), str):
                raise ValueError(f"{key}: not a string")
        return cls(**kwargs)


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key}: not a list of strings")
    return value


def _node(name: str, data: Any) -> NodeRecord:
    if not isinstance(data, dict) or not isinstance(data.get("root"), str) \
            or not isinstance(data.get("socket"), str):
        raise ValueError(f"nodes.{name}: needs a root and a socket")
    procs = data.get("procs", {})
    if not isinstance(procs, dict):
        raise ValueError(f"nodes.{name}.procs: not an object")
    return NodeRecord(root=data["root"], socket=data["socket"],
                      kubelet_dir=data.get("kubelet_dir"), status_file=data.get("status_file"),
                      procs=procs)


def _node_json(node: NodeRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"root": node.root, "socket": node.socket}
    if node.kubelet_dir is not None:
        out["kubelet_dir"] = node.kubelet_dir
    if node.status_file is not None:
        out["status_file"] = node.status_file
    if node.procs:
        out["procs"] = {k: dict(v) for k, v in node.procs.items()}
    return out


_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def check_name(name: str) -> str:
    """``name`` if it is a valid sandbox name (a DNS label), else SandboxError."""
    if not _NAME.fullmatch(name):
        raise SandboxError(
            f"invalid sandbox name {name!r}: use a DNS label (lowercase letters, digits and "
            "'-', starting and ending alphanumeric, at most 63 characters)")
    return name


def read_record(state_dir: Path) -> SandboxRecord | None:
    """The record in ``state_dir``; None when there is none; RecordError when there is
    one this version cannot read."""
    path = state_dir / RECORD
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RecordError(f"{path}: cannot read the sandbox record: {exc.strerror}") from exc
    try:
        return SandboxRecord.from_json(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise RecordError(f"{path}: not a sandbox record this version can read "
                          f"({exc})") from exc


def write_record(state_dir: Path, record: SandboxRecord) -> None:
    """Save the record; the first write creates the state dir and marks it as ours."""
    if not (state_dir / STATE_MARKER).is_file():
        check_name(state_dir.name)
        state_dir.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        try:
            state_dir.mkdir(mode=0o700)
        except FileExistsError:
            if state_dir.is_symlink() or not state_dir.is_dir() or any(state_dir.iterdir()):
                raise SandboxError(
                    f"{state_dir}: exists and was not made by `sandbox up`; not using it"
                ) from None
        (state_dir / STATE_MARKER).write_text("made by `sandbox up`; `sandbox down` removes "
                                              "this directory\n")
    tmp = state_dir / (RECORD + ".tmp")
    try:
        tmp.write_text(json.dumps(record.to_json(), indent=2) + "\n")
        tmp.replace(state_dir / RECORD)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: the last whole record stays
            tmp.unlink()
        raise

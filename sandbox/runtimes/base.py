"""The one small interface every runtime backend implements (like kind's Provider).

A runtime turns a resolved ``Cluster`` into running nodes whose device plugins see the
profile's hardware. Backends: ``local`` (FUSE trees + our plugins + the kubelet harness,
no Kubernetes), ``native`` (a real single-node Kubernetes built from source, run as host
processes), ``kind`` (kind clusters in Docker). Each lives in its own module; the CLI
verbs only pick one and call it.

State of one sandbox lives under ``state_dir`` (default ``/run/hw-sandbox/<name>``):
``sandbox.json`` (runtime, profile path, nodes) plus whatever the backend keeps there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sandbox.profile.resolve import Cluster

Progress = Callable[[str], None]


def default_state_root() -> Path:
    return Path(os.environ.get("HWSANDBOX_STATE_DIR", "/run/hw-sandbox"))


@dataclass
class ResourceStatus:
    """What a kubelet advertises for one extended resource on one node."""

    resource: str
    capacity: int
    allocatable: int
    by_numa: dict[int, int] = field(default_factory=dict)  # healthy devices per NUMA node


@dataclass
class DeviceStatus:
    id: str
    kind: str
    model: str
    numa_node: int
    pci_address: str
    health: str  # healthy | unhealthy | unplugged
    reason: str | None = None
    allocated_to: str | None = None


@dataclass
class NodeStatus:
    name: str
    ready: bool
    devices: list[DeviceStatus] = field(default_factory=list)
    resources: list[ResourceStatus] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class SandboxStatus:
    name: str
    runtime: str
    profile: str
    nodes: list[NodeStatus] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Runtime(Protocol):
    name: str

    def unavailable_reason(self) -> str | None:
        """None when this backend can run here, else a one-line reason with a hint."""

    def up(self, cluster: Cluster, profile_path: str, state_dir: Path, progress: Progress) -> None:
        """Create everything; on failure raise RuntimeBackendError naming the step."""

    def down(self, state_dir: Path, progress: Progress) -> None:
        """Remove everything ``up`` made (processes, mounts, device nodes, state)."""

    def status(self, state_dir: Path) -> SandboxStatus: ...

    def restart_kubelet(self, state_dir: Path, node: str) -> None: ...


def write_record(state_dir: Path, record: dict[str, Any]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = state_dir / "sandbox.json.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(state_dir / "sandbox.json")


def read_record(state_dir: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((state_dir / "sandbox.json").read_text())
    except FileNotFoundError:
        return None
    return data

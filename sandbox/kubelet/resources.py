"""What the kubelet's device manager shows: resources, their devices and health, the
allocations it made and the protocol log (``Event``). Plain frozen values, no gRPC:
``DeviceManager`` (``devicemanager``) produces them; tests and the CLI read them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_extended_resource_name(name: str) -> bool:
    """v1helper.IsExtendedResourceName: domain-prefixed, not kubernetes.io, valid as quota."""
    if "/" not in name or name.startswith("requests."):
        return False
    prefix, _, short = name.partition("/")
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        return False
    if "/" in short or not _QUALIFIED.match(short) or len(short) > 63:
        return False
    quota_prefix = "requests." + prefix
    return len(quota_prefix) <= 253 and bool(_DNS1123.match(quota_prefix))


@dataclass(frozen=True)
class Event:
    """One protocol step, as it happened; ``time`` is time.monotonic()."""

    time: float
    kind: str
    resource: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind:<22} {self.resource:<24} {self.detail}"


@dataclass(frozen=True)
class DeviceInfo:
    id: str
    health: str
    numa_nodes: tuple[int, ...]


@dataclass(frozen=True)
class ResourceState:
    """What the node status and the device manager show for one resource."""

    name: str
    endpoint: str
    connected: bool  # ListAndWatch stream open
    options: Mapping[str, bool]
    devices: tuple[DeviceInfo, ...]
    allocated: frozenset[str]

    @property
    def capacity(self) -> int:
        return len(self.devices)

    @property
    def allocatable(self) -> int:
        return sum(d.health == HEALTHY for d in self.devices)

    def by_numa(self, healthy_only: bool = False) -> dict[int | None, list[str]]:
        """Device ids per NUMA node (None: no NUMA info)."""
        out: dict[int | None, list[str]] = {}
        for d in self.devices:
            if healthy_only and d.health != HEALTHY:
                continue
            for node in d.numa_nodes or (None,):
                out.setdefault(node, []).append(d.id)
        return out


@dataclass(frozen=True)
class Snapshot:
    resources: Mapping[str, ResourceState]

    def capacity(self, resource: str) -> int:
        state = self.resources.get(resource)
        return state.capacity if state else 0

    def allocatable(self, resource: str) -> int:
        state = self.resources.get(resource)
        return state.allocatable if state else 0

    def table(self) -> str:
        lines = [f"{'resource':<28} {'capacity':>8} {'allocatable':>11}  per NUMA node"]
        for name, st in sorted(self.resources.items()):
            numa = ", ".join(
                f"{k}: {len(v)}"
                for k, v in sorted(
                    st.by_numa().items(), key=lambda kv: -1 if kv[0] is None else kv[0]
                )
            )
            lines.append(f"{name:<28} {st.capacity:>8} {st.allocatable:>11}  {numa}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Allocation:
    """One container's devices of one resource and what the plugin answered."""

    resource: str
    device_ids: tuple[str, ...]
    numa_nodes: frozenset[int]
    affinity: frozenset[int] | None  # the TopologyManager's choice; None with policy none
    envs: Mapping[str, str]
    mounts: tuple[tuple[str, str, bool], ...]  # (container_path, host_path, read_only)
    devices: tuple[tuple[str, str, str], ...]  # (container_path, host_path, permissions)
    annotations: Mapping[str, str]
    cdi_devices: tuple[str, ...]
    pre_started: bool

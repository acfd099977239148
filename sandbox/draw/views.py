"""What the picture shows of a running sandbox: how each device looks (health, holder,
pods that see it Unhealthy, SR-IOV VFs) and what each node's kubelet advertises; the
callers (``sandbox status``) fill these from live data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sandbox.profile.spec import DeviceSpec
from sandbox.textui import size


@dataclass(frozen=True)
class DeviceView:
    """How one device should look: its health, who holds it, which pods' status (the
    kubelet's allocatedResourcesStatus) reports it Unhealthy, and its SR-IOV VFs as the
    control API says (``num_vfs``/``port_vfs``: its ``DeviceState``; None: the profile's)."""

    health: str = "healthy"  # healthy | unhealthy | unplugged | unknown
    reason: str | None = None
    allocated_to: str | None = None
    pod_unhealthy: str = ""  # the pods that see it Unhealthy ("default/train, ..."), if any
    num_vfs: int | None = None
    port_vfs: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ResourceView:
    """One extended resource as the node's kubelet advertises it."""

    name: str
    capacity: int
    allocatable: int
    healthy_by_numa: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeView:
    """A running node: whether it is Ready, what its kubelet advertises, notes on what
    could not be asked."""

    ready: bool = True
    resources: tuple[ResourceView, ...] = ()
    notes: tuple[str, ...] = ()


def vf_counts(d: DeviceSpec, view: DeviceView) -> tuple[int, ...] | None:
    """VFs enabled on each physical function: the port's count, else the device's, else
    the profile's (as the fake tree builds them); None: no SR-IOV, or not there now."""
    total, enabled = ((d.nic.total_vfs, d.nic.num_vfs) if d.nic is not None
                      else (d.gpu.total_vfs, d.gpu.num_vfs) if d.gpu is not None else (0, 0))
    if not total or view.health in ("unplugged", "unknown"):
        return None
    ports = dict(view.port_vfs)
    counts = []
    for port in range(len(d.functions)):
        n = ports.get(port, view.num_vfs)
        counts.append(max(0, min(enabled if n is None else n, total)))
    return tuple(counts)


def vf_text(counts: tuple[int, ...], total: int) -> str:
    if len(set(counts)) == 1:
        return f"{counts[0]}/{total} VFs" + (" per port" if len(counts) > 1 else "")
    return "VFs per port " + ", ".join(f"{n}/{total}" for n in counts)


def device_detail(d: DeviceSpec, view: DeviceView) -> str:
    vfs = vf_counts(d, view)
    if d.gpu is not None:
        return size(d.gpu.memory) + (f", {vf_text(vfs, d.gpu.total_vfs)}" if vfs else "")
    if d.nic is not None:
        ports = f"{d.nic.ports}x{d.nic.speed // 1000}G {d.nic.link_layer}"
        return ports + (f", {vf_text(vfs, d.nic.total_vfs)}" if vfs else "")
    if d.fpga is not None:
        return f"{d.fpga.flavor}, {d.fpga.ports} port(s)"
    if d.nvme is not None:
        return f"{size(d.nvme.capacity)}, {d.nvme.namespaces} namespace(s)"
    return d.functions[0].driver or ""

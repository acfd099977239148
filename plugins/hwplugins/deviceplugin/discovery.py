"""The device model: which devices a root's sysfs and /dev describe, and how healthy they are.

Pure reads of ``<root>/sys``, ``<root>/dev`` and ``<root>/proc`` (the NVIDIA driver's
``proc/driver/nvidia/gpus/<BDF>/information``); no gRPC here. ``discover(root, rules)`` is
called again on every rescan, so a fault shows up as soon as the files say so.

Default resource names (``DEFAULT_RULES``; a config file can put its own rules first):

    vendor, PCI class           kind        resource                /dev nodes per device
    0x10de, 0x03 display        nvidia-gpu  nvidia.com/gpu          nvidiaN (+ nvidiactl, uvm)
    0x1002, 0x03 or 0x12        amd-gpu     amd.com/gpu             dri/cardN, dri/renderD*, kfd
    0x8086, 0x03 display        intel-gpu   gpu.intel.com/<driver>  dri/cardN, dri/renderD*
    any, 0x02 network + physfn  sriov-vf    sandbox.io/sriov-vf     infiniband/uverbsN, vfio/G
    any, 0x12 with DFL ports    fpga-port   sandbox.io/fpga-port    dfl-port.N (one per port)

Health, from real kernel interfaces only: a PCI ``aer_dev_fatal`` TOTAL_ERR_FATAL above 0,
a VF netdev ``operstate`` other than ``up``, an InfiniBand port ``state`` other than ACTIVE,
or a missing primary device node make a device Unhealthy. A PCI directory that vanished
removes the device. Device nodes may be real character devices or placeholder files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hwplugins.sysfs import PciFunction, SysRoot, aer_fatal_count, numa_node, read, read_int

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

KINDS = ("nvidia-gpu", "amd-gpu", "intel-gpu", "sriov-vf", "fpga-port", "generic")


@dataclass(frozen=True)
class Rule:
    """Maps PCI devices to a kind and a resource name. ``None`` / "" match anything.

    ``pci_class`` is a hex prefix of the 24-bit class code: "0x03" matches every display
    controller, "0x0302" only 3D controllers. ``resource`` may contain ``{driver}``.
    """

    kind: str
    resource: str
    vendor: int | None = None
    pci_class: str = ""
    needs_physfn: bool = False

    def matches(self, vendor: int, pci_class: int, has_physfn: bool) -> bool:
        if self.vendor is not None and vendor != self.vendor:
            return False
        if self.needs_physfn and not has_physfn:
            return False
        prefix = self.pci_class.lower().removeprefix("0x")
        return f"{pci_class:06x}".startswith(prefix)


DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("nvidia-gpu", "nvidia.com/gpu", vendor=0x10DE, pci_class="0x03"),
    Rule("amd-gpu", "amd.com/gpu", vendor=0x1002, pci_class="0x03"),
    Rule("amd-gpu", "amd.com/gpu", vendor=0x1002, pci_class="0x12"),
    Rule("intel-gpu", "gpu.intel.com/{driver}", vendor=0x8086, pci_class="0x03"),
    Rule("sriov-vf", "sandbox.io/sriov-vf", pci_class="0x02", needs_physfn=True),
    Rule("fpga-port", "sandbox.io/fpga-port", pci_class="0x12"),
)

# Env var each kind sets in Allocate, joined over the container's devices.
ENV_VARS = {
    "nvidia-gpu": "NVIDIA_VISIBLE_DEVICES",
    "amd-gpu": "AMD_VISIBLE_DEVICES",
}
# CDI "vendor/class" per kind; a device's CDI name is "<that>=<device id>".
CDI_KINDS = {
    "nvidia-gpu": "nvidia.com/gpu",
    "amd-gpu": "amd.com/gpu",
    "intel-gpu": "intel.com/gpu",
    "sriov-vf": "sandbox.io/sriov-vf",
    "fpga-port": "sandbox.io/fpga-port",
    "generic": "sandbox.io/device",
}


@dataclass(frozen=True)
class Device:
    """One allocatable unit of one extended resource."""

    id: str
    resource: str
    kind: str
    pci_address: str
    numa_node: int | None
    health: str
    reason: str = ""  # why Unhealthy; "" when Healthy
    dev_nodes: tuple[str, ...] = ()  # container paths under /dev, primary node first
    env: tuple[tuple[str, str], ...] = ()  # (name, this device's part of the value)
    cdi_name: str = ""

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY


def _health(reasons: Iterable[str]) -> tuple[str, str]:
    why = [r for r in reasons if r]
    return (UNHEALTHY, "; ".join(why)) if why else (HEALTHY, "")


def _aer_reason(pci: PciFunction) -> str:
    n = aer_fatal_count(pci.path)
    return f"aer_dev_fatal TOTAL_ERR_FATAL {n}" if n > 0 else ""


_MINOR = re.compile(r"^Device Minor:\s*(\d+)\s*$", re.M)
_UUID = re.compile(r"^GPU UUID:\s*(\S+)\s*$", re.M)


def _nvidia(r: SysRoot, pcis: Sequence[PciFunction], resource: str) -> list[Device]:
    devices = []
    for order, pci in enumerate(pcis):
        info = read(r.root / "proc" / "driver" / "nvidia" / "gpus" / pci.address / "information")
        minor_m = _MINOR.search(info or "")
        uuid_m = _UUID.search(info or "")
        minor = int(minor_m.group(1)) if minor_m else order
        dev_id = uuid_m.group(1) if uuid_m else pci.address
        primary = f"/dev/nvidia{minor}"
        shared = [
            f"/dev/{n}"
            for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
            if r.dev_exists(n)
        ]
        health, reason = _health(
            [_aer_reason(pci), "" if r.dev_exists(primary) else f"{primary} missing"]
        )
        devices.append(
            Device(
                id=dev_id,
                resource=resource,
                kind="nvidia-gpu",
                pci_address=pci.address,
                numa_node=numa_node(pci.path),
                health=health,
                reason=reason,
                dev_nodes=(primary, *shared),
                env=(("NVIDIA_VISIBLE_DEVICES", dev_id),),
                cdi_name=f"{CDI_KINDS['nvidia-gpu']}={dev_id}",
            )
        )
    return devices


def _drm_nodes(pci: PciFunction) -> tuple[str | None, str | None]:
    try:
        names = sorted(os.listdir(pci.path / "drm"))
    except OSError:
        return None, None
    card = next((n for n in names if re.fullmatch(r"card\d+", n)), None)
    render = next((n for n in names if re.fullmatch(r"renderD\d+", n)), None)
    return card, render


def _drm_gpu(r: SysRoot, pci: PciFunction, kind: str, resource: str, dev_id: str) -> Device | None:
    card, render = _drm_nodes(pci)
    if card is None:
        return None  # no DRM driver bound: nothing a container could open
    nodes = [f"/dev/dri/{card}"] + ([f"/dev/dri/{render}"] if render else [])
    if kind == "amd-gpu" and r.dev_exists("kfd"):
        nodes.append("/dev/kfd")
    health, reason = _health(
        [_aer_reason(pci), "" if r.dev_exists(nodes[0]) else f"{nodes[0]} missing"]
    )
    dev_id = dev_id or card
    env_var = ENV_VARS.get(kind)
    return Device(
        id=dev_id,
        resource=resource,
        kind=kind,
        pci_address=pci.address,
        numa_node=numa_node(pci.path),
        health=health,
        reason=reason,
        dev_nodes=tuple(nodes),
        env=((env_var, dev_id),) if env_var else (),
        cdi_name=f"{CDI_KINDS[kind]}={dev_id}",
    )


def _net_reasons(pci: PciFunction) -> list[str]:
    reasons = []
    try:
        ifaces = sorted(os.listdir(pci.path / "net"))
    except OSError:
        ifaces = []
    for iface in ifaces:
        state = read(pci.path / "net" / iface / "operstate")
        if state is not None and state != "up":
            reasons.append(f"{iface} operstate {state}")
    try:
        ibdevs = sorted(os.listdir(pci.path / "infiniband"))
    except OSError:
        ibdevs = []
    for ibdev in ibdevs:
        ports = pci.path / "infiniband" / ibdev / "ports"
        try:
            port_names = sorted(os.listdir(ports))
        except OSError:
            continue
        for port in port_names:
            state = read(ports / port / "state")
            if state is not None and "ACTIVE" not in state.upper():
                reasons.append(f"{ibdev} port {port} state {state}")
    return reasons


def _sriov_vf(r: SysRoot, pci: PciFunction, resource: str) -> Device:
    nodes = []
    try:
        verbs = sorted(os.listdir(pci.path / "infiniband_verbs"))
    except OSError:
        verbs = []
    nodes += [f"/dev/infiniband/{v}" for v in verbs]
    if verbs and r.dev_exists("infiniband/rdma_cm"):
        nodes.append("/dev/infiniband/rdma_cm")
    driver = (
        os.path.basename(os.readlink(pci.path / "driver"))
        if (os.path.islink(pci.path / "driver"))
        else ""
    )
    group_link = pci.path / "iommu_group"
    if driver == "vfio-pci" and os.path.islink(group_link):
        nodes += ["/dev/vfio/vfio", f"/dev/vfio/{os.path.basename(os.readlink(group_link))}"]
    env_name = "PCIDEVICE_" + re.sub(r"[^A-Za-z0-9]", "_", resource).upper()
    health, reason = _health([_aer_reason(pci), *_net_reasons(pci)])
    return Device(
        id=pci.address,
        resource=resource,
        kind="sriov-vf",
        pci_address=pci.address,
        numa_node=numa_node(pci.path),
        health=health,
        reason=reason,
        dev_nodes=tuple(nodes),
        env=((env_name, pci.address),),
        cdi_name=f"{CDI_KINDS['sriov-vf']}={pci.address.replace(':', '-')}",
    )


def _fpga_ports(r: SysRoot, pci: PciFunction, resource: str) -> list[Device]:
    ports = sorted(
        {
            p.name: p
            for pattern in ("dfl-port.*", "*/dfl-port.*", "*/*/dfl-port.*")
            for p in pci.path.glob(pattern)
        }.items()
    )
    devices = []
    for name, _path in ports:
        node = f"/dev/{name}"
        health, reason = _health(
            [_aer_reason(pci), "" if r.dev_exists(node) else f"{node} missing"]
        )
        devices.append(
            Device(
                id=name,
                resource=resource,
                kind="fpga-port",
                pci_address=pci.address,
                numa_node=numa_node(pci.path),
                health=health,
                reason=reason,
                dev_nodes=(node,),
                cdi_name=f"{CDI_KINDS['fpga-port']}={name}",
            )
        )
    return devices


def _generic(pci: PciFunction, resource: str) -> Device:
    health, reason = _health([_aer_reason(pci)])
    return Device(
        id=pci.address,
        resource=resource,
        kind="generic",
        pci_address=pci.address,
        numa_node=numa_node(pci.path),
        health=health,
        reason=reason,
        cdi_name=f"{CDI_KINDS['generic']}={pci.address.replace(':', '-')}",
    )


def discover(
    root: Path | str, rules: Sequence[Rule] = DEFAULT_RULES, ignore: Iterable[str] = ()
) -> list[Device]:
    """Every device under ``root`` the first matching rule claims, sorted by resource, id."""
    r = SysRoot(Path(root))
    skip = set(ignore)
    claimed: dict[tuple[str, str], list[PciFunction]] = {}
    for pci in r.pci_functions():
        if pci.address in skip:
            continue
        for rule in rules:
            if rule.matches(pci.vendor, pci.pci_class, pci.physfn):
                driver_link = pci.path / "driver"
                driver = (
                    os.path.basename(os.readlink(driver_link))
                    if os.path.islink(driver_link)
                    else "i915"
                )
                if rule.kind == "intel-gpu" and (read_int(pci.path / "sriov_numvfs") or 0) > 0:
                    break  # a PF with VFs enabled is hidden, as the Intel GPU plugin does
                if rule.kind == "fpga-port" and not _fpga_ports(r, pci, rule.resource):
                    continue  # not a DFL card: let a later rule have it
                claimed.setdefault((rule.kind, rule.resource.format(driver=driver)), []).append(pci)
                break
    devices: list[Device] = []
    for (kind, resource), pcis in claimed.items():
        if kind == "nvidia-gpu":
            devices += _nvidia(r, pcis, resource)
        elif kind in ("amd-gpu", "intel-gpu"):
            for pci in pcis:
                dev = _drm_gpu(r, pci, kind, resource, pci.address if kind == "amd-gpu" else "")
                if dev is not None:
                    devices.append(dev)
        elif kind == "sriov-vf":
            devices += [_sriov_vf(r, pci, resource) for pci in pcis]
        elif kind == "fpga-port":
            for pci in pcis:
                devices += _fpga_ports(r, pci, resource)
        else:
            devices += [_generic(pci, resource) for pci in pcis]
    return sorted(devices, key=lambda d: (d.resource, d.id))

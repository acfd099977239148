"""The device model: which GPUs, NICs and FPGAs ``<root>/sys`` and ``<root>/dev`` describe.

Pure reads below one root (``proc/driver/nvidia`` too, the NVIDIA driver's per-GPU file);
no Kubernetes, no gRPC. ``discover(root)`` runs again on every rescan, so a fault or an
unplug shows up as soon as the files say so.

    what                        how it is found                            device name
    GPU                         PCI class 0x03 (or 0x12 by AMD), vendor     gpu-<BDF>
                                NVIDIA 10de / AMD 1002 / Intel 8086
    NIC (physical function)     PCI class 0x02, no ``physfn`` link          nic-<BDF>
    NIC virtual function        PCI class 0x02 with ``physfn``              vf-<BDF>
    FPGA port / card            ``dfl-port.N`` below a PCI function, else   fpga-port-<N> /
                                any other PCI class 0x12 function           fpga-<BDF>

``<BDF>`` is the PCI address with ``:`` and ``.`` turned into ``-``: names stay stable
across unplug and rescans (an index would shift when a device leaves).

Health comes from real kernel interfaces only; each problem becomes a ``Problem`` that the
slice builder turns into a device taint:

    aer-fatal     ``aer_dev_fatal`` TOTAL_ERR_FATAL > 0                    NoExecute
    dev-missing   the device's primary /dev node is gone                   NoExecute
    link-down     a netdev's ``operstate`` is not ``up``                   NoSchedule
    port-down     an InfiniBand port ``state`` is not ACTIVE               NoSchedule
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hwplugins.sysfs import (
    PciFunction,
    SysRoot,
    aer_fatal_count,
    listdir,
    numa_node,
    read,
    read_int,
)

NO_EXECUTE = "NoExecute"
NO_SCHEDULE = "NoSchedule"

VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel", 0x15B3: "mellanox",
           0x10EE: "xilinx"}  # fmt: skip
GPU_VENDORS = (0x10DE, 0x1002, 0x8086)

AttrValue = str | int | bool


@dataclass(frozen=True)
class Problem:
    """Why a device is unhealthy: ``reason`` is a label-safe word, ``detail`` the evidence."""

    reason: str
    effect: str
    detail: str


@dataclass(frozen=True)
class Device:
    """One device as the files describe it (before partitions are derived from the config)."""

    name: str
    kind: str  # gpu | nic | vf | fpga
    pci_address: str
    vendor_id: int
    device_id: int
    numa_node: int | None
    pcie_root: str | None
    model: str = ""
    uuid: str = ""
    memory: int | None = None  # bytes; GPUs whose driver reports it in sysfs (AMD)
    bandwidth: int | None = None  # bits/s; NICs with a known link speed
    dev_nodes: tuple[str, ...] = ()  # container paths under /dev, primary first
    env: tuple[tuple[str, str], ...] = ()
    attributes: tuple[tuple[str, AttrValue], ...] = ()  # kind-specific extras
    problems: tuple[Problem, ...] = field(default=())

    @property
    def vendor(self) -> str:
        return VENDORS.get(self.vendor_id, f"{self.vendor_id:04x}")

    @property
    def pci_id(self) -> str:
        """``vendor:device`` in lower-case hex: the key of the driver config's models."""
        return f"{self.vendor_id:04x}:{self.device_id:04x}"

    @property
    def healthy(self) -> bool:
        return not self.problems


def dns_label(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def _link_name(path: Path) -> str:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return ""


def _aer(pci: PciFunction) -> list[Problem]:
    n = aer_fatal_count(pci.path)
    if n > 0:
        return [Problem("aer-fatal", NO_EXECUTE, f"aer_dev_fatal TOTAL_ERR_FATAL {n}")]
    return []


def _missing(r: SysRoot, node: str | None) -> list[Problem]:
    if node is None or r.dev_exists(node):
        return []
    return [Problem("dev-missing", NO_EXECUTE, f"{node} missing")]


def _make(r: SysRoot, pci: PciFunction, kind: str, name: str, **fields: Any) -> Device:
    return Device(name=name, kind=kind, pci_address=pci.address, vendor_id=pci.vendor,
                  device_id=pci.device, numa_node=numa_node(pci.path),
                  pcie_root=r.pcie_root(pci.address), **fields)  # fmt: skip


def _bdf(address: str) -> str:
    return dns_label(address)


_INFO = re.compile(r"^([A-Za-z ]+):\s*(.*?)\s*$", re.M)


def _gpu(r: SysRoot, pci: PciFunction) -> Device:
    name = f"gpu-{_bdf(pci.address)}"
    if pci.vendor == 0x10DE:
        text = read(r.root / "proc/driver/nvidia/gpus" / pci.address / "information") or ""
        info = {k.strip(): v for k, v in _INFO.findall(text)}
        minor = info.get("Device Minor", "")
        primary = f"/dev/nvidia{minor}" if minor.isdigit() else None
        shared = [f"/dev/{n}" for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
                  if r.dev_exists(n)]  # fmt: skip
        uuid = info.get("GPU UUID", "")
        return _make(
            r, pci, "gpu", name,
            model=info.get("Model", ""),
            uuid=uuid,
            dev_nodes=tuple(([primary] if primary else []) + shared),
            env=(("NVIDIA_VISIBLE_DEVICES", uuid or pci.address),),
            attributes=(("minor", int(minor)),) if minor.isdigit() else (),
            problems=tuple(_aer(pci) + _missing(r, primary)),
        )
    drm = listdir(pci.path / "drm")
    card = next((n for n in drm if re.fullmatch(r"card\d+", n)), None)
    render = next((n for n in drm if re.fullmatch(r"renderD\d+", n)), None)
    nodes = [f"/dev/dri/{n}" for n in (card, render) if n]
    if pci.vendor == 0x1002 and r.dev_exists("kfd"):
        nodes.append("/dev/kfd")
    env_var = "AMD_VISIBLE_DEVICES" if pci.vendor == 0x1002 else "HWSANDBOX_DRI_DEVICES"
    return _make(
        r, pci, "gpu", name,
        model=read(pci.path / "product_name") or "",
        uuid=read(pci.path / "unique_id") or "",
        memory=read_int(pci.path / "mem_info_vram_total"),
        dev_nodes=tuple(nodes),
        env=((env_var, pci.address),),
        attributes=(("driver", _link_name(pci.path / "driver")),),
        problems=tuple(_aer(pci) + _missing(r, nodes[0] if nodes else None)),
    )


def _net(r: SysRoot, pci: PciFunction, kind: str) -> Device:
    ifaces = listdir(pci.path / "net")
    problems = _aer(pci)
    speeds = []
    for iface in ifaces:
        state = read(pci.path / "net" / iface / "operstate")
        if state is not None and state != "up":
            problems.append(Problem("link-down", NO_SCHEDULE, f"{iface} operstate {state}"))
        speed = read_int(pci.path / "net" / iface / "speed")
        if speed is not None and speed > 0:
            speeds.append(speed * 1_000_000)
    ibdevs = listdir(pci.path / "infiniband")
    for ibdev in ibdevs:
        ports = pci.path / "infiniband" / ibdev / "ports"
        for port in listdir(ports):
            state = read(ports / port / "state") or ""
            if "ACTIVE" not in state.upper():
                problems.append(
                    Problem("port-down", NO_SCHEDULE, f"{ibdev} port {port} state {state}")
                )
            rate = re.match(r"(\d+) Gb/sec", read(ports / port / "rate") or "")
            if rate and not ifaces:
                speeds.append(int(rate.group(1)) * 1_000_000_000)
    nodes = [f"/dev/infiniband/{v}" for v in listdir(pci.path / "infiniband_verbs")]
    nodes += [f"/dev/infiniband/{m}" for m in listdir(pci.path / "infiniband_mad")]
    if nodes and r.dev_exists("infiniband/rdma_cm"):
        nodes.append("/dev/infiniband/rdma_cm")
    driver = _link_name(pci.path / "driver")
    group = _link_name(pci.path / "iommu_group")
    if driver == "vfio-pci" and group:
        nodes += ["/dev/vfio/vfio", f"/dev/vfio/{group}"]
    attrs: list[tuple[str, AttrValue]] = [("rdma", bool(ibdevs)), ("driver", driver)]
    if ifaces:
        attrs.append(("interface", ifaces[0]))
    if ibdevs:
        attrs.append(("rdmaDevice", ibdevs[0]))
        layer = read(pci.path / "infiniband" / ibdevs[0] / "ports" / "1" / "link_layer")
        attrs.append(("linkLayer", (layer or "Ethernet").lower()))
    if kind == "vf":
        parent = _link_name(pci.path / "physfn")
        attrs.append(("physfn", parent))
    else:
        attrs.append(("sriovTotalVFs", read_int(pci.path / "sriov_totalvfs") or 0))
    prefix = "nic" if kind == "nic" else "vf"
    return _make(
        r, pci, kind, f"{prefix}-{_bdf(pci.address)}",
        model="",
        bandwidth=max(speeds) if speeds else None,
        dev_nodes=tuple(nodes),
        env=(("HWSANDBOX_NETDEV", ifaces[0] if ifaces else pci.address),),
        attributes=tuple(attrs),
        problems=tuple(problems),
    )


def _dfl_ports(pci: PciFunction) -> list[Path]:
    found = {p.name: p for pattern in ("dfl-port.*", "*/dfl-port.*", "*/*/dfl-port.*")
             for p in pci.path.glob(pattern)}  # fmt: skip
    return [found[k] for k in sorted(found)]


def _fpgas(r: SysRoot, pci: PciFunction) -> list[Device]:
    ports = _dfl_ports(pci)
    if not ports:
        return [_make(r, pci, "fpga", f"fpga-{_bdf(pci.address)}",
                      attributes=(("driver", _link_name(pci.path / "driver")),),
                      problems=tuple(_aer(pci)))]  # fmt: skip
    devices = []
    for port in ports:
        node = f"/dev/{port.name}"
        afu = read(port / "afu_id") or ""
        devices.append(_make(
            r, pci, "fpga", f"fpga-{dns_label(port.name)}",
            dev_nodes=(node,),
            env=(("HWSANDBOX_FPGA_PORT", port.name),),
            attributes=(("port", port.name), ("afuID", afu),
                        ("driver", _link_name(pci.path / "driver"))),
            problems=tuple(_aer(pci) + _missing(r, node)),
        ))  # fmt: skip
    return devices


def discover(root: Path | str, ignore: Sequence[str] = ()) -> list[Device]:
    """Every GPU, NIC and FPGA below ``root``, sorted by name."""
    r = SysRoot(Path(root))
    skip = set(ignore)
    devices: list[Device] = []
    for pci in r.pci_functions():
        if pci.address in skip:
            continue
        top = pci.pci_class >> 16
        if pci.vendor in GPU_VENDORS and (top == 0x03 or (top == 0x12 and pci.vendor == 0x1002)):
            devices.append(_gpu(r, pci))
        elif top == 0x02:
            devices.append(_net(r, pci, "vf" if pci.physfn else "nic"))
        elif top == 0x12:
            devices += _fpgas(r, pci)
    return sorted(devices, key=lambda d: d.name)

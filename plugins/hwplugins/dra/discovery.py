"""The DRA driver's devices: the device model (``hwplugins.devices``) named and described
for ResourceSlices. Nothing here reads a file: ``discover(root)`` scans once and maps;
``from_scan(devices)`` only maps. It runs again on every rescan, so a fault or an unplug
shows up as soon as the files say so.

    what                        how it is found                            device name
    GPU                         PCI class 0x03 (or 0x12 by AMD), vendor     gpu-<BDF>
                                NVIDIA 10de / AMD 1002 / Intel 8086
    NIC (physical function)     PCI class 0x02, no ``physfn`` link          nic-<BDF>
    NIC virtual function        PCI class 0x02 with ``physfn``              vf-<BDF>
    FPGA port / card            ``dfl-port.N`` below a PCI function, else   fpga-port-<N> /
                                any other PCI class 0x12 function           fpga-<BDF>

``<BDF>`` is the PCI address with ``:`` and ``.`` turned into ``-``: names stay stable
across unplug and rescans (an index would shift when a device leaves).

A device's health is the model's (``hwplugins.devices.device_health``); each of its
symptoms (real kernel interfaces only) is a ``Problem`` that the slice builder turns into a
device taint:

    aer-fatal     ``aer_dev_fatal`` TOTAL_ERR_FATAL > 0                    NoExecute
    dev-missing   the device's primary /dev node is gone                   NoExecute
    link-down     a netdev's ``operstate`` is not ``up``                   NoSchedule
    port-down     an InfiniBand port ``state`` is not ACTIVE               NoSchedule
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hwplugins.devices import AMD, NVIDIA, Health, PciDevice, device_health, scan

NO_EXECUTE = "NoExecute"
NO_SCHEDULE = "NoSchedule"

VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel", 0x15B3: "mellanox",
           0x10EE: "xilinx"}  # fmt: skip

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
    health: Health = Health()

    @property
    def vendor(self) -> str:
        return VENDORS.get(self.vendor_id, f"{self.vendor_id:04x}")

    @property
    def pci_id(self) -> str:
        """``vendor:device`` in lower-case hex: the key of the driver config's models."""
        return f"{self.vendor_id:04x}:{self.device_id:04x}"

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def problems(self) -> tuple[Problem, ...]:
        """Each symptom with the taint effect it calls for."""
        return tuple(Problem(s.reason, EFFECTS[s.reason], s.detail) for s in self.health.symptoms)


def dns_label(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


EFFECTS = {"aer-fatal": NO_EXECUTE, "dev-missing": NO_EXECUTE, "link-down": NO_SCHEDULE,
           "port-down": NO_SCHEDULE}  # fmt: skip


def _make(pci: PciDevice, kind: str, name: str, **fields: Any) -> Device:
    return Device(name=name, kind=kind, pci_address=pci.address, vendor_id=pci.vendor,
                  device_id=pci.device, numa_node=pci.numa_node, pcie_root=pci.pcie_root,
                  **fields)  # fmt: skip


def _bdf(address: str) -> str:
    return dns_label(address)


def _gpu(pci: PciDevice) -> Device:
    name = f"gpu-{_bdf(pci.address)}"
    if pci.vendor == NVIDIA:
        info = pci.nvidia
        uuid = info.uuid if info is not None else ""
        return _make(
            pci, "gpu", name,
            model=info.model if info is not None else "",
            uuid=uuid,
            dev_nodes=pci.dev_nodes,
            env=(("NVIDIA_VISIBLE_DEVICES", uuid or pci.address),),
            attributes=(("minor", info.minor),) if info and info.minor is not None else (),
            health=device_health(pci),
        )  # fmt: skip
    env_var = "AMD_VISIBLE_DEVICES" if pci.vendor == AMD else "HWSANDBOX_DRI_DEVICES"
    return _make(
        pci, "gpu", name,
        model=pci.product_name,
        uuid=pci.unique_id,
        memory=pci.vram_total,
        dev_nodes=pci.dev_nodes,
        env=((env_var, pci.address),),
        attributes=(("driver", pci.driver),),
        health=device_health(pci),
    )  # fmt: skip


def _net(pci: PciDevice) -> Device:
    speeds = [i.speed * 1_000_000 for i in pci.net if i.speed is not None and i.speed > 0]
    if not pci.net:
        for port in pci.ib_ports:
            rate = re.match(r"(\d+) Gb/sec", port.rate or "")
            if rate:
                speeds.append(int(rate.group(1)) * 1_000_000_000)
    attrs: list[tuple[str, AttrValue]] = [("rdma", bool(pci.ib_devices)), ("driver", pci.driver)]
    if pci.net:
        attrs.append(("interface", pci.net[0].name))
    if pci.ib_devices:
        attrs.append(("rdmaDevice", pci.ib_devices[0]))
        layer = next((p.link_layer for p in pci.ib_ports
                      if p.device == pci.ib_devices[0] and p.port == "1"), None)  # fmt: skip
        attrs.append(("linkLayer", (layer or "Ethernet").lower()))
    if pci.family == "vf":
        attrs.append(("physfn", pci.physfn))
    else:
        attrs.append(("sriovTotalVFs", pci.sriov_totalvfs or 0))
    prefix = "nic" if pci.family == "nic" else "vf"
    return _make(
        pci, pci.family, f"{prefix}-{_bdf(pci.address)}",
        model="",
        bandwidth=max(speeds) if speeds else None,
        dev_nodes=pci.dev_nodes,
        env=(("HWSANDBOX_NETDEV", pci.net[0].name if pci.net else pci.address),),
        attributes=tuple(attrs),
        health=device_health(pci),
    )  # fmt: skip


def _fpgas(pci: PciDevice) -> list[Device]:
    if not pci.dfl_ports:
        return [_make(pci, "fpga", f"fpga-{_bdf(pci.address)}",
                      attributes=(("driver", pci.driver),),
                      health=device_health(pci))]  # fmt: skip
    devices = []
    for port in pci.dfl_ports:
        node = f"/dev/{port.name}"
        devices.append(_make(
            pci, "fpga", f"fpga-{dns_label(port.name)}",
            dev_nodes=(node,),
            env=(("HWSANDBOX_FPGA_PORT", port.name),),
            attributes=(("port", port.name), ("afuID", port.afu_id), ("driver", pci.driver)),
            health=device_health(pci, port),
        ))  # fmt: skip
    return devices


def from_scan(devices: Iterable[PciDevice]) -> list[Device]:
    """Every GPU, NIC and FPGA of a scan as the driver describes it, sorted by name."""
    out: list[Device] = []
    for pci in devices:
        if pci.family == "gpu":
            out.append(_gpu(pci))
        elif pci.family in ("nic", "vf"):
            out.append(_net(pci))
        elif pci.family == "fpga":
            out += _fpgas(pci)
    return sorted(out, key=lambda d: d.name)


def discover(root: Path | str, ignore: Sequence[str] = ()) -> list[Device]:
    """Every GPU, NIC and FPGA below ``root``, sorted by name."""
    return from_scan(scan(root, ignore))

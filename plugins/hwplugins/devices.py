"""The one device model: what a root's ``sys/``, ``dev/`` and ``proc/`` say about each device.

``scan(root)`` reads the tree once (through ``hwplugins.sysfs``) into typed, immutable
``PciDevice`` records; the device plugin groups them into extended resources, the DRA
driver into ResourceSlices, and neither reads a file itself, so the two cannot disagree
about a device's nodes or health. Equal scans compare equal, which is how a rescan tells
"nothing changed".

What is read, by the function's family (``family``, from vendor and PCI class):

    family   vendor, class                   facts read beyond ids, NUMA node, driver, AER
    gpu      NVIDIA/AMD/Intel 0x03, AMD 0x12 NVIDIA: proc/driver/nvidia/gpus/<BDF>/information
                                             others: drm/card*, drm/renderD*, product_name,
                                             unique_id, mem_info_vram_total, sriov_numvfs
    nic, vf  any 0x02 (vf: has ``physfn``)   net/*/{operstate,speed}, infiniband/*/ports/*,
                                             infiniband_verbs, infiniband_mad, iommu_group,
                                             sriov_totalvfs
    fpga     any other 0x12                  dfl-port.N up to two directories down, afu_id
    bridge   any 0x06                        nothing else (not even NUMA node, driver, AER):
                                             a big node has one per device, none is offered
    other    anything else                   nothing more

Device nodes (``dev_nodes``, container paths, the device's own first, then the shared ones
that exist): NVIDIA ``nvidiaN`` + ``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools``,
``nvidia-modeset``; DRM ``dri/cardN``, ``dri/renderDN`` (+ ``kfd`` for AMD); RDMA
``infiniband/uverbsN``, ``umadN`` (+ ``rdma_cm``); ``vfio/vfio`` + ``vfio/<group>`` when
bound to vfio-pci; FPGA ``dfl-portN``, one per port. Existence is answered from one listing
of ``dev/`` and of ``dev/{dri,infiniband,vfio}``.

Health (``symptoms``) comes from real kernel interfaces only:

    aer-fatal     ``aer_dev_fatal`` TOTAL_ERR_FATAL > 0
    dev-missing   the device's own primary /dev node is gone
    link-down     a netdev's ``operstate`` is not ``up``
    port-down     an InfiniBand port ``state`` is not ACTIVE

``device_health(device)`` (``device_health(card, port)`` for an FPGA port) is the one
derivation of what the two programs report: the device plugin's Healthy/Unhealthy and its
logged evidence, the DRA driver's taints and its health stream's message.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Container, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from hwplugins.sysfs import (
    PciFunction,
    SysRoot,
    aer_fatal_count,
    entries,
    link_name,
    listdir,
    numa_node,
    read,
    read_int,
)

NVIDIA, AMD, INTEL = 0x10DE, 0x1002, 0x8086
GPU_VENDORS = (NVIDIA, AMD, INTEL)
NVIDIA_SHARED = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
_DEV_SUBDIRS = ("dri", "infiniband", "vfio")
READERS = 8  # threads reading PCI functions in a big scan
PARALLEL_FROM = 64  # functions never read before from which a scan uses them


@dataclass(frozen=True)
class Symptom:
    """Why a device is unhealthy: ``reason`` a label-safe word, ``detail`` the evidence."""

    reason: str  # aer-fatal | dev-missing | link-down | port-down
    detail: str


@dataclass(frozen=True)
class NvidiaInfo:
    """The NVIDIA driver's ``information`` file (absent when the driver is not bound)."""

    minor: int | None
    uuid: str
    model: str


@dataclass(frozen=True)
class NetIface:
    name: str
    operstate: str | None
    speed: int | None  # Mb/s as ``speed`` says; None when unknown


@dataclass(frozen=True)
class IbPort:
    device: str  # the RDMA device, mlx5_0
    port: str
    state: str | None  # "4: ACTIVE"
    rate: str | None  # "400 Gb/sec (4X NDR)"
    link_layer: str | None  # InfiniBand | Ethernet


@dataclass(frozen=True)
class DflPort:
    name: str  # dfl-port.N, also its /dev node
    afu_id: str
    present: bool  # /dev/dfl-port.N exists


@dataclass(frozen=True)
class PciDevice:
    """One PCI function and everything a plugin needs to know about it."""

    address: str
    vendor: int
    device: int
    pci_class: int
    family: str  # gpu | nic | vf | fpga | bridge | other
    numa_node: int | None
    pcie_root: str | None
    driver: str  # the bound driver's name; "" when none
    aer_fatal: int
    physfn: str = ""  # a VF's physical function (its address)
    nvidia: NvidiaInfo | None = None
    drm_card: str | None = None
    drm_render: str | None = None
    product_name: str = ""
    unique_id: str = ""
    vram_total: int | None = None  # bytes (AMD's mem_info_vram_total)
    sriov_numvfs: int | None = None
    sriov_totalvfs: int | None = None
    net: tuple[NetIface, ...] = ()
    ib_ports: tuple[IbPort, ...] = ()
    ib_devices: tuple[str, ...] = ()
    iommu_group: str = ""
    dfl_ports: tuple[DflPort, ...] = ()
    dev_nodes: tuple[str, ...] = ()  # container paths, own nodes first (FPGA: per port)
    symptoms: tuple[Symptom, ...] = ()  # for an FPGA with ports: the card's only

    @property
    def healthy(self) -> bool:
        return not self.symptoms

    @property
    def primary_node(self) -> str | None:
        """The node that IS the device (nvidiaN, dri/cardN...); None when it has none."""
        if self.vendor == NVIDIA and self.family == "gpu":
            minor = self.nvidia.minor if self.nvidia is not None else None
            return f"/dev/nvidia{minor}" if minor is not None else None
        if self.drm_card is not None or self.drm_render is not None:
            return self.dev_nodes[0]
        return None


def family_of(vendor: int, pci_class: int, is_vf: bool) -> str:
    top = pci_class >> 16
    if vendor in GPU_VENDORS and (top == 0x03 or (top == 0x12 and vendor == AMD)):
        return "gpu"
    if top == 0x02:
        return "vf" if is_vf else "nic"
    if top == 0x06:
        return "bridge"
    return "fpga" if top == 0x12 else "other"


def aer_symptoms(count: int) -> list[Symptom]:
    return [Symptom("aer-fatal", f"aer_dev_fatal TOTAL_ERR_FATAL {count}")] if count > 0 else []


def missing(node: str, present: Container[str]) -> list[Symptom]:
    return [] if node in present else [Symptom("dev-missing", f"{node} missing")]


@dataclass(frozen=True)
class Health:
    """A device's health from its symptoms, in the forms the two programs report it."""

    symptoms: tuple[Symptom, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.symptoms

    @property
    def evidence(self) -> str:
        """Each symptom's evidence, ``; ``-joined (the device plugin logs it); "" if healthy."""
        return "; ".join(s.detail for s in self.symptoms)

    @property
    def message(self) -> str:
        """Each symptom as ``reason: evidence``, ``; ``-joined (the DRA driver's health
        stream: the kubelet shows it in pod status); "" if healthy."""
        return "; ".join(f"{s.reason}: {s.detail}" for s in self.symptoms)

    def plus(self, symptoms: Iterable[Symptom]) -> Health:
        return Health((*self.symptoms, *symptoms))


def device_health(device: PciDevice, port: DflPort | None = None) -> Health:
    """The device's health; an FPGA ``port``'s is its card's and its own /dev node's."""
    if port is None:
        return Health(device.symptoms)
    node = f"/dev/{port.name}"
    return Health(device.symptoms).plus(missing(node, (node,) if port.present else ()))


class _Scanner:
    def __init__(self, root: SysRoot) -> None:
        self.r = root
        self.dev = root.dev_names()
        for sub in _DEV_SUBDIRS:
            if f"/dev/{sub}" in self.dev:
                self.dev |= root.dev_names(sub)

    def device(self, pci: PciFunction) -> PciDevice:
        family = family_of(pci.vendor, pci.pci_class, pci.physfn)
        if family == "bridge":  # as many as the devices behind them, and nothing to offer
            return PciDevice(pci.address, pci.vendor, pci.device, pci.pci_class, family,
                             None, None, "", 0)  # fmt: skip
        base = PciDevice(
            address=pci.address, vendor=pci.vendor, device=pci.device,
            pci_class=pci.pci_class, family=family, numa_node=numa_node(pci.path),
            pcie_root=self.r.pcie_root(pci.address), driver=link_name(f"{pci.path}/driver"),
            aer_fatal=aer_fatal_count(pci.path),
        )  # fmt: skip
        if family == "gpu" and pci.vendor == NVIDIA:
            return self._nvidia(base)
        if family == "gpu" or pci.pci_class >> 16 == 0x03:  # any display controller
            return self._drm(base, pci.path)
        if family in ("nic", "vf"):
            return self._net(base, pci.path)
        if family == "fpga":
            return self._fpga(base, pci.path)
        return replace(base, symptoms=tuple(aer_symptoms(base.aer_fatal)))

    def _shared(self, names: Iterable[str]) -> list[str]:
        return [f"/dev/{n}" for n in names if f"/dev/{n}" in self.dev]

    def _nvidia(self, d: PciDevice) -> PciDevice:
        text = read(self.r.path(f"proc/driver/nvidia/gpus/{d.address}/information"))
        info = None
        nodes = self._shared(NVIDIA_SHARED)
        symptoms = aer_symptoms(d.aer_fatal)
        if text is not None:
            fields = {k.strip(): v for k, v in _INFO.findall(text)}
            minor = fields.get("Device Minor", "")
            info = NvidiaInfo(int(minor) if minor.isdigit() else None,
                              fields.get("GPU UUID", ""), fields.get("Model", ""))  # fmt: skip
            if info.minor is not None:
                primary = f"/dev/nvidia{info.minor}"
                nodes.insert(0, primary)
                symptoms += missing(primary, self.dev)
        return replace(d, nvidia=info, dev_nodes=tuple(nodes), symptoms=tuple(symptoms))

    def _drm(self, d: PciDevice, path: str) -> PciDevice:
        drm = listdir(f"{path}/drm")
        card = next((n for n in drm if re.fullmatch(r"card\d+", n)), None)
        render = next((n for n in drm if re.fullmatch(r"renderD\d+", n)), None)
        nodes = [f"/dev/dri/{n}" for n in (card, render) if n]
        if d.vendor == AMD:
            nodes += self._shared(["kfd"])
        symptoms = aer_symptoms(d.aer_fatal) + (missing(nodes[0], self.dev) if nodes else [])
        return replace(
            d, drm_card=card, drm_render=render,
            product_name=read(f"{path}/product_name") or "",
            unique_id=read(f"{path}/unique_id") or "",
            vram_total=read_int(f"{path}/mem_info_vram_total"),
            sriov_numvfs=read_int(f"{path}/sriov_numvfs"),
            dev_nodes=tuple(nodes), symptoms=tuple(symptoms),
        )  # fmt: skip

    def _net(self, d: PciDevice, path: str) -> PciDevice:
        symptoms = aer_symptoms(d.aer_fatal)
        ifaces = []
        for name in listdir(f"{path}/net"):
            iface = NetIface(name, read(f"{path}/net/{name}/operstate"),
                             read_int(f"{path}/net/{name}/speed"))  # fmt: skip
            if iface.operstate is not None and iface.operstate != "up":
                symptoms.append(Symptom("link-down", f"{name} operstate {iface.operstate}"))
            ifaces.append(iface)
        ib_devices = listdir(f"{path}/infiniband")
        ports = []
        for ibdev in ib_devices:
            base = f"{path}/infiniband/{ibdev}/ports"
            for port in listdir(base):
                p = IbPort(ibdev, port, read(f"{base}/{port}/state"),
                           read(f"{base}/{port}/rate"), read(f"{base}/{port}/link_layer"))
                if p.state is not None and "ACTIVE" not in p.state.upper():
                    symptoms.append(Symptom("port-down", f"{ibdev} port {port} state {p.state}"))
                ports.append(p)
        nodes = [f"/dev/infiniband/{v}" for v in listdir(f"{path}/infiniband_verbs")]
        nodes += [f"/dev/infiniband/{m}" for m in listdir(f"{path}/infiniband_mad")]
        if nodes:
            nodes += self._shared(["infiniband/rdma_cm"])
        group = link_name(f"{path}/iommu_group")
        if d.driver == "vfio-pci" and group:
            nodes += ["/dev/vfio/vfio", f"/dev/vfio/{group}"]
        return replace(
            d, physfn=link_name(f"{path}/physfn") if d.family == "vf" else "",
            sriov_totalvfs=read_int(f"{path}/sriov_totalvfs") if d.family == "nic" else None,
            net=tuple(ifaces), ib_ports=tuple(ports), ib_devices=tuple(ib_devices),
            iommu_group=group, dev_nodes=tuple(nodes), symptoms=tuple(symptoms),
        )  # fmt: skip

    def _fpga(self, d: PciDevice, path: str) -> PciDevice:
        found: dict[str, str] = {}  # dfl-port.N -> its directory, the nearest one
        level = [path]
        for depth in range(3):  # the function's directory and two levels below it
            below = []
            for where in level:
                names, dirs = entries(where)
                for name in names:
                    if name.startswith("dfl-port.") and name not in found:
                        found[name] = f"{where}/{name}"
                below += [f"{where}/{n}" for n in dirs] if depth < 2 else []
            level = below
        ports = tuple(DflPort(name, read(f"{found[name]}/afu_id") or "",
                              f"/dev/{name}" in self.dev)
                      for name in sorted(found))  # fmt: skip
        return replace(d, dfl_ports=ports, symptoms=tuple(aer_symptoms(d.aer_fatal)))


_INFO = re.compile(r"^([A-Za-z ]+):\s*(.*?)\s*$", re.M)


class Scanner:
    """Scans one root again and again. ``scan()`` reads every function; ``scan(dirty)``
    re-reads only the functions named in ``dirty`` (their VFs too) and those that appeared
    since the last scan, drops those that left the bus, and keeps the other records: for a
    caller told what changed (``hwplugins.watch``), a fault costs one device, not the tree.
    The PCI and /dev listings are read every time. When ``PARALLEL_FROM`` or more of the
    functions to read were never read before (a first scan of a big node), ``readers``
    threads read them, with the same result as one: on a FUSE tree each cold read is a
    round trip to the server, and overlapping them halved a first scan of 1,000 GPUs
    (2.3-2.5 s -> 1.25-1.5 s with 4; server CPU 1.6 -> 1.0 s). Our server takes queued
    requests without waiting (pyfuse3 patch level 2), so more of them queued costs it
    less: there 8 readers scan in 0.54-0.70 s (server CPU 0.47-0.62 s), 4 in 0.77-0.87 s,
    1 in 2.7 s. Rescans of functions read before
    stay with one: their reads come from the kernel's caches, and threads only fight over
    the GIL there (a full rescan of 1,000 GPUs every second: 14 % -> 46 % of a core)."""

    def __init__(self, root: str | os.PathLike[str], ignore: Iterable[str] = (),
                 readers: int = READERS) -> None:  # fmt: skip
        self.root = SysRoot(root)
        self.ignore = frozenset(ignore)
        self.readers = readers
        self._last: dict[str, PciDevice] = {}

    def scan(self, dirty: Collection[str] | None = None) -> list[PciDevice]:
        reader = _Scanner(self.root)
        addresses = self.root.pci_addresses()
        stale = None
        if dirty is not None:
            # A card is every function of its slot (a 2-port NIC is 0000:01:00.0 and .1),
            # and a PF's change (VF count, link, AER) reaches its VFs' files.
            slots = {_slot(a) for a in dirty}
            stale = {a for a in (*addresses, *self._last) if _slot(a) in slots}
            stale |= {a for a, d in self._last.items() if d.physfn and d.physfn in stale}
        out: dict[str, PciDevice | None] = {}
        todo = []
        for address in addresses:
            if address in self.ignore:
                continue
            if stale is not None and address not in stale and address in self._last:
                out[address] = self._last[address]
            else:
                out[address] = None  # keeps the listing's order
                todo.append(address)

        def read(address: str) -> PciDevice | None:
            pci = self.root.pci_function(address)
            return reader.device(pci) if pci is not None else None

        fresh = sum(a not in self._last for a in todo)  # never read: cold on a FUSE tree
        if self.readers < 2 or fresh < PARALLEL_FROM:
            found = [read(a) for a in todo]
        else:
            with ThreadPoolExecutor(self.readers, thread_name_prefix="scan") as pool:
                found = list(pool.map(read, todo))
        out.update(zip(todo, found, strict=True))
        self._last = {a: d for a, d in out.items() if d is not None}
        return list(self._last.values())


def _slot(address: str) -> str:
    return address.rpartition(".")[0] or address


def scan(root: str | os.PathLike[str], ignore: Iterable[str] = (),
         readers: int = READERS) -> list[PciDevice]:  # fmt: skip
    """Every PCI function with readable ids below ``root``, sorted by address."""
    return Scanner(root, ignore, readers).scan()

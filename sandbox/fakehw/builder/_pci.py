"""PCI: every function's directory under ``sys/devices/pciDDDD:BB/...`` nested by its
parent bridges, ``sys/bus/pci/{devices,drivers}``, ``sys/module/<mod>/drivers``,
``sys/kernel/iommu_groups`` and SR-IOV virtual functions (Documentation/ABI/testing/
sysfs-bus-pci, sysfs-kernel-iommu_groups, sysfs-bus-pci-devices-aer_stats).

The resolver planned the node's whole PCI tree once (``NodeSpec.pci``: every bridge,
physical function and POSSIBLE virtual function with its directory, bus ranges and port
type), independent of the devices' runtime states, so a bridge's config space never
changes when a device below it is unplugged or VFs are toggled. ``plan_pci`` only indexes
it; ``add_pci`` writes what is present.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sandbox.fakehw.builder._common import RW, WO, Ctx, make_file, present
from sandbox.fakehw.tree import SIGNS, DeviceState, File, Health
from sandbox.profile.spec import DeviceSpec, NodeSpec, PciFunction

DEVICES = "sys/bus/pci/devices"
DRIVERS = "sys/bus/pci/drivers"
GROUPS = "sys/kernel/iommu_groups"
BRIDGE_CLASS = 0x060400
HOST_BRIDGE_CLASS = 0x060000  # the root complex's 0000:00:00.0: no BAR, no driver

# Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats; names and order from
# drivers/pci/pcie/aer.c (aer_correctable_error_string / aer_uncorrectable_error_string).
AER_CORRECTABLE = (
    "RxErr",
    "BadTLP",
    "BadDLLP",
    "Rollover",
    "Timeout",
    "NonFatalErr",
    "CorrIntErr",
    "HeaderOF",
)
AER_UNCORRECTABLE = (
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
)

_SPEED_CODE = {
    "2.5 GT/s PCIe": 1,
    "5.0 GT/s PCIe": 2,
    "8.0 GT/s PCIe": 3,
    "16.0 GT/s PCIe": 4,
    "32.0 GT/s PCIe": 5,
    "64.0 GT/s PCIe": 6,
}
# Drivers built into Debian's kernel: no sys/module/<mod>/drivers entry is needed.
BUILTIN_DRIVERS = frozenset({"pcieport"})


def _aer(names: tuple[str, ...], total: str, counts: dict[str, int]) -> str:
    lines = [f"{n} {counts.get(n, 0)}\n" for n in names]
    lines.append(f"TOTAL_{total} {sum(counts.values())}\n")
    return "".join(lines)


AER_COR_CLEAN = _aer(AER_CORRECTABLE, "ERR_COR", {})
AER_NONFATAL_CLEAN = _aer(AER_UNCORRECTABLE, "ERR_NONFATAL", {})
AER_FATAL_CLEAN = _aer(AER_UNCORRECTABLE, "ERR_FATAL", {})
# aer_dev_fatal under each reason's error (tree.SIGNS): aer-fatal and a GPU's ECC reasons
# count an uncorrectable internal error; a surprise link down (link-down on a non-network
# device) is reported as SDES, "Surprise Down Error".
AER_FATAL_OF = {name: _aer(AER_UNCORRECTABLE, "ERR_FATAL", {name: 1})
                for name in sorted({s.aer_fatal for s in SIGNS.values() if s.aer_fatal})}


def module_of(driver: str) -> str:
    return driver.replace("-", "_")


@dataclass
class PciPlan:
    """Lookups over the node's planned PCI tree (``NodeSpec.pci``), made once per node."""

    functions: tuple[PciFunction, ...] = ()  # every function the node can show, by address
    ordinal: dict[str, int] = field(default_factory=dict)  # address -> index in functions
    pf_vfs: dict[str, list[str]] = field(default_factory=dict)  # PF -> all its VF addresses
    drivers: set[str] = field(default_factory=set)
    by_owner: dict[str, list[PciFunction]] = field(default_factory=dict)  # device -> its own
    groups: dict[int, list[PciFunction]] = field(default_factory=dict)  # IOMMU group -> all


@dataclass(frozen=True)
class VfInfo:
    """A device's SR-IOV layout: per physical function, every possible VF."""

    total: int  # sriov_totalvfs of each PF
    enabled: int  # the profile's numVFs


def vf_info(dev: DeviceSpec) -> VfInfo | None:
    if dev.nic is not None and dev.nic.total_vfs:
        return VfInfo(dev.nic.total_vfs, dev.nic.num_vfs)
    if dev.gpu is not None and dev.gpu.total_vfs:
        return VfInfo(dev.gpu.total_vfs, dev.gpu.num_vfs)
    return None


def plan_pci(node: NodeSpec) -> PciPlan:
    """Index the node's PCI tree (the resolver planned it: ``sandbox.profile.resolve``)."""
    plan = PciPlan(node.pci)
    for i, f in enumerate(node.pci):
        plan.ordinal[f.address] = i
        if f.driver:
            plan.drivers.add(f.driver)
        if f.physfn is not None:
            plan.pf_vfs.setdefault(f.physfn, []).append(f.address)
        if f.owner is not None:
            plan.by_owner.setdefault(f.owner, []).append(f)
        plan.groups.setdefault(f.iommu_group, []).append(f)
    return plan


def present_functions(
    functions: Iterable[PciFunction],
    states: Mapping[str, DeviceState],
    vf_counts: Mapping[str, int],
) -> dict[str, str]:
    """Address -> directory of those of ``functions`` the tree shows (as ``add_pci``
    decides it: the owner is present, a VF is below its PF's count)."""
    out: dict[str, str] = {}
    for f in functions:
        owner = f.owner
        if owner is not None and not present(states[owner]):
            continue
        pf = f.physfn
        if pf is not None and f.vf_index >= vf_counts.get(pf, 0):
            continue
        out[f.address] = f.path
    return out


def _config(f: PciFunction, bar: int, irq: int) -> bytes:
    """256 bytes of config space: header, BAR0 and a PCI Express capability at 0x40."""
    c = bytearray(256)
    bridge = f.class_code == BRIDGE_CLASS
    host = f.class_code == HOST_BRIDGE_CLASS
    struct.pack_into(
        "<HHHH", c, 0, f.vendor_id, f.device_id, 0x0406 if not bridge else 0x0407, 0x0010
    )
    struct.pack_into("<I", c, 8, f.revision | (f.class_code << 8))
    header = 1 if bridge else 0
    if f.multifunction:
        header |= 0x80
    c[0x0C], c[0x0E] = 0x10, header
    c[0x34] = 0x40
    c[0x3C], c[0x3D] = irq & 0xFF, 1
    if bridge:
        c[0x18], c[0x19], c[0x1A] = f.bus, f.secondary_bus, f.subordinate_bus
        c[0x1C], c[0x1D] = 0xF0, 0x00  # I/O window disabled
        port_type = f.port_type
    else:
        if not host:
            struct.pack_into("<II", c, 0x10, (bar & 0xFFFFFFF0) | 0x4, bar >> 32)
        struct.pack_into("<HH", c, 0x2C, f.subsystem_vendor_id, f.subsystem_device_id)
        port_type = 0
    speed = _SPEED_CODE.get(f.link_speed, 4)
    width = f.link_width
    c[0x40], c[0x41] = 0x10, 0x00  # PCI Express capability, last in the list
    struct.pack_into(
        "<H", c, 0x42, 0x0002 | (port_type << 4) | (0x100 if port_type in (4, 6) else 0)
    )
    struct.pack_into("<I", c, 0x44, 0x00008001)  # devcap: 256-byte max payload
    struct.pack_into("<I", c, 0x4C, speed | (width << 4))  # link capabilities
    struct.pack_into("<H", c, 0x52, speed | (width << 4) | (0x2000 if port_type else 0))
    struct.pack_into("<I", c, 0x6C, ((1 << speed) - 1) << 1)  # supported link speeds
    return bytes(c)


def _resource(bar: int, bridge: bool) -> str:
    zero = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    if bridge:
        return zero * 17
    first = f"0x{bar:016x} 0x{bar + 0xFFFFFF:016x} 0x0000000000140204\n"
    return first + zero * 12


def _identity(f: PciFunction) -> tuple[str, str]:
    """The function's modalias and uevent."""
    modalias = (
        f"pci:v{f.vendor_id:08X}d{f.device_id:08X}sv{f.subsystem_vendor_id:08X}"
        f"sd{f.subsystem_device_id:08X}bc{f.class_code >> 16:02X}"
        f"sc{(f.class_code >> 8) & 0xFF:02X}i{f.class_code & 0xFF:02X}"
    )
    uevent = (
        (f"DRIVER={f.driver}\n" if f.driver else "")
        + f"PCI_CLASS={f.class_code:X}\nPCI_ID={f.vendor_id:04X}:{f.device_id:04X}\n"
        f"PCI_SUBSYS_ID={f.subsystem_vendor_id:04X}:{f.subsystem_device_id:04X}\n"
        f"PCI_SLOT_NAME={f.address}\nMODALIAS={modalias}\n"
    )
    return modalias, uevent


def _link(ctx: Ctx, f: PciFunction, state: DeviceState | None) -> tuple[str, str, str]:
    """aer_dev_fatal, current link speed and width under the owner's faults (tree.SIGNS)."""
    if state is not None and state.health is Health.UNHEALTHY and state.reason is not None:
        signs = SIGNS[state.reason]
        # a NIC's link-down is its network link (operstate, _net), not its PCIe link
        if not (signs.pci_link_down and ctx.kinds.get(f.owner or "") == "nic"):
            aer = AER_FATAL_OF[signs.aer_fatal] if signs.aer_fatal else AER_FATAL_CLEAN
            if signs.pci_link_down:
                return aer, "Unknown", "0"
            return aer, f.link_speed, str(f.link_width)
    return AER_FATAL_CLEAN, f.link_speed, str(f.link_width)


def add_pci(
    ctx: Ctx, plan: PciPlan, vf_counts: dict[str, int], present_map: dict[str, str] | None = None
) -> dict[str, str]:
    """Write every present function; returns address -> directory of what it wrote.

    A partial build (``ctx.only``) passes ``present_map``, every present function of the
    node (``present_functions``), and writes only its devices' functions and, whole,
    their IOMMU groups; it returns ``present_map``."""
    node = ctx.node
    out: dict[str, str] = {}
    groups: dict[int, list[str]] = {}
    only = ctx.only
    partial = only is not None
    functions: Iterable[PciFunction] = plan.functions
    if only is not None:
        assert present_map is not None
        out = present_map
        functions = sorted((f for d in only for f in plan.by_owner.get(d, ())),
                           key=lambda f: plan.ordinal[f.address])  # fmt: skip
    else:
        for hb in node.host_bridges:
            ctx.file(f"sys/devices/{hb.name}/uevent", "")
    written: set[int] = set()  # IOMMU groups with a function written by this build
    for f in functions:
        addr = f.address
        owner = f.owner
        state = ctx.states[owner] if owner is not None else None
        if state is not None and not present(state):
            continue
        pf = f.physfn
        if pf is not None and f.vf_index >= vf_counts.get(pf, 0):
            continue
        path = f.path
        if not partial:
            out[addr] = path
            groups.setdefault(f.iommu_group, []).append(addr)
        written.add(f.iommu_group)
        ordinal = plan.ordinal[addr]
        bridge = f.class_code == BRIDGE_CLASS
        bar = 0x380000000000 + (ordinal << 24)
        irq = 0 if pf is not None else 24 + ordinal % 200
        mask, cpulist = ctx.locality.get(f.numa_node, ctx.locality[-1])
        modalias, uevent = _identity(f)
        fatal, speed, width = _link(ctx, f, state)
        attrs: dict[str, str | bytes] = {
            "vendor": f"0x{f.vendor_id:04x}\n",
            "device": f"0x{f.device_id:04x}\n",
            "subsystem_vendor": f"0x{f.subsystem_vendor_id:04x}\n",
            "subsystem_device": f"0x{f.subsystem_device_id:04x}\n",
            "class": f"0x{f.class_code:06x}\n",
            "revision": f"0x{f.revision:02x}\n",
            "numa_node": f"{f.numa_node}\n",
            "local_cpus": f"{mask}\n",
            "local_cpulist": f"{cpulist}\n",
            "modalias": f"{modalias}\n",
            "irq": f"{irq}\n",
            "uevent": uevent,
            "resource": _resource(bar, bridge or f.class_code == HOST_BRIDGE_CLASS),
            "current_link_speed": f"{speed}\n",
            "current_link_width": f"{width}\n",
            "max_link_speed": f"{f.link_speed}\n",
            "max_link_width": f"{f.link_width}\n",
            "aer_dev_correctable": AER_COR_CLEAN,
            "aer_dev_nonfatal": AER_NONFATAL_CLEAN,
            "aer_dev_fatal": fatal,
            "broken_parity_status": "0\n",
            "consistent_dma_mask_bits": "64\n",
            "dma_mask_bits": "64\n",
            "d3cold_allowed": "1\n",
            "msi_bus": "1\n",
            "power_state": "D0\n",
            "ari_enabled": "0\n",
        }
        if bridge:
            attrs["secondary_bus_number"] = f"{f.secondary_bus}\n"
            attrs["subordinate_bus_number"] = f"{f.subordinate_bus}\n"
        ctx.files(path, attrs)
        children = ctx.dir(path).children
        children["config"] = File(_config(f, bar, irq), RW)
        children["enable"] = make_file("1\n", RW)
        children["driver_override"] = make_file("(null)\n", RW)
        children["remove"] = make_file(b"", WO)
        children["rescan"] = make_file(b"", WO)
        ctx.link(f"{path}/subsystem", "sys/bus/pci")
        if f.driver:
            ctx.link(f"{path}/driver", f"{DRIVERS}/{f.driver}")
            ctx.link(f"{DRIVERS}/{f.driver}/{addr}", path)
        ctx.link(f"{path}/iommu_group", f"{GROUPS}/{f.iommu_group}")
        ctx.link(f"{DEVICES}/{addr}", path)
        if pf is not None:
            ctx.link(f"{path}/physfn", plan.functions[plan.ordinal[pf]].path)
    # SR-IOV capability files on present PFs, virtfnN links to present VFs.
    for pf_addr, vfs in plan.pf_vfs.items():
        if pf_addr not in out or (
            partial and not ctx.emits(plan.functions[plan.ordinal[pf_addr]].owner)
        ):
            continue
        vf_device = plan.functions[plan.ordinal[vfs[0]]].device_id
        n = vf_counts.get(pf_addr, 0)
        pf_path = out[pf_addr]
        ctx.files(
            pf_path,
            {
                "sriov_totalvfs": f"{len(vfs)}\n",
                "sriov_offset": "1\n" if not vfs else f"{_rid(vfs[0]) - _rid(pf_addr)}\n",
                "sriov_stride": "1\n",
                "sriov_vf_device": f"{vf_device:x}\n",
            },
        )
        ctx.file(f"{pf_path}/sriov_numvfs", f"{n}\n", RW)
        ctx.file(f"{pf_path}/sriov_drivers_autoprobe", "1\n", RW)
        for v in range(n):
            ctx.link(f"{pf_path}/virtfn{v}", out[vfs[v]])
    if partial:  # a group is written whole, by any build that writes one member
        groups = {g: [m.address for m in plan.groups[g] if m.address in out] for g in written}
    for group, members in groups.items():
        base = f"{GROUPS}/{group}"
        ctx.files(
            base,
            {"type": "DMA\n", "reserved_regions": "0x00000000fee00000 0x00000000feefffff msi\n"},
        )
        for addr in members:
            ctx.link(f"{base}/devices/{addr}", out[addr])
    if not partial:
        _drivers(ctx, plan)
    return out


def _rid(addr: str) -> int:
    return int(addr[5:7], 16) << 8 | int(addr[8:10], 16) << 3 | int(addr[11])


def _drivers(ctx: Ctx, plan: PciPlan) -> None:
    """Driver directories exist while the driver is loaded: whatever is plugged in."""
    ctx.files("sys/bus/pci", {"drivers_autoprobe": "1\n", "resource_alignment": "\n"})
    ctx.dir(DEVICES)
    for drv in sorted(plan.drivers):
        base = f"{DRIVERS}/{drv}"
        ctx.files(
            base, {"bind": b"", "unbind": b"", "new_id": b"", "remove_id": b"", "uevent": b""}, WO
        )
        if drv in BUILTIN_DRIVERS:
            continue
        mod = module_of(drv)
        ctx.link(f"{base}/module", f"sys/module/{mod}")
        ctx.link(f"sys/module/{mod}/drivers/pci:{drv}", base)
        ctx.files(f"sys/module/{mod}", {"initstate": "live\n", "refcnt": "1\n"})
        ctx.dir(f"sys/module/{mod}/holders")

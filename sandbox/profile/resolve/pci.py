"""PCI placement: host bridges, root ports, switch ports, bus numbers, addresses (given or
derived) and IOMMU groups for every device of a node entry, each SR-IOV VF included.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox.profile import catalogue, model
from sandbox.profile.model import NO_NUMA_NODE
from sandbox.profile.resolve.devices import DeviceModel, Draft, device_model, number_minors
from sandbox.profile.spec import HostBridgeInfo, Loc, PciFunction


def format_address(domain: int, bus: int, devfn: int) -> str:
    return f"{domain:04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}"


_ROOT_PORT_DEVFNS = [d << 3 for d in range(1, 32)] + [
    d << 3 | f for d in range(1, 32) for f in range(1, 8)
]


class PciPlanner:
    """Assigns host bridges, root ports, switch ports, bus numbers and IOMMU groups."""

    def __init__(
        self, node: model.Node, numa_count: int, loc: Loc, problems: list[tuple[Loc, str]]
    ) -> None:
        self.node = node
        self.loc = loc
        self.problems = problems
        self.numa_count = numa_count
        self.host_bridges: list[HostBridgeInfo] = []
        self.bridges: list[PciFunction] = []
        self.used: dict[str, Loc] = {}
        self.bus_used: set[tuple[int, int]] = set()
        self.next_devfn: dict[str, int] = {}
        self.next_bus: dict[str, int] = {}
        # switch name -> (its host bridge, upstream port, inner bus, next free device)
        self.switch_ports: dict[str, tuple[HostBridgeInfo, str, int, int]] = {}
        hbs = node.pci.host_bridges
        if hbs is None:
            step = max(1, 256 // max(1, numa_count))
            hbs = [model.HostBridge(domain=0, bus=n * step, numa_node=n) for n in range(numa_count)]
        for k, hb in enumerate(hbs):
            name = f"pci{hb.domain:04x}:{hb.bus:02x}"
            if any(h.name == name for h in self.host_bridges):
                problems.append(((*loc, "pci", "hostBridges", k), f"duplicate host bridge {name}"))
                continue
            if hb.numa_node >= numa_count:
                problems.append(
                    ((*loc, "pci", "hostBridges", k, "numaNode"), self._no_numa(hb.numa_node))
                )
                continue
            self.host_bridges.append(HostBridgeInfo(name, hb.domain, hb.bus, hb.numa_node))
            self.bus_used.add((hb.domain, hb.bus))
        self.switches: dict[str, model.Switch] = {}
        for k, sw in enumerate(node.pci.switches):
            if sw.name in self.switches:
                problems.append(
                    ((*loc, "pci", "switches", k, "name"), f"duplicate switch {sw.name!r}")
                )
            elif sw.numa_node >= numa_count:
                problems.append(
                    ((*loc, "pci", "switches", k, "numaNode"), self._no_numa(sw.numa_node))
                )
            self.switches[sw.name] = sw
        self.iommu = 0

    def _no_numa(self, n: int) -> str:
        have = ", ".join(str(i) for i in range(self.numa_count))
        return f"no NUMA node {n} (have {have})"

    def _bus_limit(self, hb: HostBridgeInfo) -> int:
        later = [h.bus for h in self.host_bridges if h.domain == hb.domain and h.bus > hb.bus]
        return (min(later) - 1) if later else 0xFF

    def _alloc_buses(self, hb: HostBridgeInfo, n: int) -> int | None:
        start = self.next_bus.get(hb.name, hb.bus + 1)
        limit = self._bus_limit(hb)
        while start + n - 1 <= limit:
            if all((hb.domain, b) not in self.bus_used for b in range(start, start + n)):
                for b in range(start, start + n):
                    self.bus_used.add((hb.domain, b))
                self.next_bus[hb.name] = start + n
                return start
            start += 1
        return None

    def _root_port(self, hb: HostBridgeInfo) -> str | None:
        # Root ports take devices 01.0..1f.0 first, then the other functions of those.
        k = self.next_devfn.get(hb.name, 0)
        while k < len(_ROOT_PORT_DEVFNS):
            address = format_address(hb.domain, hb.bus, _ROOT_PORT_DEVFNS[k])
            k += 1
            if address not in self.used:
                self.next_devfn[hb.name] = k
                return address
        return None

    def _bridge(self, address: str, ids: tuple[int, int], hb: HostBridgeInfo,
                parent: str | None) -> None:
        self.used[address] = ()
        self.bridges.append(
            PciFunction(address, ids[0], ids[1], ids[0], 0, catalogue.BRIDGE_CLASS, 0x04,
                        "pcieport", hb.numa_node, hb.name, parent, self._group())
        )

    def _group(self) -> int:
        self.iommu += 1
        return self.iommu - 1

    def _slot(self, numa_node: int, buses: int, switch: str | None, dloc: Loc
              ) -> tuple[HostBridgeInfo, str | None, int] | None:
        """Where a new endpoint goes: (host bridge, parent bridge, its bus). A device
        without NUMA affinity goes on a host bridge without one, else on any."""
        candidates = [h for h in self.host_bridges if h.numa_node == numa_node]
        if not candidates and numa_node == NO_NUMA_NODE:
            candidates = list(self.host_bridges)
        if not candidates:
            self.problems.append(
                ((*dloc, "numaNode"), f"NUMA node {numa_node} has no PCI host bridge")
            )
            return None
        if switch is not None:
            return self._switch_slot(switch, buses, dloc)
        for hb in candidates:
            port = self._root_port(hb)
            if port is None:
                continue
            bus = self._alloc_buses(hb, buses)
            if bus is None:
                continue
            self._bridge(port, catalogue.root_port(self.node.cpu.vendor), hb, None)
            return hb, port, bus
        self.problems.append(
            (dloc, f"PCI bus numbers exhausted for NUMA node {numa_node}; add host bridges "
             "(pci.hostBridges) in other domains")
        )
        return None

    def _switch_slot(self, name: str, buses: int, dloc: Loc
                     ) -> tuple[HostBridgeInfo, str | None, int] | None:
        sw = self.switches.get(name)
        if sw is None:
            known = ", ".join(sorted(self.switches)) or "none defined"
            self.problems.append(((*dloc, "switch"), f"no PCI switch {name!r} ({known})"))
            return None
        if name not in self.switch_ports:
            placed = self._slot(sw.numa_node, 2, None, dloc)
            if placed is None:
                return None
            hb, _port, bus = placed
            upstream = format_address(hb.domain, bus, 0)
            self._bridge(upstream, catalogue.SWITCH_UPSTREAM, hb, _port)
            self.switch_ports[name] = (hb, upstream, bus + 1, 0)
        hb, upstream, inner_bus, next_dev = self.switch_ports[name]
        if next_dev >= 32:
            self.problems.append(((*dloc, "switch"), f"switch {name!r} has no free ports"))
            return None
        down = format_address(hb.domain, inner_bus, next_dev << 3)
        sub_bus = self._alloc_buses(hb, buses)
        if sub_bus is None:
            self.problems.append((dloc, "PCI bus numbers exhausted behind switch " + name))
            return None
        self._bridge(down, catalogue.SWITCH_DOWNSTREAM, hb, upstream)
        self.switch_ports[name] = (hb, upstream, inner_bus, next_dev + 1)
        return hb, down, sub_bus

    def _given_slot(self, address: str, numa_node: int, aloc: Loc
                    ) -> tuple[HostBridgeInfo, str | None, int] | None:
        domain, bus = int(address[0:4], 16), int(address[5:7], 16)
        name = f"pci{domain:04x}:{bus:02x}"
        hb = next((h for h in self.host_bridges if h.name == name), None)
        if hb is None:
            if (domain, bus) in self.bus_used:
                self.problems.append((aloc, f"bus {domain:04x}:{bus:02x} is already in use"))
                return None
            hb = HostBridgeInfo(name, domain, bus, numa_node)
            self.host_bridges.append(hb)
            self.bus_used.add((domain, bus))
        elif hb.numa_node != numa_node and numa_node != NO_NUMA_NODE:
            self.problems.append(
                (aloc, f"{address} is on host bridge {name} of NUMA node {hb.numa_node}, "
                 f"not {numa_node}")
            )
            return None
        return hb, None, bus

    def root_complex(self, taken: set[str]) -> PciFunction | None:
        """The host bridge function 0000:00:00.0 on host bridge pci0000:00 (its NUMA node),
        with the profile's ids or the CPU vendor's; None without that host bridge or when
        a device takes the address. Its IOMMU group comes after every device's."""
        address = "0000:00:00.0"
        hb = next((h for h in self.host_bridges if h.name == "pci0000:00"), None)
        if hb is None or address in taken:
            return None
        given = self.node.pci.root_complex
        ids = ((given.vendor_id, given.device_id) if given is not None
               else catalogue.root_complex(self.node.cpu.vendor))
        return PciFunction(address, ids[0], ids[1], 0, 0, catalogue.HOST_BRIDGE_CLASS, 0,
                           None, hb.numa_node, hb.name, None, self._group())

    def place_devices(self) -> list[Draft] | None:
        before = len(self.problems)
        drafts: list[Draft] = []
        counters: dict[str, int] = {}
        # Given addresses first so that derived ones never collide with them.
        order = sorted(
            range(len(self.node.devices)),
            key=lambda j: 0 if self.node.devices[j].pci_addresses else 1,
        )
        placed: dict[int, list[Draft]] = {}
        for j in order:
            dev = self.node.devices[j]
            dloc: Loc = (*self.loc, "devices", j)
            placed[j] = self._place(dev, dloc)
        for j in range(len(self.node.devices)):
            for d in placed[j]:
                prefix = d.id
                n = counters.get(prefix, 0)
                counters[prefix] = n + 1
                d.id = f"{prefix}{n}"
                drafts.append(d)
        if len(self.problems) > before:
            return None
        number_minors(drafts)
        return drafts

    def _place(self, dev: model.Device, dloc: Loc) -> list[Draft]:
        """The drafts of one profile entry's ``count`` devices, each placed."""
        spec = self._device_model(dev, dloc)
        if spec is None:
            return []
        out: list[Draft] = []
        for k in range(dev.count):
            if dev.pci_addresses is not None:
                where = self._given_base(dev, spec, k, dloc)
                if where is None:
                    continue
            else:
                where = self._derived_base(dev, spec, dloc)
                if where is None:
                    return out  # no room left: the next ones would not fit either
            draft = self._functions(dev, spec, dloc, where)
            if draft is not None:
                out.append(draft)
        return out

    def _device_model(self, dev: model.Device, dloc: Loc) -> DeviceModel | None:
        bad_numa = dev.numa_node >= self.numa_count
        if bad_numa:
            self.problems.append(((*dloc, "numaNode"), self._no_numa(dev.numa_node)))
        spec = device_model(dev, dloc, self.problems)
        return None if bad_numa else spec

    def _given_base(self, dev: model.Device, spec: DeviceModel, k: int, dloc: Loc
                    ) -> _Base | None:
        """Where the k-th device goes at the address the profile gives."""
        assert dev.pci_addresses is not None
        aloc: Loc = (*dloc, "pciAddresses", k)
        address = dev.pci_addresses[k].lower()
        slot = self._given_slot(address, dev.numa_node, aloc)
        if slot is None:
            return None
        base_bus = int(address[5:7], 16)
        base_devfn = int(address[8:10], 16) << 3 | int(address[11])
        if spec.functions + spec.functions * spec.total_vfs + base_devfn > 256:
            self.problems.append((aloc, "no room on this bus for the device's functions"))
            return None
        hb, parent, _ = slot
        return _Base(hb, parent, base_bus << 8 | base_devfn, aloc)

    def _derived_base(self, dev: model.Device, spec: DeviceModel, dloc: Loc) -> _Base | None:
        """A new port (and buses) for the next device on its NUMA node or switch."""
        addresses_needed = spec.functions + spec.functions * spec.total_vfs
        buses = max(1, -(-addresses_needed // 256))
        slot = self._slot(dev.numa_node, buses, dev.switch, dloc)
        if slot is None:
            return None
        hb, parent, bus = slot
        return _Base(hb, parent, bus << 8, dloc)

    def _functions(self, dev: model.Device, spec: DeviceModel, dloc: Loc, where: _Base
                   ) -> Draft | None:
        """The device's physical functions from ``where`` on, then room for all its VFs."""
        hb, aloc = where.host_bridge, where.loc
        functions: list[PciFunction] = []
        for f in range(spec.functions):
            rid = where.rid + f
            address = format_address(hb.domain, rid >> 8, rid & 0xFF)
            if address in self.used:
                self.problems.append((aloc, f"PCI address {address} is used twice"))
                continue
            self.used[address] = aloc
            functions.append(
                PciFunction(address, spec.vendor_id, spec.device_id, spec.subsystem_vendor_id,
                            spec.subsystem_device_id, spec.class_code, spec.revision,
                            spec.driver, dev.numa_node, hb.name, where.parent, self._group(),
                            spec.link_speed, spec.link_width)
            )
        if len(functions) != spec.functions:
            return None
        vf_addresses: list[tuple[str, ...]] = []
        vf_groups: list[tuple[int, ...]] = []
        for f in range(spec.functions):
            first = where.rid + spec.functions + f * spec.total_vfs
            addrs = tuple(
                format_address(hb.domain, (first + v) >> 8, (first + v) & 0xFF)
                for v in range(spec.total_vfs)
            )
            for a in addrs:
                if a in self.used:
                    self.problems.append((aloc, f"PCI address {a} (a VF) is used twice"))
                self.used[a] = aloc
            vf_addresses.append(addrs)
            vf_groups.append(tuple(self._group() for _ in addrs))
        return spec.draft(dev, dloc, functions, vf_addresses, vf_groups)


@dataclass(frozen=True)
class _Base:
    """Where a device's first function goes."""

    host_bridge: HostBridgeInfo
    parent: str | None  # the bridge above it; None: on the host bridge's bus
    rid: int  # bus << 8 | devfn of its first function
    loc: Loc  # the profile field a clash is reported at

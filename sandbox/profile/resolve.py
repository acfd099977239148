"""From a profile as written to a fully defaulted cluster description.

``resolve(profile)`` checks every cross-field rule and fills every default
deterministically: CPU numbering and NUMA CPU lists, memory split, PCI host bridges,
root ports and bus numbers, IOMMU groups, device ids (``gpu0``, ``nic1``), kernel
minors, serials, UUIDs and MACs seeded from profile name + node replica + device id.
The result is plain frozen dataclasses that the tree builder consumes. Every problem is
collected (with the field path it belongs to) and raised together as ``ResolveFailed``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid as uuidlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sandbox.profile import catalogue, model
from sandbox.profile.cpulist import parse_cpulist
from sandbox.profile.spec import (
    Cluster,
    CpuSpec,
    DeviceSpec,
    DevNodeSpec,
    FpgaSpec,
    GenericSpec,
    GpuSpec,
    HostBridgeInfo,
    Loc,
    LogicalCpu,
    NicSpec,
    NodeSpec,
    NumaInfo,
    PartitionProfileSpec,
    PartitionSpec,
    PciFunction,
)

_T = TypeVar("_T")

LOCAL_DISTANCE, REMOTE_DISTANCE = 10, 21
# What one node may have: enough for the largest real machines a plugin targets, small
# enough that its tree builds and renders in seconds on a laptop (benchmarks/bench_limits).
MAX_CPUS = 1024  # logical CPUs: sockets x coresPerSocket x threadsPerCore
MAX_DEVICES = 1024  # devices on a node (the sum of every entry's count)
MAX_FUNCTIONS = 4096  # PCI functions on a node, every possible SR-IOV VF included
MAX_NODES = 64  # nodes of a profile, replicas included


class ResolveFailed(Exception):
    def __init__(self, problems: Sequence[tuple[Loc, str]]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(m for _, m in self.problems))


def _size(n: int) -> str:
    from sandbox.textui import size

    return size(n)


def replica_name(name: str, count: int, index: int) -> str:
    return name if count == 1 else f"{name}-{index}"


def seeded(*parts: object) -> bytes:
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()


def format_address(domain: int, bus: int, devfn: int) -> str:
    return f"{domain:04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}"


# ---------------------------------------------------------------------------------------


def resolve(profile: model.Profile) -> Cluster:
    problems: list[tuple[Loc, str]] = []
    nodes: list[NodeSpec] = []
    seen_names: dict[str, int] = {}
    for i, node in enumerate(profile.nodes):
        loc: Loc = ("nodes", i)
        if node.name in seen_names:
            problems.append(
                ((*loc, "name"),
                 f"duplicate node name {node.name!r} (also nodes[{seen_names[node.name]}])")
            )
        seen_names.setdefault(node.name, i)
        before = len(problems)
        resolved = _resolve_node(node, loc, problems)
        if resolved is None or len(problems) > before:
            continue
        template, drafts = resolved
        first = _replica(profile.metadata.name, node, template, drafts, 0)
        size_problem = _too_big(first)
        if size_problem:
            problems.append(((*loc, "devices"), size_problem))
            continue
        nodes.append(first)
        for r in range(1, node.count):
            nodes.append(_replica(profile.metadata.name, node, template, drafts, r))
    replicas = sum(node.count for node in profile.nodes)
    if replicas > MAX_NODES:
        problems.append((("nodes",), f"{replicas} nodes (replicas included); at most "
                                     f"{MAX_NODES}"))
    seen_replicas: set[str] = set()
    for n in nodes:
        if n.name in seen_replicas and not problems:
            i = next(k for k, m in enumerate(profile.nodes) if m.name == n.base_name)
            problems.append(
                (("nodes", i, "name"), f"replica name {n.name!r} clashes with another node")
            )
        seen_replicas.add(n.name)
    if problems:
        raise ResolveFailed(problems)
    return Cluster(profile.metadata.name, profile.metadata.description, tuple(nodes))


def _too_big(node: NodeSpec) -> str | None:
    """Why a resolved node is past the devices or PCI functions limit, or None."""
    if len(node.devices) > MAX_DEVICES:
        return f"{len(node.devices)} devices on one node; at most {MAX_DEVICES}"
    functions = 0
    for d in node.devices:
        functions += len(d.functions)
        if d.gpu is not None:
            functions += len(d.gpu.vf_addresses)
        if d.nic is not None:
            functions += sum(len(v) for v in d.nic.vf_addresses)
    if functions > MAX_FUNCTIONS:
        return (f"{functions} PCI functions on one node (SR-IOV VFs included); at most "
                f"{MAX_FUNCTIONS}")
    return None


def _hugepage_kb(size: str) -> int | None:
    try:
        value = model.parse_quantity(size)
    except ValueError:
        return None
    if not isinstance(value, int) or value < 4096 or value % 1024:
        return None
    return value // 1024


def _resolve_node(
    node: model.Node, loc: Loc, problems: list[tuple[Loc, str]]
) -> tuple[NodeSpec, list[_Draft]] | None:
    cpu = node.cpu
    ncores = cpu.sockets * cpu.cores_per_socket
    ncpus = ncores * cpu.threads_per_core
    if ncpus > MAX_CPUS:
        problems.append(((*loc, "cpu"), f"{cpu.sockets} x {cpu.cores_per_socket} x "
                         f"{cpu.threads_per_core} = {ncpus} logical CPUs; at most {MAX_CPUS}"))
        return None
    # Linux's usual enumeration on x86: all first threads of every core, socket by
    # socket, then all second threads: cpuN and cpuN+cores are hyperthread siblings.
    layout = [
        (t * ncores + s * cpu.cores_per_socket + c, s, c, t)
        for t in range(cpu.threads_per_core)
        for s in range(cpu.sockets)
        for c in range(cpu.cores_per_socket)
    ]
    layout.sort()

    numa_entries = node.numa.nodes or [
        model.NumaNode(id=s, cpus=None) for s in range(cpu.sockets)
    ]
    numa_loc: Loc = (*loc, "numa", "nodes")
    ids = [n.id for n in numa_entries]
    for k, n in enumerate(numa_entries):
        if n.id != k:
            problems.append(
                ((*numa_loc, k, "id"),
                 f"NUMA node ids must be 0..{len(ids) - 1} in order, got {n.id}")
            )
    count = len(numa_entries)
    cpu_of: dict[int, int] = {}
    given = [n.cpus is not None for n in numa_entries]
    if any(given) and not all(given):
        k = given.index(False)
        problems.append(
            ((*numa_loc, k), "cpus must be given for every NUMA node or for none")
        )
    elif all(given):
        for k, n in enumerate(numa_entries):
            assert n.cpus is not None
            try:
                listed = parse_cpulist(n.cpus, ncpus)
            except ValueError as exc:
                problems.append(((*numa_loc, k, "cpus"), str(exc)))
                continue
            for c in listed:
                if c >= ncpus:
                    problems.append(
                        ((*numa_loc, k, "cpus"), f"CPU {c} does not exist (have 0-{ncpus - 1})")
                    )
                    break
                if c in cpu_of:
                    problems.append(
                        ((*numa_loc, k, "cpus"),
                         f"CPU {c} is already in NUMA node {cpu_of[c]}")
                    )
                    break
                cpu_of[c] = k
        missing = [c for c in range(ncpus) if c not in cpu_of]
        if missing and len(problems) == 0:
            problems.append(
                ((*numa_loc,), f"CPUs {missing[0]}.. belong to no NUMA node")
            )
    else:
        if count % cpu.sockets == 0:
            per_socket = count // cpu.sockets
            if cpu.cores_per_socket % per_socket:
                problems.append(
                    (numa_loc, f"{cpu.cores_per_socket} cores per socket do not split evenly "
                     f"into {per_socket} NUMA nodes per socket; give cpus")
                )
            else:
                chunk = cpu.cores_per_socket // per_socket
                for cid, s, c, _t in layout:
                    cpu_of[cid] = s * per_socket + c // chunk
        elif cpu.sockets % count == 0:
            group = cpu.sockets // count
            for cid, s, _c, _t in layout:
                cpu_of[cid] = s // group
        else:
            problems.append(
                (numa_loc, f"cannot derive CPUs for {count} NUMA nodes from "
                 f"{cpu.sockets} sockets; give cpus")
            )

    # Memory: the total splits evenly across nodes that don't state their own.
    stated = [n.memory for n in numa_entries]
    if node.memory is None:
        total = sum(m for m in stated if m is not None) + 16 * 2**30 * stated.count(None)
    else:
        total = node.memory
    rest = total - sum(m for m in stated if m is not None)
    unstated = stated.count(None)
    if node.memory is not None:
        if unstated == 0 and rest != 0:
            problems.append(
                ((*loc, "memory"), f"total {_size(total)} differs from the NUMA nodes' sum "
                 f"{_size(total - rest)}")
            )
        elif rest < 0 or (unstated and rest < unstated * 2**20):
            problems.append(
                ((*loc, "memory"), "total memory is smaller than the NUMA nodes' memory")
            )
    mems = [m if m is not None else (rest // unstated if unstated else 0) for m in stated]
    mems = [m - m % 4096 for m in mems]

    numa: list[NumaInfo] = []
    for k, n in enumerate(numa_entries):
        pages: list[tuple[int, int]] = []
        for size, pages_count in sorted(n.hugepages.items()):
            kb = _hugepage_kb(size)
            if kb is None:
                problems.append(
                    ((*numa_loc, k, "hugepages", size),
                     f"{size!r} is not a page size (like 2Mi or 1Gi)")
                )
                continue
            pages.append((kb, pages_count))
        pages.sort()
        if sum(kb * 1024 * c for kb, c in pages) > mems[k]:
            problems.append(
                ((*numa_loc, k, "hugepages"), "hugepages exceed the NUMA node's memory")
            )
        numa.append(
            NumaInfo(k, tuple(c for c in range(ncpus) if cpu_of.get(c) == k), mems[k],
                     tuple(pages), ())
        )
    # Distances.
    dist_loc: Loc = (*loc, "numa", "distances")
    if node.numa.distances is None:
        matrix = [[LOCAL_DISTANCE if a == b else REMOTE_DISTANCE for b in range(count)]
                  for a in range(count)]
    else:
        matrix = node.numa.distances
        if len(matrix) != count or any(len(row) != count for row in matrix):
            problems.append((dist_loc, f"must be a {count}x{count} matrix (one row per NUMA node)"))
        else:
            for a in range(count):
                for b in range(count):
                    d = matrix[a][b]
                    if a == b and d != LOCAL_DISTANCE:
                        problems.append(((*dist_loc, a, b), f"local distance must be 10, got {d}"))
                    elif a != b and not 11 <= d <= 254:
                        problems.append(
                            ((*dist_loc, a, b), f"remote distance must be 11..254, got {d}")
                        )
                    elif a < b and matrix[b][a] != d:
                        problems.append(
                            ((*dist_loc, a, b),
                             f"matrix is not symmetric: [{a}][{b}]={d} "
                             f"but [{b}][{a}]={matrix[b][a]}")
                        )
    if len(problems) == 0:
        numa = [
            NumaInfo(n.id, n.cpus, n.memory, n.hugepages, tuple(matrix[n.id])) for n in numa
        ]
    cpus = tuple(
        LogicalCpu(cid, s, c, t, cpu_of.get(cid, 0)) for cid, s, c, t in layout
    )

    pci = _PciPlanner(node, count, loc, problems)
    devices = pci.place_devices()
    if devices is None:
        return None
    return NodeSpec(
        name=node.name,
        base_name=node.name,
        index=0,
        role=node.role,
        labels=tuple(sorted(node.labels.items())),
        topology_manager_policy=node.kubelet.topology_manager_policy,
        cpu=CpuSpec(cpu.sockets, cpu.cores_per_socket, cpu.threads_per_core, cpu.vendor,
                    cpu.model, cpu.family, cpu.model_number, cpu.mhz),
        cpus=cpus,
        numa=tuple(numa),
        memory=sum(mems),
        host_bridges=tuple(pci.host_bridges),
        bridges=tuple(pci.bridges),
        devices=(),
    ), devices


@dataclass
class _Draft:
    """A device before replica-specific identities (serials, MACs) are filled in."""

    id: str
    kind: str
    vendor: str
    model: str
    model_name: str
    numa_node: int
    functions: list[PciFunction]
    health: str
    health_reason: str | None
    source: Loc
    gpu: GpuSpec | None = None
    nic: NicSpec | None = None
    fpga: FpgaSpec | None = None
    generic: GenericSpec | None = None
    mac_base: str | None = None


_ROOT_PORT_DEVFNS = [d << 3 for d in range(1, 32)] + [
    d << 3 | f for d in range(1, 32) for f in range(1, 8)
]


class _PciPlanner:
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
        self.switch_ports: dict[str, tuple[str, int, int]] = {}  # name -> (upstream, bus, next dev)
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
        """Where a new endpoint goes: (host bridge, parent bridge, its bus)."""
        candidates = [h for h in self.host_bridges if h.numa_node == numa_node]
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
            self._bridge(port, catalogue.ROOT_PORT, hb, None)
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
            self.switch_ports[name] = (upstream, bus + 1, 0)
        upstream, inner_bus, next_dev = self.switch_ports[name]
        hb = next(h for h in self.host_bridges if h.numa_node == sw.numa_node)
        if next_dev >= 32:
            self.problems.append(((*dloc, "switch"), f"switch {name!r} has no free ports"))
            return None
        down = format_address(hb.domain, inner_bus, next_dev << 3)
        sub_bus = self._alloc_buses(hb, buses)
        if sub_bus is None:
            self.problems.append((dloc, "PCI bus numbers exhausted behind switch " + name))
            return None
        self._bridge(down, catalogue.SWITCH_DOWNSTREAM, hb, upstream)
        self.switch_ports[name] = (upstream, inner_bus, next_dev + 1)
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
        elif hb.numa_node != numa_node:
            self.problems.append(
                (aloc, f"{address} is on host bridge {name} of NUMA node {hb.numa_node}, "
                 f"not {numa_node}")
            )
            return None
        return hb, None, bus

    def place_devices(self) -> list[_Draft] | None:
        before = len(self.problems)
        drafts: list[_Draft] = []
        counters: dict[str, int] = {}
        # Given addresses first so that derived ones never collide with them.
        order = sorted(
            range(len(self.node.devices)),
            key=lambda j: 0 if self.node.devices[j].pci_addresses else 1,
        )
        placed: dict[int, list[_Draft]] = {}
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
        _number_minors(drafts)
        return drafts

    def _place(self, dev: model.Device, dloc: Loc) -> list[_Draft]:
        bad_numa = dev.numa_node >= self.numa_count
        if bad_numa:
            self.problems.append(((*dloc, "numaNode"), self._no_numa(dev.numa_node)))
        if dev.health == "healthy" and dev.health_reason is not None:
            self.problems.append(
                ((*dloc, "healthReason"), "a healthReason needs health: unhealthy")
            )
        if dev.pci_addresses is not None and len(dev.pci_addresses) != dev.count:
            self.problems.append(
                ((*dloc, "pciAddresses"),
                 f"gives {len(dev.pci_addresses)} addresses for count {dev.count}")
            )
            return []
        spec = _DeviceModel.of(dev, dloc, self.problems)
        if spec is None or bad_numa:
            return []
        out: list[_Draft] = []
        for k in range(dev.count):
            addresses_needed = spec.functions + spec.functions * spec.total_vfs
            buses = max(1, -(-addresses_needed // 256))
            if dev.pci_addresses is not None:
                aloc: Loc = (*dloc, "pciAddresses", k)
                address = dev.pci_addresses[k].lower()
                slot = self._given_slot(address, dev.numa_node, aloc)
                if slot is None:
                    continue
                base_bus = int(address[5:7], 16)
                base_devfn = int(address[8:10], 16) << 3 | int(address[11])
                if spec.functions + spec.functions * spec.total_vfs + base_devfn > 256:
                    self.problems.append((aloc, "no room on this bus for the device's functions"))
                    continue
            else:
                slot = self._slot(dev.numa_node, buses, dev.switch, dloc)
                if slot is None:
                    return out
                base_bus, base_devfn = slot[2], 0
                aloc = dloc
            hb, parent, _ = slot
            base_rid = base_bus << 8 | base_devfn
            functions: list[PciFunction] = []
            for f in range(spec.functions):
                address = format_address(hb.domain, (base_rid + f) >> 8, (base_rid + f) & 0xFF)
                if address in self.used:
                    self.problems.append((aloc, f"PCI address {address} is used twice"))
                    continue
                self.used[address] = aloc
                functions.append(
                    PciFunction(address, spec.vendor_id, spec.device_id, spec.subsystem_vendor_id,
                                spec.subsystem_device_id, spec.class_code, spec.revision,
                                spec.driver, dev.numa_node, hb.name, parent, self._group(),
                                spec.link_speed, spec.link_width)
                )
            if len(functions) != spec.functions:
                continue
            vf_addresses: list[tuple[str, ...]] = []
            vf_groups: list[tuple[int, ...]] = []
            for f in range(spec.functions):
                first = base_rid + spec.functions + f * spec.total_vfs
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
            out.append(spec.draft(dev, dloc, functions, vf_addresses, vf_groups))
        return out


@dataclass
class _DeviceModel:
    """What placing one device of a profile entry needs, from the catalogue + overrides."""

    prefix: str
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int
    subsystem_device_id: int
    class_code: int
    revision: int
    driver: str | None
    functions: int
    total_vfs: int
    link_speed: str
    link_width: int
    model_name: str
    gpu: catalogue.GpuModel | None = None
    nic: catalogue.NicModel | None = None
    fpga: catalogue.FpgaModel | None = None

    @staticmethod
    def of(dev: model.Device, dloc: Loc, problems: list[tuple[Loc, str]]) -> _DeviceModel | None:
        if isinstance(dev, model.Generic):
            return _DeviceModel(
                dev.name or "dev", dev.vendor_id, dev.device_id, dev.vendor_id, 0,
                dev.class_code, 0, dev.driver, 1, 0, "8.0 GT/s PCIe", 8, dev.model,
            )
        tables: dict[str, Mapping[str, Mapping[str, object]]] = {
            "gpu": catalogue.GPUS, "nic": catalogue.NICS, "fpga": catalogue.FPGAS,
        }
        models = tables[dev.type][dev.vendor]
        entry = models.get(dev.model)
        if entry is None:
            import difflib

            close = difflib.get_close_matches(dev.model, list(models), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            known = ", ".join(sorted(models))
            problems.append(
                ((*dloc, "model"), f"unknown {dev.vendor} {dev.type} model {dev.model!r}{hint}; "
                 f"known: {known}")
            )
            return None
        if isinstance(dev, model.Gpu):
            assert isinstance(entry, catalogue.GpuModel)
            memory = dev.memory if dev.memory is not None else entry.memory
            if dev.partitions is not None:
                _check_partitions(dev, entry, memory, dloc, problems)
            gpu_vfs = _check_sriov(dev.sriov, entry.max_vfs, entry.name, dloc, problems)
            return _DeviceModel(
                dev.name or "gpu", entry.vendor_id, entry.device_id, entry.subsystem_vendor_id,
                entry.subsystem_device_id, entry.class_code, 0xA1 if dev.vendor == "nvidia" else 0,
                entry.driver, 1, gpu_vfs, entry.link_speed, entry.link_width, entry.name,
                gpu=entry,
            )
        if isinstance(dev, model.Nic):
            assert isinstance(entry, catalogue.NicModel)
            total = _check_sriov(dev.sriov, entry.max_vfs, entry.name, dloc, problems)
            if dev.link_layer == "infiniband" and dev.vendor != "mellanox":
                problems.append(((*dloc, "linkLayer"), "InfiniBand needs a mellanox NIC"))
            if dev.rdma and not entry.rdma:
                problems.append(((*dloc, "rdma"), f"{entry.name} has no RDMA"))
            class_code = 0x020700 if dev.link_layer == "infiniband" else entry.class_code
            return _DeviceModel(
                dev.name or "nic", entry.vendor_id, entry.device_id, entry.vendor_id,
                0x0001, class_code, 0, entry.driver, dev.ports, total, entry.link_speed,
                entry.link_width, entry.name, nic=entry,
            )
        assert isinstance(dev, model.Fpga)
        assert isinstance(entry, catalogue.FpgaModel)
        ports = dev.ports if dev.ports is not None else entry.ports
        if dev.afu_ids is not None and len(dev.afu_ids) != ports:
            problems.append(
                ((*dloc, "afuIds"), f"gives {len(dev.afu_ids)} AFU ids for {ports} ports")
            )
        return _DeviceModel(
            dev.name or "fpga", entry.vendor_id, entry.device_id, entry.vendor_id, 0,
            entry.class_code, 0, entry.driver, 1, 0, "8.0 GT/s PCIe", 16, entry.name, fpga=entry,
        )

    def draft(self, dev: model.Device, dloc: Loc, functions: list[PciFunction],
              vf_addresses: list[tuple[str, ...]], vf_groups: list[tuple[int, ...]]) -> _Draft:
        d = _Draft(
            id=self.prefix, kind=dev.type,
            vendor=dev.vendor if not isinstance(dev, model.Generic) else f"{dev.vendor_id:04x}",
            model=getattr(dev, "model", "generic"), model_name=self.model_name,
            numa_node=dev.numa_node, functions=functions, health=dev.health,
            health_reason=dev.health_reason or ("aer-fatal" if dev.health == "unhealthy" else None),
            source=dloc,
        )
        if isinstance(dev, model.Gpu):
            assert self.gpu is not None
            memory = dev.memory if dev.memory is not None else self.gpu.memory
            d.gpu = GpuSpec(
                memory, _partition_spec(dev, self.gpu, memory), 0, 0,
                self.gpu.gfx_target_version, self.gpu.simd_count,
                total_vfs=self.total_vfs, num_vfs=dev.sriov.num_vfs if dev.sriov else 0,
                vf_addresses=vf_addresses[0] if vf_addresses else (),
                vf_iommu_groups=vf_groups[0] if vf_groups else (),
            )
        elif isinstance(dev, model.Nic):
            assert self.nic is not None
            rdma = dev.rdma if dev.rdma is not None else self.nic.rdma
            d.nic = NicSpec(
                ports=dev.ports, speed=dev.speed or self.nic.speed, link_layer=dev.link_layer,
                rdma=rdma or dev.link_layer == "infiniband", macs=(), netdevs=(), rdma_devs=(),
                total_vfs=self.total_vfs, num_vfs=dev.sriov.num_vfs if dev.sriov else 0,
                vf_device_id=self.nic.vf_device_id, vf_driver=self.nic.vf_driver,
                vf_addresses=tuple(vf_addresses), vf_iommu_groups=tuple(vf_groups),
                node_guids=(),
            )
            d.mac_base = dev.mac_base
        elif isinstance(dev, model.Fpga):
            assert self.fpga is not None
            ports = dev.ports if dev.ports is not None else self.fpga.ports
            afus = tuple(dev.afu_ids) if dev.afu_ids else (self.fpga.afu_id,) * ports
            d.fpga = FpgaSpec(self.fpga.flavor, ports, afus, self.fpga.bitstream_id, 0, 0)
        else:
            assert isinstance(dev, model.Generic)
            d.generic = GenericSpec(tuple(DevNodeSpec(n.name, n.major, n.minor)
                                          for n in dev.dev_nodes))
        return d


def _check_sriov(sriov: model.Sriov | None, max_vfs: int, name: str, dloc: Loc,
                 problems: list[tuple[Loc, str]]) -> int:
    """The number of VFs to reserve addresses for (totalVFs)."""
    if sriov is None:
        return 0
    if max_vfs == 0:
        problems.append(((*dloc, "sriov"), f"{name} has no SR-IOV"))
        return 0
    total = sriov.total_vfs if sriov.total_vfs is not None else min(max_vfs, 8)
    if total > max_vfs:
        problems.append(
            ((*dloc, "sriov", "totalVFs"), f"{name} supports at most {max_vfs} VFs, not {total}")
        )
    if sriov.num_vfs > total:
        problems.append(
            ((*dloc, "sriov", "numVFs"), f"numVFs {sriov.num_vfs} exceeds totalVFs {total}")
        )
    return min(total, max_vfs)


def _check_partitions(dev: model.Gpu, entry: catalogue.GpuModel, memory: int, dloc: Loc,
                      problems: list[tuple[Loc, str]]) -> None:
    assert dev.partitions is not None
    p = dev.partitions
    ploc: Loc = (*dloc, "partitions")
    mslices = p.memory_slices or entry.memory_slices
    cslices = p.compute_slices or entry.compute_slices
    if not mslices or not cslices:
        problems.append(
            (ploc, f"{entry.name} has no native partitioning; give memorySlices and computeSlices")
        )
        return
    names: set[str] = set()
    for k, prof in enumerate(p.profiles):
        kloc: Loc = (*ploc, "profiles", k)
        if prof.name in names:
            problems.append(((*kloc, "name"), f"duplicate partition profile {prof.name!r}"))
        names.add(prof.name)
        if prof.memory_slices > mslices:
            problems.append(
                ((*kloc, "memorySlices"), f"{prof.memory_slices} exceeds the device's {mslices}")
            )
        if prof.compute_slices > cslices:
            problems.append(
                ((*kloc, "computeSlices"), f"{prof.compute_slices} exceeds the device's {cslices}")
            )
        if prof.memory is not None and prof.memory > memory:
            problems.append(
                ((*kloc, "memory"),
                 f"{_size(prof.memory)} does not fit the device's memory ({_size(memory)})")
            )


def _partition_spec(dev: model.Gpu, entry: catalogue.GpuModel, memory: int) -> PartitionSpec | None:
    p = dev.partitions
    if p is None:
        return None
    mslices = p.memory_slices or entry.memory_slices
    cslices = p.compute_slices or entry.compute_slices
    if not mslices or not cslices:
        return None  # reported by _check_partitions
    return PartitionSpec(
        mslices, cslices,
        tuple(
            PartitionProfileSpec(
                q.name, q.memory_slices, q.compute_slices,
                q.memory if q.memory is not None else memory * q.memory_slices // mslices,
            )
            for q in p.profiles
        ),
        tuple(p.modes),
    )


def _number_minors(drafts: list[_Draft]) -> None:
    """Kernel-style numbering: minors follow PCI address order, like driver probe order."""
    by_addr = sorted(drafts, key=lambda d: d.functions[0].address)
    nvidia = 0
    drm = 0
    for d in by_addr:
        if d.gpu is None:
            continue
        if d.vendor == "nvidia":
            d.gpu = _replace(d.gpu, minor=nvidia, render_minor=0)
            nvidia += 1
        else:
            d.gpu = _replace(d.gpu, minor=drm, render_minor=128 + drm)
            drm += 1
    region = port = 0
    for d in by_addr:
        if d.fpga is not None:
            d.fpga = _replace(d.fpga, region=region, first_port=port)
            region += 1
            port += d.fpga.ports


def _replace(obj: _T, **changes: Any) -> _T:
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


def _replica(
    profile_name: str, node: model.Node, template: NodeSpec, drafts: list[_Draft], r: int
) -> NodeSpec:
    name = replica_name(node.name, node.count, r)
    devices: list[DeviceSpec] = []
    rdma_counter = 0
    for draft in sorted(drafts, key=lambda d: d.functions[0].address):
        seed = (profile_name, name, draft.id)
        raw = seeded(*seed, "uuid")
        uid = str(uuidlib.UUID(bytes=raw[:16], version=4))
        serial = str(int.from_bytes(seeded(*seed, "serial")[:8], "big") % 10**13).zfill(13)
        nic = draft.nic
        if nic is not None:
            if draft.mac_base is not None:
                base = int(draft.mac_base.replace(":", ""), 16) + (r << 8)
            else:
                tail = int.from_bytes(seeded(*seed, "mac")[:3], "big") & 0xFFFFF0
                base = int(_oui(draft).replace(":", ""), 16) << 24 | tail
            macs = [_format_mac(base + p) for p in range(nic.ports)]
            netdevs = tuple(
                _netdev_name(f.address) for f in draft.functions
            )
            guids = tuple(
                ":".join(f"{b:02x}" for b in seeded(*seed, "guid", p)[:8]) for p in range(nic.ports)
            )
            rdma_devs: tuple[str, ...] = ()
            if nic.rdma:
                prefix = "mlx5_" if draft.vendor == "mellanox" else "irdma"
                rdma_devs = tuple(f"{prefix}{rdma_counter + p}" for p in range(nic.ports))
                rdma_counter += nic.ports
            nic = _replace(nic, macs=tuple(macs), netdevs=netdevs, rdma_devs=rdma_devs,
                           node_guids=guids)
        devices.append(
            DeviceSpec(
                id=draft.id, kind=draft.kind, vendor=draft.vendor, model=draft.model,
                model_name=draft.model_name, numa_node=draft.numa_node,
                functions=tuple(draft.functions), serial=serial,
                uuid=("GPU-" + uid) if draft.vendor == "nvidia" else uid,
                health=draft.health, health_reason=draft.health_reason, source=draft.source,
                gpu=draft.gpu, nic=nic, fpga=draft.fpga, generic=_expand_generic(draft),
            )
        )
    devices.sort(key=lambda d: _id_key(d.id))
    return NodeSpec(
        name=name, base_name=node.name, index=r, role=template.role, labels=template.labels,
        topology_manager_policy=template.topology_manager_policy, cpu=template.cpu,
        cpus=template.cpus, numa=template.numa, memory=template.memory,
        host_bridges=template.host_bridges, bridges=template.bridges, devices=tuple(devices),
    )


def _id_key(device_id: str) -> tuple[str, int]:
    stem = device_id.rstrip("0123456789")
    return stem, int(device_id[len(stem):] or 0)


def _format_mac(value: int) -> str:
    value &= (1 << 48) - 1
    return ":".join(f"{(value >> s) & 0xFF:02x}" for s in range(40, -8, -8))


def _oui(draft: _Draft) -> str:
    models = catalogue.NICS.get(draft.vendor, {})
    entry = models.get(draft.model)
    return entry.oui if entry else "02:00:00"


def _netdev_name(address: str) -> str:
    """systemd's predictable name for a PCI function: enp<bus>s<slot>f<function>."""
    bus, slot, fn = int(address[5:7], 16), int(address[8:10], 16), int(address[11])
    domain = int(address[0:4], 16)
    prefix = f"enP{domain}p" if domain else "enp"
    return f"{prefix}{bus}s{slot}f{fn}"


def _expand_generic(draft: _Draft) -> GenericSpec | None:
    if draft.generic is None:
        return None
    index = int(draft.id[len(draft.id.rstrip("0123456789")):] or 0)
    return GenericSpec(tuple(
        DevNodeSpec(n.name.replace("{i}", str(index)), n.major, n.minor + index
                    if "{i}" in n.name else n.minor)
        for n in draft.generic.dev_nodes
    ))

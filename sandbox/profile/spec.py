"""The resolved, frozen description of a cluster: what every other module consumes.

``resolve`` computes these from a profile; the tree builder, the runtimes, the DRA
slices and the drawings only read them. Everything is a frozen dataclass of plain values
(ints, strings, tuples), so a node spec compares by value.

    Cluster(name, description, nodes)
      NodeSpec(cpu, cpus, numa, memory, host_bridges, bridges, devices, ...)
        DeviceSpec(id, kind, functions, gpu | nic | fpga | generic, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field

Loc = tuple[str | int, ...]  # a field path in the profile: ("nodes", 0, "devices", 2)


@dataclass(frozen=True)
class LogicalCpu:
    id: int
    socket: int
    core: int  # core id within its socket
    thread: int
    numa_node: int


@dataclass(frozen=True)
class NumaInfo:
    id: int
    cpus: tuple[int, ...]
    memory: int  # bytes
    hugepages: tuple[tuple[int, int], ...]  # (page size in kB, pages)
    distances: tuple[int, ...]


@dataclass(frozen=True)
class PciFunction:
    address: str  # DDDD:BB:DD.F
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int
    subsystem_device_id: int
    class_code: int
    revision: int
    driver: str | None
    numa_node: int
    host_bridge: str  # pciDDDD:BB
    parent: str | None  # the bridge function above it; None: on the host bridge's bus
    iommu_group: int
    link_speed: str = "16.0 GT/s PCIe"
    link_width: int = 16
    # Where it sits in the node's PCI tree, planned once by the resolver (resolve.pci) for
    # every function the node can ever show; the tree builder only renders it.
    path: str = ""  # its directory: sys/devices/pciDDDD:BB/<bridges...>/DDDD:BB:DD.F
    owner: str | None = None  # the device id of an endpoint or VF; None: a bridge
    physfn: str | None = None  # a VF's physical function; None: not a VF
    vf_index: int = 0  # a VF's N (the PF's virtfnN link)
    secondary_bus: int = 0  # a bridge's bus range (config space 0x19, 0x1a)
    subordinate_bus: int = 0
    port_type: int = 0  # a bridge's PCIe port type: 4 root, 5 switch upstream, 6 downstream
    multifunction: bool = False  # another (non-VF) function shares its slot

    @property
    def domain(self) -> int:
        return int(self.address[0:4], 16)

    @property
    def bus(self) -> int:
        return int(self.address[5:7], 16)


@dataclass(frozen=True)
class HostBridgeInfo:
    name: str  # pciDDDD:BB
    domain: int
    bus: int
    numa_node: int


@dataclass(frozen=True)
class PartitionProfileSpec:
    name: str
    memory_slices: int
    compute_slices: int
    memory: int


@dataclass(frozen=True)
class PartitionSpec:
    memory_slices: int
    compute_slices: int
    profiles: tuple[PartitionProfileSpec, ...]
    modes: tuple[str, ...]


@dataclass(frozen=True)
class GpuSpec:
    memory: int
    partitions: PartitionSpec | None
    minor: int  # /dev/nvidiaN for NVIDIA; DRM cardN for AMD and Intel
    render_minor: int  # renderD<N> (DRM vendors)
    gfx_target_version: int
    simd_count: int
    total_vfs: int = 0  # SR-IOV (Intel Flex/Max): VFs share the PF's vendor/device id
    num_vfs: int = 0
    vf_addresses: tuple[str, ...] = ()
    vf_iommu_groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class NicSpec:
    ports: int
    speed: int  # Mb/s
    link_layer: str  # ethernet | infiniband
    rdma: bool
    macs: tuple[str, ...]  # one per port (PF)
    netdevs: tuple[str, ...]  # one per port
    rdma_devs: tuple[str, ...]  # one per port where rdma, else empty
    total_vfs: int
    num_vfs: int
    vf_device_id: int
    vf_driver: str
    vf_addresses: tuple[tuple[str, ...], ...]  # per PF, total_vfs addresses
    vf_iommu_groups: tuple[tuple[int, ...], ...]
    node_guids: tuple[str, ...]


@dataclass(frozen=True)
class FpgaSpec:
    flavor: str  # dfl | generic
    ports: int
    afu_ids: tuple[str, ...]
    bitstream_id: str
    region: int  # fpga_regionN / dfl-fme.N index
    first_port: int  # dfl-port.N of this card's first port


@dataclass(frozen=True)
class DevNodeSpec:
    name: str
    major: int
    minor: int


@dataclass(frozen=True)
class GenericSpec:
    dev_nodes: tuple[DevNodeSpec, ...]


@dataclass(frozen=True)
class DeviceSpec:
    id: str
    kind: str  # gpu | nic | fpga | generic
    vendor: str
    model: str
    model_name: str
    numa_node: int
    functions: tuple[PciFunction, ...]  # physical functions; [0] is the device's address
    serial: str
    uuid: str
    health: str
    health_reason: str | None
    source: Loc
    gpu: GpuSpec | None = None
    nic: NicSpec | None = None
    fpga: FpgaSpec | None = None
    generic: GenericSpec | None = None

    @property
    def address(self) -> str:
        return self.functions[0].address


@dataclass(frozen=True)
class CpuSpec:
    sockets: int
    cores_per_socket: int
    threads_per_core: int
    vendor: str
    model: str
    family: int
    model_number: int
    mhz: int


@dataclass(frozen=True)
class NodeSpec:
    name: str  # replica name: the node name, or name-I when count > 1
    base_name: str
    index: int
    role: str
    labels: tuple[tuple[str, str], ...]
    topology_manager_policy: str
    cpu: CpuSpec
    cpus: tuple[LogicalCpu, ...]
    numa: tuple[NumaInfo, ...]
    memory: int
    host_bridges: tuple[HostBridgeInfo, ...]
    # Every PCI function the node can ever show, in address order: bridges, the devices'
    # physical functions and every possible SR-IOV VF (enabled or not).
    pci: tuple[PciFunction, ...]
    devices: tuple[DeviceSpec, ...]

    def device(self, device_id: str) -> DeviceSpec | None:
        return next((d for d in self.devices if d.id == device_id), None)

    @property
    def bridges(self) -> tuple[PciFunction, ...]:
        """The root ports and switch ports."""
        return tuple(f for f in self.pci if f.owner is None)


@dataclass(frozen=True)
class Cluster:
    name: str
    description: str
    nodes: tuple[NodeSpec, ...] = field(default_factory=tuple)

    def node(self, name: str, index: int | None = None) -> NodeSpec | None:
        """A node by replica name (``worker-1``), or by profile name and replica index."""
        for n in self.nodes:
            if n.name == name and index is None:
                return n
            if n.base_name == name and (index is None or n.index == index):
                return n
        return None

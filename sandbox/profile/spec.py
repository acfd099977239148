"""The resolved, frozen description of a cluster: what every other module consumes.

``resolve`` computes these from a profile; the tree builder, the runtimes, the DRA
slices and the drawings only read them. Everything is a frozen dataclass of plain values
(ints, strings, tuples), so a node spec compares by value, and ``dump``/``load`` write
it as JSON and read it back to an equal object (docs/spec-format.md).

    Cluster(name, description, nodes)
      NodeSpec(cpu, cpus, numa, memory, host_bridges, bridges, devices, ...)
        DeviceSpec(id, kind, functions, gpu | nic | fpga | nvme | generic, ...)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox.errors import SpecError
from sandbox.profile.typedjson import Loc as Loc  # re-exported: a field path in the profile
from sandbox.profile.typedjson import decode, where


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
    # Its index among the node's DRM devices (drm_minors: cardN, renderD*) in probe order:
    # AMD and Intel GPUs (= minor), and NVIDIA GPUs with nvidia-drm (profile ``drm``); -1: none
    drm_index: int = -1


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
    region: int  # fpga_regionN / dfl-fme.N index over the DFL cards; -1: not DFL
    first_port: int  # dfl-port.N of this card's first port; -1: not DFL


@dataclass(frozen=True)
class NvmeSpec:
    capacity: int  # bytes over all namespaces
    namespaces: int  # nvmeXn1..nvmeXnN, the capacity split evenly
    lba_size: int  # logical block size of the namespaces (512 | 4096)
    model_number: str  # Identify Controller MN (sysfs ``model``)
    firmware: str  # Identify Controller FR (sysfs ``firmware_rev``)
    serial_prefix: str  # the vendor's serial numbers start so (sysfs ``serial``)
    controller: int  # nvmeN, in PCI address order (probe order)
    first_minor: int  # block 259:first_minor is nvmeNn1; its namespaces follow


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
    kind: str  # gpu | nic | fpga | nvme | generic
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
    nvme: NvmeSpec | None = None
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
class SystemSpec:
    """The machine's DMI identity (``sys/devices/virtual/dmi/id``): the profile's ``system``
    over defaults per CPU vendor; serial and UUID per replica."""

    sys_vendor: str
    product_name: str
    product_version: str
    product_serial: str
    product_uuid: str
    board_vendor: str
    board_name: str
    board_version: str
    board_serial: str
    bios_vendor: str
    bios_version: str
    bios_date: str  # MM/DD/YYYY, as SMBIOS type 0 gives it
    chassis_type: int  # SMBIOS type 3 code: 17 main server chassis, 23 rack mount


@dataclass(frozen=True)
class NodeSpec:
    name: str  # replica name: the node name, or name-I when count > 1
    base_name: str
    index: int
    role: str
    labels: tuple[tuple[str, str], ...]
    # The kubelet's CPU, topology and memory managers (profile ``kubelet``), defaults filled
    # in; ``sandbox.runtimes.kubeletcfg`` turns them into KubeletConfiguration keys.
    topology_manager_policy: str  # none | best-effort | restricted | single-numa-node
    topology_manager_scope: str  # container | pod
    topology_manager_policy_options: tuple[tuple[str, str], ...]  # (name, value), by name
    cpu_manager_policy: str  # none | static
    cpu_manager_policy_options: tuple[tuple[str, str], ...]  # (name, "true"/"false"), by name
    reserved_system_cpus: str  # a cpulist in the kernel's form under static; "" under none
    memory_manager_policy: str  # None | Static
    reserved_memory: tuple[tuple[int, int], ...]  # (NUMA node, bytes) under Static; by node
    cpu: CpuSpec
    cpus: tuple[LogicalCpu, ...]
    numa: tuple[NumaInfo, ...]
    memory: int
    host_bridges: tuple[HostBridgeInfo, ...]
    # Every PCI function the node can ever show, in address order: bridges, the devices'
    # physical functions and every possible SR-IOV VF (enabled or not).
    pci: tuple[PciFunction, ...]
    devices: tuple[DeviceSpec, ...]
    swap: int = 0  # bytes of swap (/proc/swaps, SwapTotal); 0: none
    system: SystemSpec | None = None  # set on every replica by the resolver

    def device(self, device_id: str) -> DeviceSpec | None:
        return next((d for d in self.devices if d.id == device_id), None)

    @property
    def bridges(self) -> tuple[PciFunction, ...]:
        """The root ports and switch ports (PCI-to-PCI bridges, class 0x060400)."""
        return tuple(f for f in self.pci if f.owner is None and f.class_code == 0x060400)


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


# -- serialised form ---------------------------------------------------------------------
# A node spec (or a whole cluster) as JSON, so that every process of a sandbox can work
# from the same resolved spec instead of re-resolving the profile. docs/spec-format.md
# describes the shape; FORMAT_VERSION changes whenever a field does.

FORMAT = "hwsandbox.dev/resolved-spec"
FORMAT_VERSION = 3  # 2: DeviceSpec.nvme, GpuSpec.drm_index; 3: NodeSpec's CPU, topology
#                       and memory manager settings
_KINDS: dict[str, type[NodeSpec] | type[Cluster]] = {"NodeSpec": NodeSpec, "Cluster": Cluster}


def dump(spec: NodeSpec | Cluster) -> str:
    """The JSON text of ``spec``: ``load`` gives back an equal object."""
    kind = type(spec).__name__
    body = _encode_node(spec) if isinstance(spec, NodeSpec) else _encode(spec)
    if isinstance(spec, Cluster):
        assert isinstance(body, dict)
        body["nodes"] = [_encode_node(n) for n in spec.nodes]
    doc = {"format": FORMAT, "version": FORMAT_VERSION, "kind": kind, "spec": body}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n"


def load(text: str | bytes) -> NodeSpec | Cluster:
    """A spec written by ``dump``; SpecError (naming the field) for anything else."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise SpecError(f"not a resolved spec (not JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SpecError(f"not a resolved spec (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != FORMAT_VERSION:
        raise SpecError(f"resolved spec version {doc.get('version')!r}; this sandbox reads "
                        f"version {FORMAT_VERSION} (resolve the profile again)")
    kind = _KINDS.get(doc.get("kind"))  # type: ignore[arg-type]
    if kind is None or set(doc) != {"format", "version", "kind", "spec"}:
        raise SpecError(f"resolved spec: expected kind NodeSpec or Cluster and the keys "
                        f"format, version, kind, spec; got {sorted(doc)}")
    body = doc["spec"]
    if kind is Cluster:
        if isinstance(body, dict) and isinstance(body.get("nodes"), list):
            body = dict(body, nodes=[_expand_node(n, ("spec", "nodes", i))
                                     for i, n in enumerate(body["nodes"])])
    else:
        body = _expand_node(body, ("spec",))
    return decode(kind, body, ("spec",))  # type: ignore[no-any-return]


def load_node(text: str | bytes) -> NodeSpec:
    spec = load(text)
    if not isinstance(spec, NodeSpec):
        raise SpecError("resolved spec: a Cluster, not a NodeSpec (dump one node)")
    return spec


def read_node(path: str | os.PathLike[str], node: str | None = None,
              index: int | None = None) -> NodeSpec:
    """The node of a spec file: the file's NodeSpec (which must be ``node`` if given), or
    the node of its Cluster named ``node`` (optional when the cluster has one node)."""
    spec = _read(path)
    if isinstance(spec, NodeSpec):
        if node is not None and Cluster("", "", (spec,)).node(node, index) is None:
            raise SpecError(f"{path}: holds node {spec.name!r}, not {node!r}")
        return spec
    names = ", ".join(n.name for n in spec.nodes)
    if node is None:
        if len(spec.nodes) != 1:
            raise SpecError(f"{path}: several nodes; pick one with --node ({names})")
        return spec.nodes[0]
    found = spec.node(node, index)
    if found is None:
        raise SpecError(f"{path}: no node {node!r} (nodes: {names})")
    return found


def read_cluster(paths: Sequence[str | os.PathLike[str]], name: str = "") -> Cluster:
    """The nodes of spec files (each a NodeSpec or a Cluster) as one Cluster, in order: a
    sandbox's spec as its runtime wrote it, whole or one file per replica."""
    nodes: list[NodeSpec] = []
    description = ""
    for path in paths:
        spec = _read(path)
        if isinstance(spec, Cluster):
            nodes += spec.nodes
            name, description = name or spec.name, description or spec.description
        else:
            nodes.append(spec)
    return Cluster(name, description, tuple(nodes))


def _read(path: str | os.PathLike[str]) -> NodeSpec | Cluster:
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the resolved spec: {exc.strerror}") from None
    try:
        return load(text)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None


_PLAIN = frozenset({int, str, bool, float, type(None)})


def _encode(value: Any) -> Any:
    kind = type(value)
    if kind in _PLAIN:  # most values: checked first
        return value
    if kind is tuple:
        return [_encode(v) for v in value]
    fields = getattr(kind, "__dataclass_fields__", None)
    if fields is not None:
        return {name: _encode(getattr(value, name)) for name in fields}
    return value


def _encode_node(node: NodeSpec) -> dict[str, Any]:
    """A device's physical functions are written once, in ``pci``; the device names them
    by address."""
    body: dict[str, Any] = _encode(node)
    for d in body["devices"]:
        d["functions"] = [f["address"] for f in d["functions"]]
    return body


def _expand_node(body: Any, at: Loc) -> Any:
    if not isinstance(body, dict) or not isinstance(body.get("pci"), list):
        return body  # _decode names what is missing
    by_address = {f.get("address"): f for f in body["pci"] if isinstance(f, dict)}
    devices = body.get("devices")
    if not isinstance(devices, list):
        return body
    out = []
    for i, d in enumerate(devices):
        if isinstance(d, dict) and isinstance(d.get("functions"), list):
            missing = [a for a in d["functions"] if a not in by_address]
            if missing:
                raise SpecError(f"{where((*at, 'devices', i, 'functions'))}: "
                                f"{missing[0]!r} is not a function in pci")
            d = dict(d, functions=[by_address[a] for a in d["functions"]])
        out.append(d)
    return dict(body, devices=out)

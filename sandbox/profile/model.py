"""The profile as written: pydantic models that check types, ranges and unknown keys.

This is the single definition of the format: the loader validates against it and the
JSON Schema (``sandbox schema``) is generated from it. Cross-field rules (a NUMA node
exists, CPU lists don't overlap, VFs fit...) live in ``checks``; filling in defaults
(PCI addresses, CPU lists, serials...) lives in ``resolve``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel

API_GROUP = "hwsandbox.dev"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "HardwareProfile"

_UNITS = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}
_QUANTITY = re.compile(r"^([0-9]+)\s*(k|M|G|T|Ki|Mi|Gi|Ti)?$")


MAX_QUANTITY = 2**50  # 1 PiB: more than any node has, small enough for every consumer


def parse_quantity(value: Any) -> Any:
    """``80Gi`` -> bytes; integers pass through; anything else is left for pydantic."""
    if isinstance(value, str):
        m = _QUANTITY.match(value.strip())
        if not m:
            shown = repr(value) if len(value) <= 40 else repr(value[:37] + "...")
            raise ValueError(f"{shown} is not a quantity (like 512Mi, 80Gi, 1Ti or bytes)")
        digits = m.group(1)
        if len(digits) > 20:
            raise ValueError("more than 1Pi (1125899906842624 bytes)")
        value = int(digits) * _UNITS[m.group(2) or ""]
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_QUANTITY:
        raise ValueError("more than 1Pi (1125899906842624 bytes)")
    return value


Quantity = Annotated[
    int,
    BeforeValidator(parse_quantity),
    Field(ge=0),
    WithJsonSchema({
        "anyOf": [
            {"type": "integer", "minimum": 0},
            {"type": "string", "pattern": r"^[0-9]+\s*(k|M|G|T|Ki|Mi|Gi|Ti)?$"},
        ],
        "description": "bytes, or a quantity such as 512Mi, 80Gi, 1Ti",
    }),
]


def _hex_or_int(value: Any) -> Any:
    if isinstance(value, str) and re.fullmatch(r"0[xX][0-9a-fA-F]+", value.strip()):
        return int(value.strip(), 16)
    return value


def HexInt(maximum: int) -> Any:  # noqa: N802 - reads like a type in field declarations
    return Annotated[
        int,
        BeforeValidator(_hex_or_int),
        Field(ge=0, le=maximum),
        WithJsonSchema({
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": maximum},
                {"type": "string", "pattern": "^0[xX][0-9a-fA-F]+$"},
            ]
        }),
    ]


MAX_NUMA_NODES = 64  # one PCI host bridge each by default, out of 256 bus numbers
NO_NUMA_NODE = -1  # the kernel's NUMA_NO_NODE: what ``numaNode: none`` resolves to


def _numa_ref(value: Any) -> Any:
    """``none`` -> -1 (no NUMA affinity, sysfs ``numa_node`` -1); node ids pass through;
    a negative number is refused, so ``none`` is the one spelling of "no affinity"."""
    if value == "none":
        return NO_NUMA_NODE
    negative = isinstance(value, int) and not isinstance(value, bool) and value < 0
    if negative or (isinstance(value, str) and not value.strip().isdigit()):
        raise ValueError("must be a NUMA node id (0 or more), or none for no NUMA affinity")
    return value


# Where a PCI device, host bridge or switch sits: a NUMA node, or ``none`` for no
# affinity (laptops, most VMs, many single-socket boxes: the kernel shows numa_node -1).
NumaRef = Annotated[
    int,
    BeforeValidator(_numa_ref),
    Field(ge=NO_NUMA_NODE),
    WithJsonSchema({
        "anyOf": [{"type": "integer", "minimum": 0}, {"const": "none"}],
        "description": "a NUMA node id, or none: no NUMA affinity (numa_node -1, local_cpus "
                       "all CPUs; device plugins send no topology)",
    }),
]
Count = Annotated[int, Field(ge=1, le=1024)]
# Free text that lands in sysfs/proc files: one line, no control characters.
Text = Annotated[str, Field(pattern=r"^[^\x00-\x1f\x7f]*$", max_length=256)]
# Names that become path components: never empty, never starting with '.', no '/'.
DriverName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$", max_length=64)]
DevNodeName = Annotated[str, Field(
    pattern=r"^[A-Za-z0-9_+{}-][A-Za-z0-9_.+{}-]*(/[A-Za-z0-9_+{}-][A-Za-z0-9_.+{}-]*)*$",
    max_length=255)]
# Kubernetes label syntax: [dns-subdomain/]name, value a name or empty.
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LabelKey = Annotated[str, Field(pattern=LABEL_KEY_PATTERN, max_length=317)]
LabelValue = Annotated[str, Field(pattern=r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")]
Name = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]
PciAddress = Annotated[
    str, Field(pattern=r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-1][0-9a-fA-F]\.[0-7]$")
]
Health = Literal["healthy", "unhealthy"]
HealthReason = Literal["aer-fatal", "link-down", "port-down", "removed", "row-remap-pending",
                       "row-remap-failure", "ecc-contained", "ecc-uncontained"]  # fakehw Reason


def _limits_text(text: str) -> Callable[..., None]:
    """A JSON Schema hook: ``text`` as the description, its ``{MAX_...}`` filled in from
    ``sandbox.profile.resolve.limits`` (what the resolver enforces) when the schema is
    generated; not at import time, as the resolver imports this module."""

    def hook(schema: dict[str, Any], *_cls: Any) -> None:
        from sandbox.profile.resolve import limits

        schema["description"] = text.format(**{k: f"{v:,}".replace(",", "")
                                                 for k, v in vars(limits).items()
                                                 if k.startswith("MAX_")})

    return hook


class Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        populate_by_name=True,
        strict=False,
    )


class Metadata(Strict):
    name: Name
    description: Annotated[str, Field(max_length=4096)] = ""


class Cpu(Strict):
    """sockets x coresPerSocket x threadsPerCore may be at most ``limits.MAX_CPUS``."""

    model_config = ConfigDict(json_schema_extra=_limits_text(
        "sockets x coresPerSocket x threadsPerCore may be at most {MAX_CPUS} logical CPUs."))

    sockets: Annotated[int, Field(ge=1, le=16)] = 1
    cores_per_socket: Annotated[int, Field(ge=1, le=512)] = 4
    threads_per_core: Annotated[int, Field(ge=1, le=8)] = 1
    vendor: Text = "GenuineIntel"
    model: Text = "Intel(R) Xeon(R) Platinum 8480+"
    family: Annotated[int, Field(ge=0)] = 6
    model_number: Annotated[int, Field(ge=0)] = 143
    mhz: Annotated[int, Field(ge=1)] = 2000


class NumaNode(Strict):
    id: Annotated[int, Field(ge=0, lt=MAX_NUMA_NODES)]
    cpus: str | None = Field(None, description="cpulist like 0-15,32-47; derived if omitted")
    memory: Quantity | None = None
    hugepages: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="page size (2Mi, 1Gi) -> number of pages"
    )


class Numa(Strict):
    nodes: Annotated[list[NumaNode], Field(max_length=MAX_NUMA_NODES)] | None = None
    distances: list[list[int]] | None = Field(
        None, description="distance matrix; default 10 local, 21 remote"
    )


class HostBridge(Strict):
    domain: HexInt(0xFFFF) = 0  # type: ignore[valid-type]
    bus: HexInt(0xFF)  # type: ignore[valid-type]
    numa_node: NumaRef


class Switch(Strict):
    name: Name
    numa_node: NumaRef


class RootComplex(Strict):
    """The host bridge function at 0000:00:00.0 (class 0x060000) on host bridge
    pci0000:00; its NUMA node is that host bridge's."""

    vendor_id: HexInt(0xFFFF)  # type: ignore[valid-type]
    device_id: HexInt(0xFFFF)  # type: ignore[valid-type]


class Pci(Strict):
    host_bridges: list[HostBridge] | None = Field(
        None, description="one per NUMA node by default"
    )
    root_complex: RootComplex | None = Field(
        None, description="ids of the host bridge function 0000:00:00.0; default the CPU "
        "vendor's root complex (Intel 8086:2020, AMD 1022:1480)")
    switches: list[Switch] = Field(default_factory=list)


class DeviceBase(Strict):
    count: Count = 1
    numa_node: NumaRef = 0
    name: Name | None = Field(None, description="id prefix; default the device type")
    pci_addresses: list[PciAddress] | None = Field(
        None, description="one per device; assigned deterministically if omitted"
    )
    switch: Name | None = Field(None, description="place the devices behind this PCI switch")
    health: Health = "healthy"
    health_reason: HealthReason | None = None


class PartitionProfile(Strict):
    name: Annotated[str, Field(pattern=r"^[0-9a-z][0-9a-z.+-]*$")]
    memory_slices: Annotated[int, Field(ge=1)]
    compute_slices: Annotated[int, Field(ge=1)]
    memory: Quantity | None = Field(None, description="default: share of the device memory")


class Partitions(Strict):
    memory_slices: Annotated[int, Field(ge=1, le=64)] | None = None
    compute_slices: Annotated[int, Field(ge=1, le=64)] | None = None
    profiles: list[PartitionProfile] = Field(min_length=1)
    modes: list[Literal["mig", "vgpu"]] = Field(default_factory=lambda: ["mig"])  # type: ignore[arg-type]


class Sriov(Strict):
    total_vfs: Annotated[int, Field(ge=0, le=256)] | None = Field(None, alias="totalVFs")
    num_vfs: Annotated[int, Field(ge=0, le=256)] = Field(0, alias="numVFs")
    vf_driver: Literal["vfio-pci"] | None = Field(
        None, alias="vfDriver",
        description="NICs: the VFs' driver instead of the model's (vfio-pci: as for DPDK or "
                    "a VM, no netdev, a /dev/vfio/<group> each)")


class Gpu(DeviceBase):
    type: Literal["gpu"]
    vendor: Literal["nvidia", "amd", "intel"]
    model: Text
    memory: Quantity | None = None
    partitions: Partitions | None = None
    sriov: Sriov | None = Field(None, description="SR-IOV VFs (Intel Flex/Max GPUs)")
    drm: bool = Field(False, description="NVIDIA: nvidia-drm's DRM nodes (cardN, renderD*); "
                      "off as on most datacenter nodes. AMD and Intel GPUs always have them")


class Nic(DeviceBase):
    type: Literal["nic"]
    vendor: Literal["mellanox", "intel"]
    model: Text
    ports: Annotated[int, Field(ge=1, le=4)] = 1
    speed: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Mb/s per port, as /sys/class/net/*/speed"
    )
    mac_base: Annotated[str, Field(pattern=r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")] | None = None
    sriov: Sriov | None = None
    link_layer: Literal["ethernet", "infiniband"] = "ethernet"
    rdma: bool | None = Field(None, description="default: true where the model supports it")


class Fpga(DeviceBase):
    type: Literal["fpga"]
    vendor: Literal["intel", "xilinx"]
    model: Text
    ports: Annotated[int, Field(ge=1, le=8)] | None = None
    afu_ids: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] | None = None


class Nvme(DeviceBase):
    type: Literal["nvme"]
    vendor: Literal["samsung", "intel", "kioxia"]
    model: Text
    capacity: Quantity | None = Field(
        None, description="bytes over all namespaces; default the model's stated capacity")
    namespaces: Annotated[int, Field(ge=1, le=16)] = Field(
        1, description="namespaces nvmeXn1..nvmeXnN, the capacity split evenly")
    lba_size: Literal[512, 4096] = Field(
        512, description="the namespaces' logical block size in bytes")


class DevNode(Strict):
    name: DevNodeName
    major: Annotated[int, Field(ge=0, le=4095)]
    minor: Annotated[int, Field(ge=0, le=1048575)]


class Generic(DeviceBase):
    type: Literal["generic"]
    vendor_id: HexInt(0xFFFF)  # type: ignore[valid-type]
    device_id: HexInt(0xFFFF)  # type: ignore[valid-type]
    class_code: HexInt(0xFFFFFF)  # type: ignore[valid-type]
    model: Text = "generic PCI device"
    driver: DriverName | None = None
    dev_nodes: list[DevNode] = Field(
        default_factory=list,
        description="per device; '{i}' in a name is replaced by the device index",
    )


Device = Annotated[Gpu | Nic | Fpga | Nvme | Generic, Field(discriminator="type")]


def _option_bool(value: Any) -> Any:
    """A kubelet policy option's on/off value: a YAML boolean or the text the kubelet
    itself takes (its options are a map[string]string)."""
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise ValueError("must be true or false")


OptionBool = Annotated[
    bool,
    BeforeValidator(_option_bool),
    WithJsonSchema({"anyOf": [{"type": "boolean"}, {"enum": ["true", "false"]}]}),
]


class CpuManagerPolicyOptions(Strict):
    """The static CPU manager's policy options (Kubernetes 1.37). Alpha and beta ones need
    the kubelet's CPUManagerPolicyAlphaOptions / CPUManagerPolicyBetaOptions gates."""

    model_config = ConfigDict(populate_by_name=False)  # the kubelet's names only

    full_pcpus_only: OptionBool | None = Field(None, alias="full-pcpus-only")
    distribute_cpus_across_numa: OptionBool | None = Field(
        None, alias="distribute-cpus-across-numa")
    align_by_socket: OptionBool | None = Field(None, alias="align-by-socket")
    distribute_cpus_across_cores: OptionBool | None = Field(
        None, alias="distribute-cpus-across-cores")
    strict_cpu_reservation: OptionBool | None = Field(None, alias="strict-cpu-reservation")
    prefer_align_cpus_by_uncorecache: OptionBool | None = Field(
        None, alias="prefer-align-cpus-by-uncorecache")


class TopologyManagerPolicyOptions(Strict):
    """The topology manager's policy options (Kubernetes 1.37)."""

    model_config = ConfigDict(populate_by_name=False)  # the kubelet's names only

    prefer_closest_numa_nodes: OptionBool | None = Field(None, alias="prefer-closest-numa-nodes")
    max_allowable_numa_nodes: Annotated[int, Field(ge=8, le=1024), WithJsonSchema({
        "anyOf": [{"type": "integer", "minimum": 8, "maximum": 1024},
                  {"type": "string", "pattern": "^[0-9]+$"}]})] | None = Field(
        None, alias="max-allowable-numa-nodes",
        description="at least 8 (the kubelet's own limit); default: the node's NUMA node "
        "count when that is more than 8 and the policy is not none")


class ReservedMemory(Strict):
    numa_node: Annotated[int, Field(ge=0)]
    memory: Quantity = Field(description="whole MiB, like 512Mi or 1Gi")


class Kubelet(Strict):
    topology_manager_policy: Literal[
        "none", "best-effort", "restricted", "single-numa-node"
    ] = "best-effort"
    topology_manager_scope: Literal["container", "pod"] = "container"
    topology_manager_policy_options: TopologyManagerPolicyOptions | None = None
    cpu_manager_policy: Literal["none", "static"] = Field(
        "static", description="static by default: under none the kubelet writes every "
        "emulated CPU into the kubepods cpuset itself, which the host kernel refuses (ERANGE) "
        "when the emulated node has more CPUs than the host, so the kubelet cannot start; "
        "static never writes that cpuset. A node of one CPU that states none of the CPU "
        "manager's settings gets none (static would reserve its only CPU)")
    cpu_manager_policy_options: CpuManagerPolicyOptions | None = Field(
        None, description="static only")
    reserved_system_cpus: Annotated[str, Field(max_length=4096)] | None = Field(
        None, alias="reservedSystemCPUs",
        description="static only: cpulist (like 0 or 0,32) of the node's CPUs kept for the "
        "system, at least one and not all; default 0")
    memory_manager_policy: Literal["None", "Static"] = "None"
    reserved_memory: Annotated[list[ReservedMemory], Field(max_length=MAX_NUMA_NODES)] | None = (
        Field(None, description="Static only: memory per NUMA node kept for the system; "
              "default 512Mi on NUMA node 0"))


class Board(Strict):
    vendor: Text | None = Field(None, description="default: the system vendor")
    name: Text | None = None
    version: Text | None = None


class Bios(Strict):
    vendor: Text | None = None
    version: Text | None = None
    date: Annotated[str, Field(
        pattern=r"^(0[1-9]|1[0-2])/(0[1-9]|[12][0-9]|3[01])/[0-9]{4}$")] | None = Field(
        None, description="MM/DD/YYYY, as SMBIOS gives it")


class System(Strict):
    """The machine's DMI identity (sys/devices/virtual/dmi/id); what is omitted defaults
    to a real server model for the CPU vendor."""

    vendor: Text | None = Field(None, description="sys_vendor, e.g. Dell Inc.")
    product: Text | None = Field(None, description="product_name, e.g. PowerEdge XE9680")
    version: Text | None = Field(None, description="product_version")
    board: Board | None = None
    bios: Bios | None = None
    chassis_type: Annotated[int, Field(ge=1, le=0x24)] | None = Field(
        None, description="SMBIOS chassis type code: 17 main server chassis (default), "
        "23 rack mount chassis")


class Node(Strict):
    name: Name
    count: Annotated[int, Field(ge=1, le=64)] = 1
    role: Literal["control-plane", "worker"] = "worker"
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    kubelet: Kubelet = Field(default_factory=Kubelet)
    cpu: Cpu = Field(default_factory=Cpu)
    memory: Quantity | None = Field(None, description="total; default 16Gi per NUMA node")
    swap: Quantity | None = Field(None, description="swap space (/proc/swaps, SwapTotal); "
                                  "default none")
    system: System | None = None
    numa: Numa = Field(default_factory=lambda: Numa())
    pci: Pci = Field(default_factory=lambda: Pci())
    devices: list[Device] = Field(
        default_factory=list,
        json_schema_extra=_limits_text(
            "at most {MAX_DEVICES} devices (the sum of counts) and {MAX_FUNCTIONS} PCI "
            "functions (every possible SR-IOV VF included) per node"))


class Profile(Strict):
    api_version: Literal["hwsandbox.dev/v1alpha1"]
    kind: Literal["HardwareProfile"]
    metadata: Metadata
    nodes: list[Node] = Field(min_length=1, max_length=64, json_schema_extra=_limits_text(
        "at most {MAX_NODES} nodes, replicas (count) included"))

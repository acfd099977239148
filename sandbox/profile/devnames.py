"""Which /dev names, device numbers and sysfs class names the drivers the sandbox emulates
own, and the check of a profile's generic ``devNodes`` against them.

A generic device's ``devNodes`` are the only /dev paths and numbers a profile chooses
itself. On a real machine a driver owns its names (``nvidiaN``, ``dri/``), its char major
(one driver per major, but for the shared ``mem`` and ``misc`` majors, where it owns
minors) and its sysfs class; another device cannot take them. So a generic devNode is
refused, located at its entry, when it takes a name, a directory, a major or a class of a
driver that is on the node (or always there: mem, misc's vfio, the block and net classes),
or when two generic devNodes clash with each other (one used as the other's directory, one
number under two names). The check needs no tree: it is part of resolving, and the builder
renders only what passed it (tests/fakehw/test_devnames.py compares this table with every
tree the test profiles build, so a new node or class in the builder must be added here).

The majors are the builder's: it imports them from here. Those the kernel hands out
dynamically are the values a typical machine shows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from sandbox.profile.spec import DeviceSpec, NodeSpec

MEM_MAJOR = 1  # /dev/null, zero, full, random, urandom: the mem driver's whole major
MISC_MAJOR = 10
VFIO_MINOR = 196  # misc: /dev/vfio/vfio
RDMA_CM_MINOR = 120  # misc, dynamic: /dev/infiniband/rdma_cm
NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
DRM_MAJOR = 226
IB_MAJOR = 231
KFD_MAJOR = 234  # dynamic on a real system
NVIDIA_UVM_MAJOR = 235  # dynamic
NVIDIA_CAPS_MAJOR = 237  # dynamic
DFL_FME_MAJOR = 239  # dynamic
DFL_PORT_MAJOR = 240  # dynamic
NVME_CHAR_MAJOR = 241  # dynamic
UMAD_DYNAMIC_MAJOR = 243  # dynamic: umad/issm past the first 64
UVERBS_DYNAMIC_MAJOR = 244  # dynamic: uverbs past the first 32
VFIO_GROUP_MAJOR = 245  # dynamic
BLOCK_EXT_MAJOR = 259  # block: extended minors (NVMe namespaces)


@dataclass(frozen=True)
class Driver:
    """What one emulated driver owns while it is on a node."""

    name: str  # as messages say it: "the nvidia driver"
    names: tuple[str, ...] = ()  # /dev names (regular expressions over the whole path)
    dirs: tuple[str, ...] = ()  # /dev directories: everything below them
    majors: tuple[int, ...] = ()  # char majors, whole
    numbers: tuple[tuple[int, int], ...] = ()  # char (major, minor) pairs
    classes: tuple[str, ...] = ()  # sys/class names
    chrdevs: tuple[tuple[int, str], ...] = ()  # its lines of /proc/devices: (major, name)


def _nvidia(n: NodeSpec) -> bool:
    return any(d.gpu is not None and d.vendor == "nvidia" for d in n.devices)


def _drm(n: NodeSpec) -> bool:
    return any(d.gpu is not None and d.gpu.drm_index >= 0 for d in n.devices)


def _amd(n: NodeSpec) -> bool:
    return any(d.gpu is not None and d.vendor == "amd" for d in n.devices)


def _rdma(n: NodeSpec) -> bool:
    return any(d.nic is not None and d.nic.rdma for d in n.devices)


def _dfl(n: NodeSpec) -> bool:
    return any(d.fpga is not None and d.fpga.flavor == "dfl" for d in n.devices)


def _fpga(n: NodeSpec) -> bool:
    return any(d.fpga is not None for d in n.devices)


def _nvme(n: NodeSpec) -> bool:
    return any(d.nvme is not None for d in n.devices)


def _vfio_groups(n: NodeSpec) -> bool:
    return any(f.driver == "vfio-pci" for f in n.pci)


def _always(_n: NodeSpec) -> bool:
    return True


# (whether the driver is on the node, what it owns). Class names also cover the entries of
# a PCI function's directory (a generic node's class directory is made there).
DRIVERS = (
    (_always, Driver("the mem driver", names=("null", "zero", "full", "random", "urandom"),
                     majors=(MEM_MAJOR,), classes=("mem",), chrdevs=((MEM_MAJOR, "mem"),))),
    (_always, Driver("the vfio driver", dirs=("vfio",), numbers=((MISC_MAJOR, VFIO_MINOR),),
                     classes=("misc", "vfio"), chrdevs=((MISC_MAJOR, "misc"),))),
    (_always, Driver("the kernel", dirs=("char", "block"),
                     classes=("block", "net", "dmi", "iommu"))),
    (_vfio_groups, Driver("the vfio-pci driver", majors=(VFIO_GROUP_MAJOR,),
                          chrdevs=((VFIO_GROUP_MAJOR, "vfio"),))),
    (_nvidia, Driver("the nvidia driver", names=(r"nvidia.*",), dirs=("nvidia-caps",),
                     majors=(NVIDIA_MAJOR, NVIDIA_UVM_MAJOR, NVIDIA_CAPS_MAJOR),
                     chrdevs=((NVIDIA_MAJOR, "nvidia-frontend"), (NVIDIA_UVM_MAJOR, "nvidia-uvm"),
                              (NVIDIA_CAPS_MAJOR, "nvidia-caps")))),
    (_drm, Driver("the drm driver", dirs=("dri",), majors=(DRM_MAJOR,), classes=("drm",),
                  chrdevs=((DRM_MAJOR, "drm"),))),
    (_amd, Driver("the amdkfd driver", names=("kfd",), majors=(KFD_MAJOR,), classes=("kfd",),
                  chrdevs=((KFD_MAJOR, "kfd"),))),
    (_rdma, Driver("the ib_core driver", dirs=("infiniband",),
                   majors=(IB_MAJOR, UMAD_DYNAMIC_MAJOR, UVERBS_DYNAMIC_MAJOR),
                   numbers=((MISC_MAJOR, RDMA_CM_MINOR),),
                   classes=("infiniband", "infiniband_mad", "infiniband_verbs"),
                   chrdevs=((IB_MAJOR, "infiniband_mad"), (IB_MAJOR, "infiniband_verbs"),
                            (UMAD_DYNAMIC_MAJOR, "infiniband_mad"),
                            (UVERBS_DYNAMIC_MAJOR, "infiniband_verbs")))),
    (_dfl, Driver("the dfl driver", names=(r"dfl-fme\.\d+", r"dfl-port\.\d+"),
                  majors=(DFL_FME_MAJOR, DFL_PORT_MAJOR),
                  chrdevs=((DFL_FME_MAJOR, "dfl-fme"), (DFL_PORT_MAJOR, "dfl-port")))),
    (_fpga, Driver("the fpga-region driver", classes=("fpga_region",))),
    (_nvme, Driver("the nvme driver", names=(r"nvme\d+(n\d+)?",), majors=(NVME_CHAR_MAJOR,),
                   classes=("nvme", "nvme-subsystem"), chrdevs=((NVME_CHAR_MAJOR, "nvme"),))),
)

# What the builder puts in a PCI function's directory besides class directories: a generic
# node's class directory there may not take one of these names.
PCI_FUNCTION_ENTRIES = frozenset({
    "aer_dev_correctable", "aer_dev_fatal", "aer_dev_nonfatal", "ari_enabled",
    "available_compute_partition", "available_memory_partition", "broken_parity_status",
    "class", "config", "consistent_dma_mask_bits", "current_compute_partition",
    "current_link_speed", "current_link_width", "current_memory_partition",
    "d3cold_allowed", "device", "dma_mask_bits", "driver", "driver_override", "enable",
    "gpu_busy_percent", "iommu_group", "irq", "local_cpulist", "local_cpus",
    "max_link_speed", "max_link_width", "mem_info_vram_total", "mem_info_vram_used",
    "modalias", "msi_bus", "numa_node", "physfn", "power_state", "product_name", "remove",
    "rescan", "resource", "revision", "secondary_bus_number", "serial_number",
    "sriov_drivers_autoprobe", "sriov_numvfs", "sriov_offset", "sriov_stride",
    "sriov_totalvfs", "sriov_vf_device", "subordinate_bus_number", "subsystem",
    "subsystem_device", "subsystem_vendor", "uevent", "unique_id", "vendor",
})
_VIRTFN = re.compile(r"virtfn\d+")


def node_class(name: str) -> tuple[str, str]:
    """(class, base) of a generic devNode: ``accel/accel0`` is class ``accel``; a bare name
    has class ``generic``; a deeper path joins its directories with ``!`` (as the kernel
    names a class device whose name has a '/')."""
    cls, _, base = name.rpartition("/")
    return cls.replace("/", "!") or "generic", base


def owners(node: NodeSpec) -> list[Driver]:
    """The drivers on ``node``."""
    return [driver for present, driver in DRIVERS if present(node)]


def name_owner(path: str, drivers: list[Driver]) -> str | None:
    parts = path.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    for driver in drivers:
        if parts[0] in driver.dirs:
            return f"/dev/{parts[0]}/ belongs to {driver.name}"
        for prefix in prefixes:
            if any(re.fullmatch(p, prefix) for p in driver.names):
                what = "is" if prefix == path else f"is below /dev/{prefix}, which is"
                return f"/dev/{path} {what} a node of {driver.name}"
    return None


def number_owner(major: int, minor: int, drivers: list[Driver]) -> tuple[str, str] | None:
    """(the field to blame, why) when a driver owns char ``major:minor``."""
    for driver in drivers:
        if major in driver.majors:
            return "major", f"char major {major} belongs to {driver.name}"
        if (major, minor) in driver.numbers:
            return "minor", f"char {major}:{minor} is {driver.name}'s"
    return None


def class_owner(cls: str, drivers: list[Driver]) -> str | None:
    if cls in PCI_FUNCTION_ENTRIES or _VIRTFN.fullmatch(cls):
        return f"its class directory {cls!r} would be the PCI function's own {cls!r} entry"
    for driver in drivers:
        if cls in driver.classes:
            return f"sysfs class {cls!r} belongs to {driver.name}"
    return None


def dev_node_problems(node: NodeSpec) -> Iterator[tuple[DeviceSpec, int, str, str]]:
    """(device, index in its devNodes, field, message) for every generic devNode of
    ``node`` that takes what a driver on the node owns, or clashes with another generic
    devNode (two generic devices naming the same node share it, as the builder does)."""
    drivers = owners(node)
    nodes: dict[str, tuple[int, int]] = {}  # path -> numbers, first naming wins
    numbers: dict[tuple[int, int], str] = {}  # numbers -> path
    for d in node.devices:
        if d.generic is None:
            continue
        for k, n in enumerate(d.generic.dev_nodes):
            why = name_owner(n.name, drivers)
            if why is not None:
                yield d, k, "name", why
                continue
            why = class_owner(node_class(n.name)[0], drivers)
            if why is not None:
                yield d, k, "name", f"/dev/{n.name}: {why}"
                continue
            owned = number_owner(n.major, n.minor, drivers)
            if owned is not None:
                yield d, k, *owned
                continue
            if n.name in nodes:
                continue  # shared with an earlier generic devNode of that name
            clash = next((p for p in nodes if p.startswith(n.name + "/")
                          or n.name.startswith(p + "/")), None)
            if clash is not None:
                inner, outer = sorted((clash, n.name), key=len)
                yield d, k, "name", (f"/dev/{inner} is a device node and the directory of "
                                     f"/dev/{outer}")
                continue
            other = numbers.get((n.major, n.minor))
            if other is not None:
                yield d, k, "minor", (f"char {n.major}:{n.minor} is already /dev/{other} "
                                      "(one number, one node)")
                continue
            nodes[n.name] = (n.major, n.minor)
            numbers[(n.major, n.minor)] = n.name

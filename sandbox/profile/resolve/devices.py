"""Devices of a profile entry: their catalogue model with the profile's overrides, checked
(model names, SR-IOV, partitions, RDMA), and drafted before their PCI placement and
replica identities are known. Kernel minors follow PCI address order (probe order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from sandbox.profile import catalogue, model
from sandbox.profile.spec import (
    DevNodeSpec,
    FpgaSpec,
    GenericSpec,
    GpuSpec,
    Loc,
    NicSpec,
    NvmeSpec,
    PartitionProfileSpec,
    PartitionSpec,
    PciFunction,
)

_T = TypeVar("_T")
Problems = list[tuple[Loc, str]]

# A device entry's id prefix (``name``) when it states none, by type: gpu0, nic1, dev0...
DEFAULT_NAMES = {"gpu": "gpu", "nic": "nic", "fpga": "fpga", "nvme": "nvme", "generic": "dev"}


def _size(n: int) -> str:
    from sandbox.textui import size

    return size(n)


@dataclass
class Draft:
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
    nvme: NvmeSpec | None = None
    generic: GenericSpec | None = None
    mac_base: str | None = None


@dataclass
class DeviceModel:
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
    nvme: catalogue.NvmeModel | None = None

    @staticmethod
    def of(dev: model.Device, dloc: Loc, problems: list[tuple[Loc, str]]) -> DeviceModel | None:
        prefix = dev.name or DEFAULT_NAMES[dev.type]
        if isinstance(dev, model.Generic):
            return DeviceModel(
                prefix, dev.vendor_id, dev.device_id, dev.vendor_id, 0,
                dev.class_code, 0, dev.driver, 1, 0, "8.0 GT/s PCIe", 8, dev.model,
            )
        tables: dict[str, Mapping[str, Mapping[str, object]]] = {
            "gpu": catalogue.GPUS, "nic": catalogue.NICS, "fpga": catalogue.FPGAS,
            "nvme": catalogue.NVMES,
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
                check_partitions(dev, entry, memory, dloc, problems)
            gpu_vfs = check_sriov(dev.sriov, entry.max_vfs, entry.name, dloc, problems)
            if dev.sriov is not None and dev.sriov.vf_driver is not None:
                problems.append(((*dloc, "sriov", "vfDriver"),
                                 "only a NIC's VFs can be bound to another driver"))
            return DeviceModel(
                prefix, entry.vendor_id, entry.device_id, entry.subsystem_vendor_id,
                entry.subsystem_device_id, entry.class_code, 0xA1 if dev.vendor == "nvidia" else 0,
                entry.driver, 1, gpu_vfs, entry.link_speed, entry.link_width, entry.name,
                gpu=entry,
            )
        if isinstance(dev, model.Nic):
            assert isinstance(entry, catalogue.NicModel)
            total = check_sriov(dev.sriov, entry.max_vfs, entry.name, dloc, problems)
            if dev.link_layer == "infiniband" and dev.vendor != "mellanox":
                problems.append(((*dloc, "linkLayer"), "InfiniBand needs a mellanox NIC"))
            if dev.rdma and not entry.rdma:
                problems.append(((*dloc, "rdma"), f"{entry.name} has no RDMA"))
            class_code = 0x020700 if dev.link_layer == "infiniband" else entry.class_code
            return DeviceModel(
                prefix, entry.vendor_id, entry.device_id, entry.vendor_id,
                0x0001, class_code, 0, entry.driver, dev.ports, total, entry.link_speed,
                entry.link_width, entry.name, nic=entry,
            )
        if isinstance(dev, model.Nvme):
            assert isinstance(entry, catalogue.NvmeModel)
            capacity = dev.capacity if dev.capacity is not None else entry.capacity
            if capacity // dev.namespaces < dev.lba_size:
                problems.append(
                    ((*dloc, "capacity"), f"{_size(capacity)} leaves no block for each of "
                     f"{dev.namespaces} namespace(s)")
                )
            return DeviceModel(
                prefix, entry.vendor_id, entry.device_id,
                entry.subsystem_vendor_id, entry.subsystem_device_id, catalogue.NVME_CLASS, 0,
                "nvme", 1, 0, entry.link_speed, entry.link_width, entry.name, nvme=entry,
            )
        assert isinstance(dev, model.Fpga)
        assert isinstance(entry, catalogue.FpgaModel)
        ports = dev.ports if dev.ports is not None else entry.ports
        if dev.afu_ids is not None and len(dev.afu_ids) != ports:
            problems.append(
                ((*dloc, "afuIds"), f"gives {len(dev.afu_ids)} AFU ids for {ports} ports")
            )
        return DeviceModel(
            prefix, entry.vendor_id, entry.device_id, entry.vendor_id, 0,
            entry.class_code, 0, entry.driver, 1, 0, "8.0 GT/s PCIe", 16, entry.name, fpga=entry,
        )

    def draft(self, dev: model.Device, dloc: Loc, functions: list[PciFunction],
              vf_addresses: list[tuple[str, ...]], vf_groups: list[tuple[int, ...]]) -> Draft:
        d = Draft(
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
                memory, partition_spec(dev, self.gpu, memory), 0, 0,
                self.gpu.gfx_target_version, self.gpu.simd_count,
                total_vfs=self.total_vfs, num_vfs=dev.sriov.num_vfs if dev.sriov else 0,
                vf_addresses=vf_addresses[0] if vf_addresses else (),
                vf_iommu_groups=vf_groups[0] if vf_groups else (),
                drm_index=0 if dev.drm or dev.vendor != "nvidia" else -1,
            )
        elif isinstance(dev, model.Nic):
            assert self.nic is not None
            rdma = dev.rdma if dev.rdma is not None else self.nic.rdma
            d.nic = NicSpec(
                ports=dev.ports, speed=dev.speed or self.nic.speed, link_layer=dev.link_layer,
                rdma=rdma or dev.link_layer == "infiniband", macs=(), netdevs=(), rdma_devs=(),
                total_vfs=self.total_vfs, num_vfs=dev.sriov.num_vfs if dev.sriov else 0,
                vf_device_id=self.nic.vf_device_id,
                vf_driver=(dev.sriov.vf_driver if dev.sriov and dev.sriov.vf_driver
                           else self.nic.vf_driver),
                vf_addresses=tuple(vf_addresses), vf_iommu_groups=tuple(vf_groups),
                node_guids=(),
            )
            d.mac_base = dev.mac_base
        elif isinstance(dev, model.Fpga):
            assert self.fpga is not None
            ports = dev.ports if dev.ports is not None else self.fpga.ports
            afus = tuple(dev.afu_ids) if dev.afu_ids else (self.fpga.afu_id,) * ports
            d.fpga = FpgaSpec(self.fpga.flavor, ports, afus, self.fpga.bitstream_id, 0, 0)
        elif isinstance(dev, model.Nvme):
            assert self.nvme is not None
            n = self.nvme
            capacity = dev.capacity if dev.capacity is not None else n.capacity
            d.nvme = NvmeSpec(capacity, dev.namespaces, dev.lba_size, n.name, n.firmware,
                              n.serial_prefix, 0, 0)
        else:
            assert isinstance(dev, model.Generic)
            d.generic = GenericSpec(tuple(DevNodeSpec(n.name, n.major, n.minor)
                                          for n in dev.dev_nodes))
        return d


def device_model(dev: model.Device, dloc: Loc, problems: Problems) -> DeviceModel | None:
    """The device's model, after every check that reads nothing but the entry itself (the
    loader still runs these on a device whose node did not validate)."""
    if dev.health == "healthy" and dev.health_reason is not None:
        problems.append(((*dloc, "healthReason"), "a healthReason needs health: unhealthy"))
    if dev.health == "unhealthy" and dev.health_reason is not None:
        vendor = getattr(dev, "vendor", None)
        shown = catalogue.fault_reasons(dev.type, vendor)
        if dev.health_reason not in shown:
            problems.append(((*dloc, "healthReason"),
                             f"a{'' if vendor is None else ' ' + vendor} {dev.type} cannot "
                             f"show {dev.health_reason} (it shows {', '.join(shown)})"))
    if dev.pci_addresses is not None and len(dev.pci_addresses) != dev.count:
        problems.append(
            ((*dloc, "pciAddresses"),
             f"gives {len(dev.pci_addresses)} addresses for count {dev.count}")
        )
        return None
    return DeviceModel.of(dev, dloc, problems)


def check_sriov(sriov: model.Sriov | None, max_vfs: int, name: str, dloc: Loc,
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


def check_partitions(dev: model.Gpu, entry: catalogue.GpuModel, memory: int, dloc: Loc,
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


def partition_spec(dev: model.Gpu, entry: catalogue.GpuModel, memory: int) -> PartitionSpec | None:
    p = dev.partitions
    if p is None:
        return None
    mslices = p.memory_slices or entry.memory_slices
    cslices = p.compute_slices or entry.compute_slices
    if not mslices or not cslices:
        return None  # reported by check_partitions
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


def number_minors(drafts: list[Draft]) -> None:
    """Kernel-style numbering: minors follow PCI address order, like driver probe order."""
    by_addr = sorted(drafts, key=lambda d: d.functions[0].address)
    nvidia = 0
    drm = 0
    for d in by_addr:
        if d.gpu is None:
            continue
        if d.vendor == "nvidia":
            has_drm = d.gpu.drm_index >= 0  # nvidia-drm: DRM minors in the same sequence
            d.gpu = replace(d.gpu, minor=nvidia, render_minor=128 + drm if has_drm else 0,
                            drm_index=drm if has_drm else -1)
            nvidia += 1
            drm += has_drm
        else:
            d.gpu = replace(d.gpu, minor=drm, render_minor=128 + drm, drm_index=drm)
            drm += 1
    controller = block_minor = 0
    for d in by_addr:  # nvmeN in probe order; block minors 259:k over every namespace
        if d.nvme is not None:
            d.nvme = replace(d.nvme, controller=controller, first_minor=block_minor)
            controller += 1
            block_minor += d.nvme.namespaces
    # dfl-fme.N, dfl-port.N and the cards' fpga_regionN: each its own id space (an IDA in
    # drivers/fpga) over the DFL cards alone; an FPGA without DFL (Xilinx's xclmgmt) has
    # none of them and takes no number (-1), wherever it sits between DFL cards.
    region = port = 0
    for d in by_addr:
        if d.fpga is None:
            continue
        if d.fpga.flavor != "dfl":
            d.fpga = replace(d.fpga, region=-1, first_port=-1)
            continue
        d.fpga = replace(d.fpga, region=region, first_port=port)
        region += 1
        port += d.fpga.ports


def replace(obj: _T, **changes: Any) -> _T:
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]



"""PCI functions as profile devices: bridges and SR-IOV VFs are left out; the functions
the catalogue knows become GPUs, NICs (the functions of one slot are its ports), FPGAs and
NVMe drives; every other function is a ``generic`` device with its raw ids. Consecutive
identical entries are merged with ``count``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sandbox.capture.reading import (
    PCI_DIR,
    Function,
    Root,
    quantity,
    read_function,
)
from sandbox.errors import CaptureError
from sandbox.profile import catalogue, model
from sandbox.profile.resolve import limits

_MAC = re.compile(r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")
_DRIVER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
_BRIDGE_BASE_CLASS = 0x06
ROOT_COMPLEX_ADDRESS = "0000:00:00.0"
_OTHER_BRIDGE_CLASS = 0x0680  # "other bridge": real devices (NVSwitch, chipset functions)
_NIC_BASE_CLASS = 0x02
_IB_CLASS = 0x020700
_GPU_VENDORS = {catalogue.NVIDIA: "nvidia", catalogue.AMD: "amd", catalogue.INTEL: "intel"}
_NIC_VENDORS = {catalogue.MELLANOX: "mellanox", catalogue.INTEL: "intel"}
_FPGA_VENDORS = {catalogue.INTEL: "intel", catalogue.XILINX: "xilinx"}
# NVMe drives, where this version's profile has the type (catalogue.NVMES).
_NVMES: dict[str, Any] = getattr(catalogue, "NVMES", {})
_NVME_CLASS: int = getattr(catalogue, "NVME_CLASS", 0x010802)



@dataclass(frozen=True)
class Hex:
    value: int
    digits: int



@dataclass
class Entry:
    """One profile device entry (count 1 until merged) and the functions it stands for."""

    fields: dict[str, Any]
    functions: list[Function]
    comment: str
    count: int = 1
    addresses: list[str] = field(default_factory=list)  # first function of each device



def _gpu_model(fn: Function) -> tuple[str, str] | None:
    vendor = _GPU_VENDORS.get(fn.vendor)
    if vendor is None:
        return None
    for key, m in catalogue.GPUS.get(vendor, {}).items():
        if (m.vendor_id, m.device_id, m.class_code) == (fn.vendor, fn.device, fn.class_code):
            return vendor, key
    return None



def _nic_model(fn: Function) -> tuple[str, str] | None:
    vendor = _NIC_VENDORS.get(fn.vendor)
    if vendor is None or fn.class_code >> 16 != _NIC_BASE_CLASS:
        return None
    for key, m in catalogue.NICS.get(vendor, {}).items():
        classes = {m.class_code} | ({_IB_CLASS} if vendor == "mellanox" else set())
        if (m.vendor_id, m.device_id) == (fn.vendor, fn.device) and fn.class_code in classes:
            return vendor, key
    return None



def _fpga_model(fn: Function) -> tuple[str, str] | None:
    vendor = _FPGA_VENDORS.get(fn.vendor)
    if vendor is None:
        return None
    for key, m in catalogue.FPGAS.get(vendor, {}).items():
        if (m.vendor_id, m.device_id, m.class_code) == (fn.vendor, fn.device, fn.class_code):
            return vendor, key
    return None



def _nvme_model(fn: Function) -> tuple[str, str] | None:
    if fn.class_code != _NVME_CLASS:
        return None
    found: list[tuple[int, str, str]] = []
    for vendor, models in _NVMES.items():
        for key, m in models.items():
            if (m.vendor_id, m.device_id) == (fn.vendor, fn.device):
                rank = (0 if m.name == fn.nvme_model else
                        1 if (m.subsystem_vendor_id, m.subsystem_device_id) == fn.subsystem
                        else 2)
                found.append((rank, vendor, key))
    if not found:
        return None
    _, vendor, key = min(found)
    return vendor, key



def _nvme_entry(fns: list[Function], nvme: tuple[str, str], numa: int | str, comment: str,
                left_out: list[str]) -> Entry:
    fn = fns[0]
    vendor, key = nvme
    m = _NVMES[vendor][key]
    fields: dict[str, Any] = {"type": "nvme", "vendor": vendor, "model": key, "numaNode": numa}
    spaces = fn.nvme_namespaces
    if not spaces:
        left_out.append(f"{fn.address}: no namespaces under nvme/ (driver unbound or native "
                        "multipath): the model's capacity and one namespace")
    else:
        lbas = {lba for _, lba in spaces}
        lba = lbas.pop() if len(lbas) == 1 else None
        sizes = {size for size, _ in spaces}
        capacity = sum(size for size, _ in spaces) * 512
        if (lba not in (512, 4096) or len(sizes) != 1 or len(spaces) > 16 or capacity <= 0
                or capacity > model.MAX_QUANTITY):
            left_out.append(f"{fn.address}: namespaces the profile cannot say (of "
                            "different sizes or block sizes, more than 16, or past 1Pi): "
                            "captured as the model's capacity, one namespace")
        else:
            if len(spaces) != 1:
                fields["namespaces"] = len(spaces)
            if capacity != m.capacity:
                fields["capacity"] = quantity(capacity)
            if lba != 512:
                fields["lbaSize"] = lba
    if fn.nvme_model is not None and fn.nvme_model != m.name:
        left_out.append(f"{fn.address}: model number {fn.nvme_model!r} (the catalogue's "
                        f"{key} is {m.name!r})")
    _note_ids(fn, m.subsystem_vendor_id, m.subsystem_device_id, "nvme", left_out)
    return Entry(fields, fns, comment)



def _sriov(fn: Function, max_vfs: int, what: str, left_out: list[str]) -> dict[str, int] | None:
    if fn.total_vfs <= 0:
        return None
    if max_vfs == 0:
        left_out.append(f"{fn.address}: SR-IOV ({fn.total_vfs} VFs; the catalogue's {what} "
                        "has none)")
        return None
    total = min(fn.total_vfs, max_vfs)
    if total < fn.total_vfs:
        left_out.append(f"{fn.address}: sriov_totalvfs {fn.total_vfs} capped at the "
                        f"catalogue's {max_vfs}")
    return {"totalVFs": total, "numVFs": min(fn.num_vfs, total)}



def _comment(fns: list[Function]) -> str:
    fn = fns[0]
    text = (f"{fn.address} {fn.ids} subsystem {fn.subsystem[0]:04x}:{fn.subsystem[1]:04x} "
            f"class {fn.class_code:06x}")
    if len(fns) > 1:
        text += f", {len(fns)} functions"
    if fn.driver:
        text += f", driver {fn.driver}"
    if fn.numa_raw < 0:
        text += ", numa_node -1"
    return text



def numa_ref(numa_raw: int) -> int | str:
    """A sysfs numa_node as the profile says it: -1 (no firmware affinity) is ``none``."""
    return "none" if numa_raw < 0 else numa_raw



def _numa_of(fn: Function, numa_count: int, left_out: list[str]) -> int | str:
    if fn.numa_raw < numa_count:
        return numa_ref(fn.numa_raw)
    left_out.append(f"{fn.address}: numa_node {fn.numa_raw} is not a NUMA node here; "
                    "captured as 0")
    return 0



def _classify(fns: list[Function], numa_count: int, left_out: list[str]) -> Entry:
    entry = _classify_type(fns, numa_count, left_out)
    fn = fns[0]
    if fn.aer_fatal > 0:  # a fatal AER error was reported: the device plugin's view
        entry.fields["health"] = "unhealthy"
        entry.fields["healthReason"] = "link-down" if fn.link_down else "aer-fatal"
    return entry



def _classify_type(fns: list[Function], numa_count: int, left_out: list[str]) -> Entry:
    fn = fns[0]
    numa = _numa_of(fn, numa_count, left_out)
    comment = _comment(fns)
    gpu = _gpu_model(fn)
    if gpu is not None:
        vendor, key = gpu
        m = catalogue.GPUS[vendor][key]
        fields: dict[str, Any] = {"type": "gpu", "vendor": vendor, "model": key,
                                  "numaNode": numa}
        sriov = _sriov(fn, m.max_vfs, m.name, left_out)
        if sriov:
            fields["sriov"] = sriov
        if vendor == "nvidia" and fn.drm and "drm" in model.Gpu.model_fields:
            fields["drm"] = True  # nvidia-drm's DRM nodes
        partitions = _partitions(fn, m) if vendor == "nvidia" else None
        if partitions is not None:
            fields["partitions"] = partitions
        _note_ids(fn, m.subsystem_vendor_id, m.subsystem_device_id, m.driver, left_out)
        return Entry(fields, fns, comment)
    nic = _nic_model(fn)
    if nic is not None:
        return _nic_entry(fns, nic, numa, comment, left_out)
    nvme = _nvme_model(fn)
    if nvme is not None:
        return _nvme_entry(fns, nvme, numa, comment, left_out)
    fpga = _fpga_model(fn)
    if fpga is not None:
        vendor, key = fpga
        fm = catalogue.FPGAS[vendor][key]
        fields = {"type": "fpga", "vendor": vendor, "model": key, "numaNode": numa}
        afus = fn.fpga_afus
        if afus and len(afus) <= 8:
            if len(afus) != fm.ports:
                fields["ports"] = len(afus)
            if afus != [fm.afu_id] * len(afus) and all(re.fullmatch(r"[0-9a-f]{32}", a)
                                                       for a in afus):
                fields["afuIds"] = afus
        _note_ids(fn, fm.vendor_id, 0, fm.driver, left_out)
        return Entry(fields, fns, comment)
    fields = {"type": "generic", "vendorId": Hex(fn.vendor, 4), "deviceId": Hex(fn.device, 4),
              "classCode": Hex(fn.class_code, 6), "numaNode": numa}
    if fn.driver and _DRIVER.fullmatch(fn.driver) and len(fn.driver) <= 64:
        fields["driver"] = fn.driver
    if fn.dev_nodes:
        fields["devNodes"] = [{"name": n, "major": major, "minor": minor}
                              for n, major, minor in sorted(fn.dev_nodes)[:64]]
    return Entry(fields, fns, comment)



def _nic_entry(fns: list[Function], nic: tuple[str, str], numa: int | str, comment: str,
               left_out: list[str]) -> Entry:
    fn = fns[0]
    vendor, key = nic
    m = catalogue.NICS[vendor][key]
    fields: dict[str, Any] = {"type": "nic", "vendor": vendor, "model": key, "numaNode": numa}
    if len(fns) > 1:
        fields["ports"] = len(fns)
    ib = fn.class_code == _IB_CLASS
    if ib:
        fields["linkLayer"] = "infiniband"
    speeds = [s for f in fns for _, _, s in f.netdevs[:1] if s is not None]
    if speeds and speeds[0] != m.speed:
        fields["speed"] = speeds[0]
    macs = [mac for f in fns for _, mac, _ in f.netdevs[:1] if mac is not None]
    if not ib and len(macs) == len(fns) and all(_MAC.fullmatch(x) for x in macs):
        base = int(macs[0].replace(":", ""), 16)
        if all(int(x.replace(":", ""), 16) == base + p for p, x in enumerate(macs)):
            fields["macBase"] = macs[0]
        else:
            left_out.append(f"{fn.address}: port MACs {', '.join(macs)} (the tree numbers "
                            "them from the first)")
    rdma = any(f.rdma for f in fns)
    if not ib and rdma != m.rdma and (m.rdma or not rdma):
        fields["rdma"] = rdma
    sriov: dict[str, int | str] = dict(_sriov(fn, m.max_vfs, m.name, left_out) or {})
    if sriov:
        if fn.vf_drivers == {"vfio-pci"}:
            sriov["vfDriver"] = "vfio-pci"
        fields["sriov"] = sriov
        if any(f.total_vfs != fn.total_vfs or f.num_vfs != fn.num_vfs for f in fns):
            left_out.append(f"{fn.address}: ports with different SR-IOV settings (captured "
                            "as port 0's)")
    _note_ids(fn, m.vendor_id, 0x0001, m.driver, left_out)
    return Entry(fields, fns, comment)



def _note_ids(fn: Function, svendor: int, sdevice: int, driver: str, left_out: list[str]
              ) -> None:
    if fn.subsystem != (svendor, sdevice):
        left_out.append(f"{fn.address}: subsystem {fn.subsystem[0]:04x}:{fn.subsystem[1]:04x} "
                        f"(the catalogue's model has {svendor:04x}:{sdevice:04x})")
    if fn.driver is not None and fn.driver != driver:
        left_out.append(f"{fn.address}: driver {fn.driver} (the tree binds {driver})")



def _group_functions(fns: list[Function]) -> list[list[Function]]:
    """Multi-port NICs: the functions 0..n-1 of one slot with the same ids are one card."""
    by_slot: dict[str, list[Function]] = {}
    for fn in fns:
        by_slot.setdefault(fn.slot, []).append(fn)
    out: list[list[Function]] = []
    taken: set[str] = set()
    for fn in fns:
        if fn.address in taken:
            continue
        group = [fn]
        if fn.address.endswith(".0") and _nic_model(fn) is not None:
            same = [f for f in by_slot[fn.slot]
                    if (f.vendor, f.device, f.class_code) == (fn.vendor, fn.device, fn.class_code)]
            same.sort(key=lambda f: f.address)
            run = [f for k, f in enumerate(same) if f.address.endswith(f".{k}")]
            group = run[:min(len(run), 4)] if run and run[0] is fn else [fn]
        taken.update(f.address for f in group)
        out.append(group)
    return out



def root_complex(fns: list[Function]) -> Function | None:
    """The host bridge function 0000:00:00.0 (class 0x060000): the machine's own, which
    the tree renders on host bridge pci0000:00 (``pci.rootComplex``), not a device."""
    return next((f for f in fns if f.address == ROOT_COMPLEX_ADDRESS
                 and f.class_code == catalogue.HOST_BRIDGE_CLASS), None)



def _is_bridge(class_code: int) -> bool:
    return (class_code >> 16 == _BRIDGE_BASE_CLASS
            and class_code >> 8 != _OTHER_BRIDGE_CLASS)



# PCI functions capture reads at most, bridges and SR-IOV VFs (not devices of the profile)
# included: a machine can have many more of those than a profile's functions, but a
# directory past this many entries is refused from its names, without reading them.
PCI_READ_FACTOR = 4



def _read_functions(root: Root, left_out: list[str]) -> list[Function]:
    """Every PCI function below ``PCI_DIR``; a ``CaptureError`` as soon as there are more
    than a profile holds (the names are counted first, the endpoints as they are read)."""
    names = root.names(PCI_DIR, r"[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]")
    most = limits.MAX_FUNCTIONS
    if len(names) > PCI_READ_FACTOR * most:
        raise CaptureError(f"{root.where}: {len(names)} PCI functions under {PCI_DIR}; a "
                           f"profile holds at most {most} per node (capture reads at most "
                           f"{PCI_READ_FACTOR * most}, bridges and SR-IOV VFs included)")
    fns: list[Function] = []
    unread: list[str] = []
    endpoints = 0
    for address in names:
        fn = read_function(root, address)
        if fn is None:
            unread.append(address)
            continue
        fns.append(fn)
        endpoints += not _is_bridge(fn.class_code) and not fn.is_vf
        if endpoints > most:
            raise CaptureError(f"{root.where}: more than {most} PCI functions (not bridges or "
                               f"SR-IOV VFs) under {PCI_DIR}; a profile holds at most {most} "
                               "per node")
    by_address = {f.address: f for f in fns}
    _read_dev_nodes(root, fns)
    _read_mig_profiles(root, by_address)
    for f in fns:
        pf = by_address.get(f.physfn or "")
        if f.is_vf and pf is not None and f.driver is not None:
            pf.vf_drivers.add(f.driver)
    if unread:
        more = f" and {len(unread) - 12} more" if len(unread) > 12 else ""
        left_out.append(f"{len(unread)} PCI function(s) without readable vendor, device and "
                        f"class ids (not read): {', '.join(unread[:12])}{more}")
    return fns



def read_pci(root: Root, numa_count: int, left_out: list[str]
              ) -> tuple[list[Entry], list[Function]]:
    fns = _read_functions(root, left_out)
    host = root_complex(fns)
    bridges = [f for f in fns if _is_bridge(f.class_code) and f is not host]
    if bridges:
        shown = ", ".join(f"{f.address} ({f.ids} class {f.class_code:06x})" for f in bridges[:12])
        more = f" and {len(bridges) - 12} more" if len(bridges) > 12 else ""
        left_out.append(f"{len(bridges)} PCI bridge(s), which the resolver plans itself: "
                        f"{shown}{more}")
    vfs = [f for f in fns if f.is_vf and not _is_bridge(f.class_code)]
    if vfs:
        left_out.append(f"{len(vfs)} SR-IOV VFs: counted on their PF (numVFs); the resolver "
                        "plans their addresses")
    endpoints = [f for f in fns if not _is_bridge(f.class_code) and not f.is_vf]
    if endpoints and all(f.iommu_group is not None for f in endpoints):
        # The resolver numbers IOMMU groups in profile order: keeping that order makes a
        # tree we rendered capture back to the same order.
        endpoints.sort(key=lambda f: (f.iommu_group or 0, f.address))
    groups = _group_functions(endpoints)
    if len(groups) > limits.MAX_DEVICES:
        raise CaptureError(f"{root.where}: {len(groups)} PCI devices under {PCI_DIR} "
                           "(functions that are not bridges or SR-IOV VFs, a NIC's ports one "
                           f"device); a profile holds at most {limits.MAX_DEVICES} per node")
    entries = [_classify(g, numa_count, left_out) for g in groups]
    for e in entries:
        e.addresses = [e.functions[0].address]
    return entries, fns



# What a device node name may be (the profile's DevNodeName) and how many are read
_DEV_NODE = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*(/[A-Za-z0-9_+-][A-Za-z0-9_.+-]*)*")
_MAX_CHAR_DEVS = 4096
_NVML_STATE = "proc/driver/nvidia/hwsandbox/nvml"


def _read_dev_nodes(root: Root, fns: list[Function]) -> None:
    """Each function's class devices that have a device node at ``/dev/<class>/<name>``
    (class ``generic``: ``/dev/<name>``), found through ``sys/dev/char`` (one link per
    character device): the devNodes of a generic device as a sandbox tree lays them out.
    On a real machine the node paths rarely follow that rule (``drm/card0`` is
    ``/dev/dri/card0``) and nothing is taken."""
    by_dir = {root.real(f"{PCI_DIR}/{f.address}"): f for f in fns}
    for numbers in root.names("sys/dev/char", r"[0-9]{1,4}:[0-9]{1,7}")[:_MAX_CHAR_DEVS]:
        where = root.real(f"sys/dev/char/{numbers}")
        if where is None or where.count("/") < 2:
            continue
        parent, cls, name = where.rsplit("/", 2)
        fn = by_dir.get(parent)
        if fn is None:
            continue
        node = name if cls == "generic" else f"{cls.replace('!', '/')}/{name}"
        major, minor = (int(n) for n in numbers.split(":"))
        if (len(node) <= 255 and _DEV_NODE.fullmatch(node) and major <= 4095
                and minor <= 1048575 and root.exists(f"dev/{node}")):
            fn.dev_nodes.append((node, major, minor))


def _read_mig_profiles(root: Root, by_address: dict[str, Function]) -> None:
    """The MIG profiles of each GPU in MIG mode, from a sandbox tree's NVML state file
    (``proc/driver/nvidia/hwsandbox/nvml``; a real machine has none): its ``profile``
    lines, in the order the profile gave them."""
    for line in (root.read(_NVML_STATE) or "").splitlines():
        words = line.split()
        if len(words) < 3 or words[0] != "profile" or words[1] not in by_address:
            continue
        fields = dict(w.partition("=")[::2] for w in words[2:])
        if all(k in fields for k in ("name", "slices", "memory-slices", "memory-mb")):
            by_address[words[1]].mig_profiles.append(fields)


def _partitions(fn: Function, m: catalogue.GpuModel) -> dict[str, Any] | None:
    """A GPU's ``partitions`` from its MIG profiles (``_read_mig_profiles``), with the
    catalogue's slices; a profile's memory only where it is not its share of the GPU's."""
    if not fn.mig_profiles or not m.memory_slices or not m.compute_slices:
        return None
    profiles = []
    for q in fn.mig_profiles:
        try:
            ms, cs, mb = int(q["memory-slices"]), int(q["slices"]), int(q["memory-mb"])
        except ValueError:
            return None
        if not re.fullmatch(r"[0-9a-z][0-9a-z.+-]{0,63}", q["name"]) or not 0 < ms <= 64 \
                or not 0 < cs <= 64:
            return None
        profile: dict[str, Any] = {"name": q["name"], "memorySlices": ms, "computeSlices": cs}
        if mb != m.memory * ms // m.memory_slices // 2**20:
            profile["memory"] = f"{mb}Mi"
        profiles.append(profile)
    return {"profiles": profiles}


def merge(entries: list[Entry]) -> list[Entry]:
    """Consecutive identical entries become one with ``count``."""
    out: list[Entry] = []
    for e in entries:
        last = out[-1] if out else None
        if last is not None and last.fields == e.fields and last.count < 1024:
            last.count += 1
            last.addresses += e.addresses
            last.functions += e.functions
            last.comment += "\n" + e.comment
        else:
            out.append(Entry(dict(e.fields), list(e.functions), e.comment, 1,
                              list(e.addresses)))
    return out

"""``capture``: read a machine's /sys and /proc into a hardware profile (``sandbox capture``).

    capture(root="/") -> Capture(text, profile, left_out)
    write_capture(capture, path, force=False)

``root`` is a directory holding ``sys/`` and ``proc/``: ``/`` for the host, or a copy or
a ``sandbox render`` output. Only files are read; nothing below ``root`` is written.

What is read, and how it maps to the profile (sandbox/profile/model.py):

    proc/cpuinfo                       cpu.vendor, model, family, modelNumber, mhz
    sys/devices/system/cpu/cpuN/topology  cpu.sockets, coresPerSocket, threadsPerCore
    sys/devices/system/node/nodeN/     numa.nodes[]: cpus (cpulist), memory (meminfo
                                       MemTotal), hugepages (nr_hugepages), distances
    sys/bus/pci/devices/*              devices[]: ids, class, numa_node, driver, SR-IOV
                                       (sriov_totalvfs, sriov_numvfs), netdevs (MAC, speed)

PCI functions become the device types the profile knows when the catalogue
(sandbox/profile/catalogue.py) has their vendor:device id and class: GPUs (NVIDIA, AMD,
Intel), NICs (class 02; the functions of one slot are its ports), FPGAs, NVMe drives
(class 010802; namespaces, capacity and block size from their disks); every other
function is a ``generic`` device with its raw ids. Bridges (class 06: host bridges, root
and switch ports, ISA bridges; but not 0680 "other bridge", which NVSwitches report) are
not devices: the resolver plans its own. SR-IOV VFs
are counted on their PF (``numVFs``), not captured as devices.

PCI addresses are left to the resolver when its plan gives every function the address it
has on the machine (a tree we rendered captures back to the same profile); otherwise the
machine's addresses are kept as ``pciAddresses``. The output is validated (loaded and
resolved) before it is returned, and its header comment lists what was left out.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox import __version__
from sandbox.errors import ProfileError, SandboxError
from sandbox.profile import catalogue, load_profile_text, model
from sandbox.profile.cpulist import format_cpulist, parse_cpulist
from sandbox.profile.model import API_VERSION, KIND, MAX_NUMA_NODES

__all__ = ["Capture", "CaptureError", "capture", "write_capture"]

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"
PCI_DIR = "sys/bus/pci/devices"
DMI_DIR = "sys/devices/virtual/dmi/id"
_READ_LIMIT = 1 << 20  # no sysfs or proc file we read is near this
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]$")
_MAC = re.compile(r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")
_DRIVER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_BRIDGE_BASE_CLASS = 0x06
_OTHER_BRIDGE_CLASS = 0x0680  # "other bridge": real devices (NVSwitch, chipset functions)
_NIC_BASE_CLASS = 0x02
_IB_CLASS = 0x020700
_GPU_VENDORS = {catalogue.NVIDIA: "nvidia", catalogue.AMD: "amd", catalogue.INTEL: "intel"}
_NIC_VENDORS = {catalogue.MELLANOX: "mellanox", catalogue.INTEL: "intel"}
_FPGA_VENDORS = {catalogue.INTEL: "intel", catalogue.XILINX: "xilinx"}
# NVMe drives, where this version's profile has the type (catalogue.NVMES).
_NVMES: dict[str, Any] = getattr(catalogue, "NVMES", {})
_NVME_CLASS: int = getattr(catalogue, "NVME_CLASS", 0x010802)


class CaptureError(SandboxError):
    """The root cannot be captured (not a sysfs-like tree) or the output cannot be written."""


@dataclass(frozen=True)
class Capture:
    text: str  # the commented YAML profile
    profile: dict[str, Any]  # the document, camelCase keys as written
    left_out: tuple[str, ...]  # what the profile does not carry (also in the header)
    # "machine": every captured PCI function renders at its address on the machine (the
    # resolver's plan matched, or pciAddresses keep them); "planned": the machine's
    # addresses do not fit a profile and the resolver planned new ones.
    pci_addresses: str = "machine"


# --------------------------------------------------------------------------- reading


class _Root:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = Path(root)

    def read(self, rel: str) -> str | None:
        """A regular file's text (sysfs and proc files are); a FIFO or device is never
        opened for blocking reads."""
        try:
            fd = os.open(self.path / rel, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, ValueError):
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            chunks: list[bytes] = []
            size = 0
            while size < _READ_LIMIT:  # proc files come in pieces
                chunk = os.read(fd, _READ_LIMIT - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            data = b"".join(chunks)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data.decode("utf-8", "replace")

    def line(self, rel: str) -> str | None:
        text = self.read(rel)
        return None if text is None else text.strip()

    def number(self, rel: str, base: int = 10) -> int | None:
        text = self.line(rel)
        if text is None:
            return None
        try:
            return int(text, base)
        except ValueError:
            return None

    def names(self, rel: str, pattern: str) -> list[str]:
        try:
            entries = os.listdir(self.path / rel)
        except OSError:
            return []
        rx = re.compile(pattern)
        return sorted(e for e in entries if rx.fullmatch(e))

    def link_name(self, rel: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self.path / rel))
        except OSError:
            return None

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.path / rel)


def _check_root(root: _Root) -> None:
    where = str(root.path)
    if not root.path.is_dir():
        raise CaptureError(f"{where}: not a directory (give --root a directory holding sys/ "
                           "and proc/, such as / or a `sandbox render` output)")
    if not root.names(CPU_DIR, r"cpu[0-9]+"):
        raise CaptureError(f"{where}: not a machine root: no {CPU_DIR}/cpuN directories "
                           "(give --root a directory holding sys/ and proc/, such as / or a "
                           "`sandbox render` output)")
    if root.read("proc/cpuinfo") is None:
        raise CaptureError(f"{where}: not a machine root: no readable proc/cpuinfo")


@dataclass
class _Cpus:
    fields: dict[str, Any]  # the profile's cpu: section
    ncpus: int
    online: list[int]


def _cpuinfo(root: _Root) -> dict[str, str]:
    """The first processor's ``key: value`` lines of proc/cpuinfo."""
    out: dict[str, str] = {}
    for line in (root.read("proc/cpuinfo") or "").splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def _text(value: str | None, default: str) -> str:
    if not value:
        return default
    return _CONTROL.sub(" ", value)[:256]


def _read_cpus(root: _Root, left_out: list[str]) -> _Cpus:
    ids = sorted(int(n[3:]) for n in root.names(CPU_DIR, r"cpu[0-9]+"))
    online = _cpulist(root.line(f"{CPU_DIR}/online")) or ids
    present = _cpulist(root.line(f"{CPU_DIR}/present")) or ids
    if online != present:
        offline = format_cpulist(set(present) - set(online))
        left_out.append(f"offline CPUs {offline}: the profile's CPUs are all online")
    topo: dict[int, tuple[int, int, list[int]]] = {}
    for c in online:
        base = f"{CPU_DIR}/cpu{c}/topology"
        pkg = root.number(f"{base}/physical_package_id")
        core = root.number(f"{base}/core_id")
        sib = _cpulist(root.line(f"{base}/thread_siblings_list")) or [c]
        topo[c] = (pkg if pkg is not None and pkg >= 0 else 0,
                   core if core is not None and core >= 0 else c, sib)
    packages = sorted({p for p, _, _ in topo.values()})
    cores_of = {p: sorted({k for q, k, _ in topo.values() if q == p}) for p in packages}
    sockets = len(packages)
    cores = max(len(v) for v in cores_of.values())
    threads = max(len(s) for _, _, s in topo.values())
    if len({len(v) for v in cores_of.values()}) > 1 or len(online) != sockets * cores * threads:
        left_out.append(f"uneven CPU topology ({len(online)} CPUs over {sockets} sockets, "
                        f"up to {cores} cores and {threads} threads each): captured as "
                        f"{sockets} x {cores} x {threads}")
    sockets, cores, threads = _clamp(sockets, 16), _clamp(cores, 512), _clamp(threads, 8)
    _check_numbering(topo, sockets, cores, threads, left_out)
    info = _cpuinfo(root)
    fields: dict[str, Any] = {
        "sockets": sockets,
        "coresPerSocket": cores,
        "threadsPerCore": threads,
        "vendor": _text(info.get("vendor_id") or info.get("CPU implementer"), "unknown"),
        "model": _text(info.get("model name") or info.get("Processor"), "unknown"),
    }
    family, model_number = _int(info.get("cpu family")), _int(info.get("model"))
    if family is not None:
        fields["family"] = family
    if model_number is not None:
        fields["modelNumber"] = model_number
    try:
        mhz = round(float(info.get("cpu MHz", "")))
    except ValueError:
        mhz = 0
    if mhz >= 1:
        fields["mhz"] = mhz
    return _Cpus(fields, sockets * cores * threads, online)


def _check_numbering(topo: dict[int, tuple[int, int, list[int]]], sockets: int, cores: int,
                     threads: int, left_out: list[str]) -> None:
    """Note where the machine numbers CPUs differently from the resolver (first threads of
    every core socket by socket, then the second threads; core ids 0..N-1 per socket)."""
    ncores = sockets * cores
    expected = {
        t * ncores + s * cores + c: (s, c)
        for t in range(threads) for s in range(sockets) for c in range(cores)
    }
    for cpu, (pkg, core, _sib) in sorted(topo.items()):
        if expected.get(cpu) != (pkg, core):
            left_out.append(f"CPU numbering: cpu{cpu} is package {pkg} core {core} here; the "
                            f"tree numbers it {expected.get(cpu, '(none)')} (socket, core)")
            return


def _clamp(value: int, maximum: int) -> int:
    return max(1, min(value, maximum))


def _int(text: str | None) -> int | None:
    try:
        return int(text or "", 0)
    except ValueError:
        return None


def _cpulist(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return parse_cpulist(text, 1 << 16)
    except ValueError:
        return []


def _quantity(nbytes: int) -> str:
    for unit, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if nbytes and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def _meminfo_kb(text: str | None, key: str) -> int | None:
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if key in parts:
            i = parts.index(key)
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return int(parts[i + 1])
    return None


def _read_numa(root: _Root, cpus: _Cpus, left_out: list[str]) -> list[dict[str, Any]]:
    names = root.names(NODE_DIR, r"node[0-9]+")
    node_ids = sorted(int(n[4:]) for n in names)
    if not node_ids:
        kb = _meminfo_kb(root.read("proc/meminfo"), "MemTotal") or 0
        left_out.append(f"no {NODE_DIR}: one NUMA node with every CPU")
        return [{"id": 0, "cpus": format_cpulist(range(cpus.ncpus)),
                 "memory": _quantity(kb * 1024 - kb * 1024 % 4096)}]
    if node_ids != list(range(len(node_ids))):
        left_out.append(f"NUMA node ids {format_cpulist(node_ids)} renumbered 0.."
                        f"{len(node_ids) - 1} (the profile numbers them in order)")
    if len(node_ids) > MAX_NUMA_NODES:
        raise CaptureError(f"{len(node_ids)} NUMA nodes; a profile holds at most "
                           f"{MAX_NUMA_NODES}")
    nodes: list[dict[str, Any]] = []
    for k, nid in enumerate(node_ids):
        base = f"{NODE_DIR}/node{nid}"
        listed = [c for c in _cpulist(root.line(f"{base}/cpulist")) if c < cpus.ncpus]
        kb = _meminfo_kb(root.read(f"{base}/meminfo"), "MemTotal") or 0
        entry: dict[str, Any] = {"id": k, "cpus": format_cpulist(listed),
                                 "memory": _quantity(kb * 1024 - kb * 1024 % 4096)}
        pages: dict[str, int] = {}
        for d in root.names(f"{base}/hugepages", r"hugepages-[0-9]+kB"):
            count = root.number(f"{base}/hugepages/{d}/nr_hugepages")
            if count:
                pages[_quantity(int(d[10:-2]) * 1024)] = count
        if pages:
            entry["hugepages"] = pages
        nodes.append(entry)
    return nodes


def _read_swap(root: _Root) -> str | None:
    """The swap size: SwapTotal counts every swap area but its header page (4 KiB)."""
    kb = _meminfo_kb(root.read("proc/meminfo"), "SwapTotal")
    if not kb:
        return None
    areas = max(1, len((root.read("proc/swaps") or "").strip().splitlines()) - 1)
    return _quantity((kb + 4 * areas) * 1024)


_DMI_FIELDS = {
    "vendor": "sys_vendor", "product": "product_name", "version": "product_version",
}
_DMI_BOARD = {"vendor": "board_vendor", "name": "board_name", "version": "board_version"}
_DMI_BIOS = {"vendor": "bios_vendor", "version": "bios_version", "date": "bios_date"}


def _read_system(root: _Root) -> dict[str, Any] | None:
    """The DMI identity (sys/devices/virtual/dmi/id), where this profile version has it."""
    if "system" not in model.Node.model_fields or not root.exists(DMI_DIR):
        return None

    def section(names: dict[str, str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, name in names.items():
            value = root.line(f"{DMI_DIR}/{name}")
            if value and not _CONTROL.search(value) and len(value) <= 256:
                out[key] = value
        return out

    system = section(_DMI_FIELDS)
    board, bios = section(_DMI_BOARD), section(_DMI_BIOS)
    if "date" in bios and not re.fullmatch(r"(0[1-9]|1[0-2])/(0[1-9]|[12][0-9]|3[01])/"
                                           r"[0-9]{4}", bios["date"]):
        del bios["date"]
    if board:
        system["board"] = board
    if bios:
        system["bios"] = bios
    chassis = root.number(f"{DMI_DIR}/chassis_type")
    if chassis is not None and 1 <= chassis <= 0x24:
        system["chassisType"] = chassis
    return system or None


def _read_distances(root: _Root, count: int, left_out: list[str]) -> list[list[int]] | None:
    ids = sorted(int(n[4:]) for n in root.names(NODE_DIR, r"node[0-9]+"))
    matrix: list[list[int]] = []
    for nid in ids:
        row = (root.line(f"{NODE_DIR}/node{nid}/distance") or "").split()
        if len(row) != count or not all(x.isdigit() for x in row):
            return None
        matrix.append([int(x) for x in row])
    default = [[10 if a == b else 21 for b in range(count)] for a in range(count)]
    if not matrix or matrix == default:
        return None
    ok = all(
        (matrix[a][b] == 10) if a == b else (11 <= matrix[a][b] <= 254
                                             and matrix[a][b] == matrix[b][a])
        for a in range(count) for b in range(count)
    )
    if not ok:
        left_out.append("NUMA distances (not a symmetric 10-local matrix the profile takes)")
        return None
    return matrix


# --------------------------------------------------------------------------- PCI


@dataclass
class _Function:
    address: str
    vendor: int
    device: int
    subsystem: tuple[int, int]
    class_code: int
    numa_raw: int
    driver: str | None
    root_bus: str | None  # pciDDDD:BB it sits below
    is_vf: bool
    total_vfs: int
    num_vfs: int
    iommu_group: int | None
    aer_fatal: int = 0  # TOTAL_ERR_FATAL of aer_dev_fatal
    link_down: bool = False  # current_link_speed "Unknown"
    netdevs: list[tuple[str, str | None, int | None]] = field(default_factory=list)
    rdma: bool = False
    fpga_afus: list[str] = field(default_factory=list)
    drm: bool = False  # has DRM nodes (drm/cardN)
    nvme_model: str | None = None  # nvme/nvmeN/model
    # per namespace disk (nvmeNnM): size in 512-byte sectors, logical block size
    nvme_namespaces: list[tuple[int, int | None]] = field(default_factory=list)

    @property
    def slot(self) -> str:
        return self.address[:-2]

    @property
    def ids(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"


def _read_function(root: _Root, address: str) -> _Function | None:
    base = f"{PCI_DIR}/{address}"
    vendor, device = root.number(f"{base}/vendor", 16), root.number(f"{base}/device", 16)
    cls = root.number(f"{base}/class", 16)
    if vendor is None or device is None or cls is None:
        return None
    try:
        real = os.path.realpath(root.path / base)
        rel = os.path.relpath(real, os.path.realpath(root.path))
    except (OSError, ValueError):
        rel = ""
    parts = rel.split(os.sep)
    root_bus = next((p for p in parts if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", p)), None)
    numa = root.number(f"{base}/numa_node")
    group = root.link_name(f"{base}/iommu_group")
    fn = _Function(
        address=address, vendor=vendor, device=device,
        subsystem=(root.number(f"{base}/subsystem_vendor", 16) or 0,
                   root.number(f"{base}/subsystem_device", 16) or 0),
        class_code=cls, numa_raw=numa if numa is not None else -1,
        driver=root.link_name(f"{base}/driver"), root_bus=root_bus,
        is_vf=root.exists(f"{base}/physfn"),
        total_vfs=root.number(f"{base}/sriov_totalvfs") or 0,
        num_vfs=root.number(f"{base}/sriov_numvfs") or 0,
        iommu_group=int(group) if group and group.isdigit() else None,
    )
    for line in (root.read(f"{base}/aer_dev_fatal") or "").splitlines():
        key, _, count = line.partition(" ")
        if key == "TOTAL_ERR_FATAL" and count.strip().isdigit():
            fn.aer_fatal = int(count)
    fn.link_down = root.line(f"{base}/current_link_speed") == "Unknown"
    for net in root.names(f"{base}/net", r"[^/]+"):
        mac = root.line(f"{base}/net/{net}/address")
        speed = root.number(f"{base}/net/{net}/speed")
        fn.netdevs.append((net, mac, speed if speed is not None and speed > 0 else None))
    fn.rdma = bool(root.names(f"{base}/infiniband", r"[^/]+"))
    fn.drm = bool(root.names(f"{base}/drm", r"card[0-9]+"))
    for region in root.names(f"{base}/fpga_region", r"region[0-9]+"):
        ports = root.names(f"{base}/fpga_region/{region}", r"dfl-port\.[0-9]+")
        for port in sorted(ports, key=lambda p: int(p.split(".")[1])):
            fn.fpga_afus.append(root.line(f"{base}/fpga_region/{region}/{port}/afu_id") or "")
    for ctrl in root.names(f"{base}/nvme", r"nvme[0-9]+")[:1]:
        cdir = f"{base}/nvme/{ctrl}"
        fn.nvme_model = root.line(f"{cdir}/model")
        disks = root.names(cdir, rf"{ctrl}n[0-9]+")
        for disk in sorted(disks, key=lambda n: int(n[len(ctrl) + 1:])):
            fn.nvme_namespaces.append((root.number(f"{cdir}/{disk}/size") or 0,
                                       root.number(f"{cdir}/{disk}/queue/logical_block_size")))
    return fn


@dataclass
class _Entry:
    """One profile device entry (count 1 until merged) and the functions it stands for."""

    fields: dict[str, Any]
    functions: list[_Function]
    comment: str
    count: int = 1
    addresses: list[str] = field(default_factory=list)  # first function of each device


def _gpu_model(fn: _Function) -> tuple[str, str] | None:
    vendor = _GPU_VENDORS.get(fn.vendor)
    if vendor is None:
        return None
    for key, m in catalogue.GPUS.get(vendor, {}).items():
        if (m.vendor_id, m.device_id, m.class_code) == (fn.vendor, fn.device, fn.class_code):
            return vendor, key
    return None


def _nic_model(fn: _Function) -> tuple[str, str] | None:
    vendor = _NIC_VENDORS.get(fn.vendor)
    if vendor is None or fn.class_code >> 16 != _NIC_BASE_CLASS:
        return None
    for key, m in catalogue.NICS.get(vendor, {}).items():
        classes = {m.class_code} | ({_IB_CLASS} if vendor == "mellanox" else set())
        if (m.vendor_id, m.device_id) == (fn.vendor, fn.device) and fn.class_code in classes:
            return vendor, key
    return None


def _fpga_model(fn: _Function) -> tuple[str, str] | None:
    vendor = _FPGA_VENDORS.get(fn.vendor)
    if vendor is None:
        return None
    for key, m in catalogue.FPGAS.get(vendor, {}).items():
        if (m.vendor_id, m.device_id, m.class_code) == (fn.vendor, fn.device, fn.class_code):
            return vendor, key
    return None


def _nvme_model(fn: _Function) -> tuple[str, str] | None:
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


def _nvme_entry(fns: list[_Function], nvme: tuple[str, str], numa: int, comment: str,
                left_out: list[str]) -> _Entry:
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
        if lba not in (512, 4096) or len(sizes) != 1 or len(spaces) > 16 or capacity <= 0:
            left_out.append(f"{fn.address}: namespaces of different sizes or block sizes "
                            "(captured as the model's capacity, one namespace)")
        else:
            if len(spaces) != 1:
                fields["namespaces"] = len(spaces)
            if capacity != m.capacity:
                fields["capacity"] = _quantity(capacity)
            if lba != 512:
                fields["lbaSize"] = lba
    if fn.nvme_model is not None and fn.nvme_model != m.name:
        left_out.append(f"{fn.address}: model number {fn.nvme_model!r} (the catalogue's "
                        f"{key} is {m.name!r})")
    _note_ids(fn, m.subsystem_vendor_id, m.subsystem_device_id, "nvme", left_out)
    return _Entry(fields, fns, comment)


def _sriov(fn: _Function, max_vfs: int, what: str, left_out: list[str]) -> dict[str, int] | None:
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


def _comment(fns: list[_Function]) -> str:
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


def _numa_of(fn: _Function, numa_count: int, left_out: list[str]) -> int:
    if fn.numa_raw < numa_count:
        return max(fn.numa_raw, 0)
    left_out.append(f"{fn.address}: numa_node {fn.numa_raw} is not a NUMA node here; "
                    "captured as 0")
    return 0


def _classify(fns: list[_Function], numa_count: int, left_out: list[str]) -> _Entry:
    entry = _classify_type(fns, numa_count, left_out)
    fn = fns[0]
    if fn.aer_fatal > 0:  # a fatal AER error was reported: the device plugin's view
        entry.fields["health"] = "unhealthy"
        entry.fields["healthReason"] = "link-down" if fn.link_down else "aer-fatal"
    return entry


def _classify_type(fns: list[_Function], numa_count: int, left_out: list[str]) -> _Entry:
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
        _note_ids(fn, m.subsystem_vendor_id, m.subsystem_device_id, m.driver, left_out)
        return _Entry(fields, fns, comment)
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
        return _Entry(fields, fns, comment)
    fields = {"type": "generic", "vendorId": _Hex(fn.vendor, 4), "deviceId": _Hex(fn.device, 4),
              "classCode": _Hex(fn.class_code, 6), "numaNode": numa}
    if fn.driver and _DRIVER.fullmatch(fn.driver) and len(fn.driver) <= 64:
        fields["driver"] = fn.driver
    return _Entry(fields, fns, comment)


def _nic_entry(fns: list[_Function], nic: tuple[str, str], numa: int, comment: str,
               left_out: list[str]) -> _Entry:
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
    sriov = _sriov(fn, m.max_vfs, m.name, left_out)
    if sriov:
        fields["sriov"] = sriov
        if any(f.total_vfs != fn.total_vfs or f.num_vfs != fn.num_vfs for f in fns):
            left_out.append(f"{fn.address}: ports with different SR-IOV settings (captured "
                            "as port 0's)")
    _note_ids(fn, m.vendor_id, 0x0001, m.driver, left_out)
    return _Entry(fields, fns, comment)


def _note_ids(fn: _Function, svendor: int, sdevice: int, driver: str, left_out: list[str]
              ) -> None:
    if fn.subsystem != (svendor, sdevice):
        left_out.append(f"{fn.address}: subsystem {fn.subsystem[0]:04x}:{fn.subsystem[1]:04x} "
                        f"(the catalogue's model has {svendor:04x}:{sdevice:04x})")
    if fn.driver is not None and fn.driver != driver:
        left_out.append(f"{fn.address}: driver {fn.driver} (the tree binds {driver})")


def _group_functions(fns: list[_Function]) -> list[list[_Function]]:
    """Multi-port NICs: the functions 0..n-1 of one slot with the same ids are one card."""
    by_slot: dict[str, list[_Function]] = {}
    for fn in fns:
        by_slot.setdefault(fn.slot, []).append(fn)
    out: list[list[_Function]] = []
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


def _is_bridge(class_code: int) -> bool:
    return (class_code >> 16 == _BRIDGE_BASE_CLASS
            and class_code >> 8 != _OTHER_BRIDGE_CLASS)


def _read_pci(root: _Root, numa_count: int, left_out: list[str]
              ) -> tuple[list[_Entry], list[_Function]]:
    fns = [f for a in root.names(PCI_DIR, r"[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]")
           if (f := _read_function(root, a)) is not None]
    bridges = [f for f in fns if _is_bridge(f.class_code)]
    if bridges:
        shown = ", ".join(f"{f.address} ({f.ids} class {f.class_code:06x})" for f in bridges[:12])
        more = f" and {len(bridges) - 12} more" if len(bridges) > 12 else ""
        left_out.append(f"{len(bridges)} PCI bridge(s), which the resolver plans itself: "
                        f"{shown}{more}")
    vfs = [f for f in fns if f.is_vf and f not in bridges]
    if vfs:
        left_out.append(f"{len(vfs)} SR-IOV VFs: counted on their PF (numVFs); the resolver "
                        "plans their addresses")
    endpoints = [f for f in fns if f not in bridges and f not in vfs]
    if endpoints and all(f.iommu_group is not None for f in endpoints):
        # The resolver numbers IOMMU groups in profile order: keeping that order makes a
        # tree we rendered capture back to the same order.
        endpoints.sort(key=lambda f: (f.iommu_group or 0, f.address))
    if any(f.numa_raw < 0 for f in endpoints):
        left_out.append("PCI functions with numa_node -1 (no firmware affinity) are placed "
                        "on NUMA node 0: the tree always names a node")
    entries = [_classify(g, numa_count, left_out) for g in _group_functions(endpoints)]
    for e in entries:
        e.addresses = [e.functions[0].address]
    return entries, fns


def _merge(entries: list[_Entry]) -> list[_Entry]:
    """Consecutive identical entries become one with ``count``."""
    out: list[_Entry] = []
    for e in entries:
        last = out[-1] if out else None
        if last is not None and last.fields == e.fields and last.count < 1024:
            last.count += 1
            last.addresses += e.addresses
            last.functions += e.functions
            last.comment += "\n" + e.comment
        else:
            out.append(_Entry(dict(e.fields), list(e.functions), e.comment, 1,
                              list(e.addresses)))
    return out


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class _Hex:
    value: int
    digits: int


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, _Hex):
        return f"0x{value.value:0{value.digits}x}"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if re.fullmatch(r"[A-Za-z][A-Za-z0-9 ()+._/-]*", text) and text.lower() not in {
            "yes", "no", "on", "off", "true", "false", "null", "y", "n", "~"} \
            and not text.endswith(" ") and ": " not in text:
        return text
    return json.dumps(text)


def _flow(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return _scalar(value)


def _plain(value: Any) -> Any:
    if isinstance(value, _Hex):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _sanitize_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    return name or "captured"


def _hostname(root: _Root) -> str | None:
    for rel in ("proc/sys/kernel/hostname", "etc/hostname"):
        name = root.line(rel)
        if name:
            return name
    return None


@dataclass
class _Doc:
    name: str
    node_name: str
    description: str
    cpu: dict[str, Any]
    numa_nodes: list[dict[str, Any]]
    distances: list[list[int]] | None
    host_bridges: list[dict[str, Any]] | None
    entries: list[_Entry]
    with_addresses: bool
    extra: dict[str, Any] = field(default_factory=dict)  # swap, system

    def device(self, e: _Entry) -> dict[str, Any]:
        d = dict(e.fields)
        if e.count > 1:
            d = {**{k: v for k, v in d.items() if k in ("type", "vendor", "model")},
                 "count": e.count, **{k: v for k, v in d.items()
                                      if k not in ("type", "vendor", "model")}}
        if self.with_addresses:
            d["pciAddresses"] = list(e.addresses)
        return d

    def data(self) -> dict[str, Any]:
        numa: dict[str, Any] = {"nodes": self.numa_nodes}
        if self.distances is not None:
            numa["distances"] = self.distances
        node: dict[str, Any] = {"name": self.node_name, "cpu": self.cpu, **self.extra,
                                "numa": numa}
        if self.host_bridges is not None:
            node["pci"] = {"hostBridges": self.host_bridges}
        node["devices"] = [self.device(e) for e in self.entries]
        return {"apiVersion": API_VERSION, "kind": KIND,
                "metadata": {"name": self.name, "description": self.description},
                "nodes": [node]}

    def yaml(self, header: list[str]) -> str:
        lines = [f"# {h}" if h else "#" for h in header]
        lines += [f"apiVersion: {API_VERSION}", f"kind: {KIND}", "metadata:",
                  f"  name: {self.name}", f"  description: {_scalar(self.description)}",
                  "nodes:", f"  - name: {self.node_name}", "    cpu:"]
        lines += [f"      {k}: {_scalar(v)}" for k, v in self.cpu.items()]
        lines += [f"    {k}: {_flow(v)}" for k, v in self.extra.items()]
        lines += ["    numa:", "      nodes:"]
        lines += [f"        - {_flow(n)}" for n in self.numa_nodes]
        if self.distances is not None:
            lines.append("      distances:")
            lines += [f"        - {_flow(row)}" for row in self.distances]
        if self.host_bridges is not None:
            lines += ["    pci:", "      hostBridges:"]
            lines += [f"        - {_flow(h)}" for h in self.host_bridges]
        if not self.entries:
            lines.append("    devices: []")
        else:
            lines.append("    devices:")
            for e in self.entries:
                lines += [f"      # {c}" for c in e.comment.splitlines()]
                lines.append(f"      - {_flow(self.device(e))}")
        return "\n".join(lines) + "\n"


def _host_bridges(root: _Root, fns: list[_Function], numa_nodes: list[dict[str, Any]]
                  ) -> list[dict[str, Any]] | None:
    """The machine's root buses (``sys/devices/pciDDDD:BB``) with their NUMA node: that of
    the functions below them, else the node whose CPUs are the bus's ``cpulistaffinity``,
    else 0. None when they are the resolver's default (one per NUMA node, spread evenly)."""
    count = len(numa_nodes)
    found: dict[str, int] = {}
    for name in root.names("sys/devices", r"pci[0-9a-f]{4}:[0-9a-f]{2}"):
        below = [f.numa_raw for f in fns if f.root_bus == name and 0 <= f.numa_raw < count]
        if below:
            found[name] = below[0]
            continue
        bus = name[3:]
        cpus = root.line(f"sys/devices/{name}/pci_bus/{bus}/cpulistaffinity")
        found[name] = next((n["id"] for n in numa_nodes if cpus and n["cpus"] == cpus), 0)
    step = max(1, 256 // max(1, count))
    default = {f"pci0000:{n * step:02x}": n for n in range(count)}
    if not found or found == default:
        return None
    return [{"domain": _Hex(int(name[3:7], 16), 4), "bus": _Hex(int(name[8:10], 16), 2),
             "numaNode": numa} for name, numa in sorted(found.items())]


def _planned_matches(text: str, entries: list[_Entry]) -> bool:
    """Whether the resolver, left to plan, puts every function where the machine has it."""
    try:
        loaded = load_profile_text(text, "<capture>")
    except ProfileError:
        return False
    planned = {(f.address, f.vendor_id, f.device_id, f.class_code)
               for d in loaded.cluster.nodes[0].devices for f in d.functions}
    real = {(f.address, f.vendor, f.device, f.class_code) for e in entries for f in e.functions}
    return planned == real


def capture(root: str | os.PathLike[str] = "/", name: str | None = None,
            node_name: str | None = None, now: datetime.datetime | None = None) -> Capture:
    """Read ``root``'s sys/ and proc/ into a validated, commented profile."""
    r = _Root(root)
    _check_root(r)
    left_out: list[str] = []
    cpus = _read_cpus(r, left_out)
    numa_nodes = _read_numa(r, cpus, left_out)
    distances = _read_distances(r, len(numa_nodes), left_out)
    raw_entries, fns = _read_pci(r, len(numa_nodes), left_out)
    entries = _merge(raw_entries)
    host = _hostname(r)
    profile_name = _sanitize_name(name or host or "captured")
    node = _sanitize_name(node_name or host or "captured")
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    where = os.path.abspath(str(root))
    description = f"captured from {where}" + (f" (host {host})" if host else "") + f" at {stamp}"
    bridges = _host_bridges(r, fns, numa_nodes)
    extra: dict[str, Any] = {}
    swap = _read_swap(r)
    if swap is not None:
        extra["swap"] = swap
    system = _read_system(r)
    if system is not None:
        extra["system"] = system
    doc = _Doc(profile_name, node, _text(description, "captured"), cpus.fields, numa_nodes,
               distances, bridges, entries, False, extra)
    addresses_note = "PCI addresses: the resolver's plan gives every device its address here"
    addresses = "machine"
    if not _planned_matches(doc.yaml([]), entries):
        # Keep the machine's addresses: with its host bridges if the profile takes them.
        kept = [_Doc(**{**doc.__dict__, "with_addresses": True, "host_bridges": hb})
                for hb in ([bridges, None] if bridges is not None else [None])]
        problems = [_problem(k.yaml([])) for k in kept]
        ok = [k for k, problem in zip(kept, problems, strict=True) if problem is None]
        if ok:
            doc = ok[0]
            addresses_note = ("PCI addresses: kept as pciAddresses (the resolver's own plan "
                              "differs); the devices sit directly on their root bus in the "
                              "tree, without the machine's root ports")
        else:
            if _problem(doc.yaml([])) is not None:
                doc = _Doc(**{**doc.__dict__, "host_bridges": None})
            addresses = "planned"
            addresses_note = (f"PCI addresses: planned by the resolver (the machine's do not "
                              f"fit a profile: {problems[-1]})")
    left_out.insert(0, addresses_note)
    header = [
        "Hardware profile captured by `sandbox capture` (hw-sandbox " + __version__ + ")",
        f"  from: {where}" + (f" (host {host})" if host else ""),
        f"  at:   {stamp}",
        "Read: proc/cpuinfo, sys/devices/system/cpu (topology), sys/devices/system/node",
        "(cpulist, meminfo, hugepages, distance), proc/meminfo (SwapTotal), DMI",
        "(sys/devices/virtual/dmi/id), sys/bus/pci/devices (ids, class, numa_node,",
        "driver, SR-IOV, netdevs, NVMe namespaces, DRM nodes, fatal AER errors).",
        "Check it: sandbox validate FILE; see it: sandbox render FILE --out DIR.",
        "",
        "Left out or changed (the profile cannot say it, or capture does not read it):",
        "  - not read: CPU caches and flags, IOMMU groups, DMI serials and UUID, memory",
        "    blocks, block devices other than NVMe namespaces, GPU memory and partitions,",
        "    NIC link state, generic devices' /dev nodes, labels and kubelet settings",
        "  - generic devices' subsystem ids and revisions (the tree writes the vendor id",
        "    and 0); each device's real ids are in the comment above it",
    ]
    for note in left_out:
        header += _wrap(note)
    text = doc.yaml(header)
    problem = _problem(text)
    if problem is not None:  # a bug: every field was checked on the way in
        raise CaptureError(f"the captured profile does not validate: {problem}")
    return Capture(text, _plain(doc.data()), tuple(left_out), addresses)


def _problem(text: str) -> str | None:
    try:
        load_profile_text(text, "<capture>")
    except ProfileError as exc:
        return str(exc).splitlines()[0]
    return None


def _wrap(note: str, width: int = 86) -> list[str]:
    words = note.split(" ")
    lines: list[str] = []
    current = "  -"
    for w in words:
        if len(current) + 1 + len(w) > width and current.strip() not in ("-", ""):
            lines.append(current)
            current = "   "
        current += " " + w
    lines.append(current)
    return lines


def write_capture(result: Capture, path: str | os.PathLike[str], force: bool = False) -> None:
    """Write the profile to ``path`` ("-": stdout); an existing file only with ``force``."""
    if str(path) == "-":
        import sys

        sys.stdout.write(result.text)
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        raise CaptureError(f"{path}: exists; pass --force to overwrite it") from None
    except OSError as exc:
        raise CaptureError(f"cannot write {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(result.text)


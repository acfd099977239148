"""The os-level reads of a machine root: its files (``Root``) and each PCI function's sysfs
directory (``read_function``), and the few text values every reader shares.

``Root`` reads regular files only (a FIFO or device below ``--root`` is never opened for a
blocking read), up to 1 MiB each; nothing below the root is written.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.errors import SandboxError

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"
PCI_DIR = "sys/bus/pci/devices"
DMI_DIR = "sys/devices/virtual/dmi/id"
_READ_LIMIT = 1 << 20  # no sysfs or proc file we read is near this
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")



class CaptureError(SandboxError):
    """The root cannot be captured (not a sysfs-like tree) or the output cannot be written."""



class Root:
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



def check_root(root: Root) -> None:
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



def clean_text(value: str | None, default: str) -> str:
    if not value:
        return default
    return CONTROL.sub(" ", value)[:256]



def quantity(nbytes: int) -> str:
    for unit, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if nbytes and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)



def hostname(root: Root) -> str | None:
    for rel in ("proc/sys/kernel/hostname", "etc/hostname"):
        name = root.line(rel)
        if name:
            return name
    return None



@dataclass
class Function:
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



def read_function(root: Root, address: str) -> Function | None:
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
    fn = Function(
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

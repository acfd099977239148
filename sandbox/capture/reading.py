"""The os-level reads of a machine root: its files (``Root``) and each PCI function's sysfs
directory (``read_function``), and the few text values every reader shares.

``Root`` resolves every path inside the root, as a chroot would (openat2 RESOLVE_IN_ROOT),
reads regular files only (a FIFO or device below ``--root`` is never opened for a blocking
read), up to 64 KiB each; nothing below the root is written.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.errors import CaptureError

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"
PCI_DIR = "sys/bus/pci/devices"
DMI_DIR = "sys/devices/virtual/dmi/id"
_READ_LIMIT = 1 << 16  # no sysfs attribute or proc file we read is near this, but:
CPUINFO_LIMIT = 1 << 23  # proc/cpuinfo: ~1.5 KiB per CPU (flags), thousands of CPUs
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]$")
# What may not go into one line of YAML: control characters, line and paragraph
# separators, and the lone surrogates a name that is not UTF-8 decodes to (os.fsdecode);
# UTF-8 cannot encode those, so a profile holding one could not be written.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff]")






_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}  # same number on every arch since 5.6
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
# A scoped lookup (RESOLVE_IN_ROOT) that meets ``..`` fails with EAGAIN when any rename or
# mount happened anywhere on the system meanwhile (the kernel cannot then prove the ``..``
# stayed inside); every sysfs link is ``../../..``. Measured here with one process renaming
# a file in a loop: 4-6% of such opens failed, at most 5 in a row; a retry is what
# openat2(2) asks of its caller. Bounded, so a machine renaming without pause still ends.
_EAGAIN_TRIES = 64


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _openat2(dirfd: int, rel: str, flags: int) -> int:
    """openat2(2) with RESOLVE_IN_ROOT|RESOLVE_NO_MAGICLINKS: ``rel`` and every link met
    on the way (absolute, or ``..`` past the top) resolve below ``dirfd``, as in a chroot,
    so a hostile tree cannot point capture at a host file; relative links that stay inside
    (all of real sysfs's ``../../devices/...``) work as before. Raises OSError; ENOSYS
    (kernel older than 5.6, or seccomp) becomes a ``CaptureError`` in ``Root.__init__``:
    we refuse rather than resolve links in userspace, which races with the tree."""
    number = _SYS_OPENAT2.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, "openat2 not known on this architecture")
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    path = os.fsencode(rel or ".")
    for _ in range(_EAGAIN_TRIES):
        fd = _libc.syscall(number, dirfd, path, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    raise OSError(err, os.strerror(err), rel)


class Root:
    """The machine root, every lookup below it confined to it (see ``_openat2``).

    Files are opened O_NONBLOCK and read only when regular (a FIFO or device is missing),
    up to ``_READ_LIMIT`` bytes; a larger file is missing too, not taken in part."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = Path(root)
        self.where = shown(str(self.path))  # for messages: one line
        self._dirfd: int | None = None
        self._top = ""
        try:
            self._dirfd = os.open(self.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return  # check_root says it is not a directory
        try:
            os.close(_openat2(self._dirfd, ".", os.O_PATH))
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                raise CaptureError("capture needs openat2(2) (Linux 5.6 or later) to read "
                                   "a root safely; this kernel does not have it") from None
        try:  # where the root is, as the kernel names it (``real`` compares against it)
            self._top = os.readlink(f"/proc/self/fd/{self._dirfd}")
        except OSError:
            raise CaptureError("capture needs /proc mounted (it reopens each file it has "
                               "checked is a regular file through /proc/self/fd)") from None

    def __del__(self) -> None:
        if getattr(self, "_dirfd", None) is not None:
            os.close(self._dirfd)  # type: ignore[arg-type]

    def _open(self, rel: str, flags: int) -> int:
        if self._dirfd is None:
            raise OSError(errno.ENOENT, "no root", rel)
        return _openat2(self._dirfd, rel, flags)

    def read(self, rel: str, limit: int = _READ_LIMIT) -> str | None:
        """A regular file's text (sysfs and proc files are), None when missing, not
        regular, unreadable or larger than ``limit`` bytes.

        Only a regular file is ever opened for reading: the path is opened O_PATH (which
        opens nothing) and checked, then that same file reopened through /proc/self/fd.
        Opening a FIFO would let a writer waiting on it go on, and opening a device node
        runs its driver (a watchdog's arms it), O_NONBLOCK or not."""
        try:
            where = self._open(rel, os.O_PATH)
        except (OSError, ValueError):
            return None
        try:
            if not stat.S_ISREG(os.fstat(where).st_mode):
                return None
            fd = os.open(f"/proc/self/fd/{where}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        finally:
            os.close(where)
        try:  # the very file checked above: no second check
            data = _read_bounded(fd, limit)
        except OSError:
            return None
        finally:
            os.close(fd)
        return None if data is None else data.decode("utf-8", "replace")

    def line(self, rel: str) -> str | None:
        text = self.read(rel)
        return None if text is None else text.strip()

    def number(self, rel: str, base: int = 10) -> int | None:
        text = self.line(rel)
        if text is None:
            return None
        if not text.isascii():  # int() takes other scripts' digits; sysfs has none
            return None
        try:
            return int(text, base)
        except ValueError:  # not a number, or past int()'s 4,300 digits
            return None

    def names(self, rel: str, pattern: str) -> list[str]:
        try:
            fd = self._open(rel, os.O_RDONLY | os.O_DIRECTORY)
        except (OSError, ValueError):
            return []
        try:
            entries = os.listdir(fd)
        except OSError:
            return []
        finally:
            os.close(fd)
        rx = re.compile(pattern)
        return sorted(e for e in entries if rx.fullmatch(e))

    def link_name(self, rel: str) -> str | None:
        """The last component of a link's target; the link's directory is found inside
        the root, and the name is only text (cleaned where it is written)."""
        parent, _, leaf = rel.rstrip("/").rpartition("/")
        try:
            fd = self._open(parent, os.O_PATH | os.O_DIRECTORY)
        except (OSError, ValueError):
            return None
        try:
            name = os.path.basename(os.readlink(leaf, dir_fd=fd))
        except OSError:
            return None
        finally:
            os.close(fd)
        return clean_text(name, "", 64) or None

    def exists(self, rel: str) -> bool:
        try:
            os.close(self._open(rel, os.O_PATH | os.O_NOFOLLOW))
        except (OSError, ValueError):
            return False
        return True

    def real(self, rel: str) -> str | None:
        """``rel`` with its links resolved, relative to the root (for the PCI function's
        place in the device tree); None when it is not inside the root."""
        try:
            fd = self._open(rel, os.O_PATH)
        except (OSError, ValueError):
            return None
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        finally:
            os.close(fd)
        inside = os.path.relpath(where, self._top)
        return None if inside.startswith("..") else inside


def _read_bounded(fd: int, limit: int) -> bytes | None:
    """Up to ``limit`` bytes (proc files come in pieces); None when there is more."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = os.read(fd, limit + 1 - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
    return None



def decimal(text: str | None) -> int | None:
    """A count as sysfs and proc write one: ASCII digits (not the other scripts' digits
    or the superscripts ``str.isdigit`` takes, which ``int`` may not), up to 30; None for
    anything else."""
    text = (text or "").strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 30):
        return None
    return int(text)



def check_root(root: Root) -> None:
    where = root.where
    if not root.path.is_dir():
        raise CaptureError(f"{where}: not a directory (give --root a directory holding sys/ "
                           "and proc/, such as / or a `sandbox render` output)")
    if not root.names(CPU_DIR, r"cpu[0-9]+"):
        raise CaptureError(f"{where}: not a machine root: no {CPU_DIR}/cpuN directories "
                           "(give --root a directory holding sys/ and proc/, such as / or a "
                           "`sandbox render` output)")
    if root.read("proc/cpuinfo", CPUINFO_LIMIT) is None:
        raise CaptureError(f"{where}: not a machine root: no readable proc/cpuinfo")



def clean_text(value: str | None, default: str, limit: int = 256) -> str:
    """``value`` fit for one line of YAML (a comment or a scalar): control characters
    and line/paragraph separators, which would end a comment line, become spaces, and the
    length is bounded; ``default`` when nothing is left."""
    text = " ".join(CONTROL.sub(" ", value or "").split())[:limit].strip()
    return text or default



def shown(text: str) -> str:
    """``text`` (a path) for a one-line message: what ``clean_text`` would drop is
    escaped instead (a newline as ``\\n``), so the path stays recognisable."""
    return CONTROL.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), text)



def quantity(nbytes: int) -> str:
    for unit, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if nbytes and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)



def hostname(root: Root) -> str | None:
    for rel in ("proc/sys/kernel/hostname", "etc/hostname"):
        name = clean_text(root.line(rel), "", 64)  # it goes into the header and names
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
    physfn: str | None = None  # a VF's PF (its address)
    # (name, major, minor) of a class device below the function whose /dev node is at
    # /dev/<class>/<name> (class ``generic``: /dev/<name>): a generic device's devNodes
    dev_nodes: list[tuple[str, int, int]] = field(default_factory=list)
    # an NVIDIA GPU's MIG profiles as a sandbox tree's NVML state file lists them
    mig_profiles: list[dict[str, str]] = field(default_factory=list)
    vf_drivers: set[str] = field(default_factory=set)  # a PF's VFs' drivers

    @property
    def slot(self) -> str:
        return self.address[:-2]

    @property
    def ids(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"



def _id(root: Root, rel: str, digits: int) -> int | None:
    """A PCI id (``0x10de``): None unless it fits ``digits`` hex digits."""
    value = root.number(rel, 16)
    return value if value is not None and 0 <= value < 16**digits else None



def read_function(root: Root, address: str) -> Function | None:
    """The function's attributes; None when it has no vendor, device and class ids."""
    base = f"{PCI_DIR}/{address}"
    vendor, device = _id(root, f"{base}/vendor", 4), _id(root, f"{base}/device", 4)
    cls = _id(root, f"{base}/class", 6)
    if vendor is None or device is None or cls is None:
        return None
    parts = (root.real(base) or "").split(os.sep)
    root_bus = next((p for p in parts if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", p)), None)
    numa = root.number(f"{base}/numa_node")
    group = root.link_name(f"{base}/iommu_group")
    fn = Function(
        address=address, vendor=vendor, device=device,
        subsystem=(_id(root, f"{base}/subsystem_vendor", 4) or 0,
                   _id(root, f"{base}/subsystem_device", 4) or 0),
        class_code=cls, numa_raw=numa if numa is not None else -1,
        driver=root.link_name(f"{base}/driver"), root_bus=root_bus,
        is_vf=root.exists(f"{base}/physfn"), physfn=root.link_name(f"{base}/physfn"),
        total_vfs=decimal(root.line(f"{base}/sriov_totalvfs")) or 0,
        num_vfs=decimal(root.line(f"{base}/sriov_numvfs")) or 0,
        iommu_group=decimal(group),
    )
    for line in (root.read(f"{base}/aer_dev_fatal") or "").splitlines():
        key, _, count = line.partition(" ")
        if key == "TOTAL_ERR_FATAL" and decimal(count) is not None:
            fn.aer_fatal = decimal(count) or 0
    fn.link_down = root.line(f"{base}/current_link_speed") == "Unknown"
    # What is read below a function is bounded by what a profile can use (a link can
    # make every function share one huge directory): a NIC port's first netdev, up to 9
    # FPGA ports (a profile takes 8) and 17 NVMe namespaces (16).
    for net in root.names(f"{base}/net", r"[^/]+")[:1]:
        mac = root.line(f"{base}/net/{net}/address")
        speed = root.number(f"{base}/net/{net}/speed")
        fn.netdevs.append((net, mac, speed if speed is not None and speed > 0 else None))
    fn.rdma = bool(root.names(f"{base}/infiniband", r"[^/]+"))
    fn.drm = bool(root.names(f"{base}/drm", r"card[0-9]+"))
    for region in root.names(f"{base}/fpga_region", r"region[0-9]+")[:9]:
        ports = root.names(f"{base}/fpga_region/{region}", r"dfl-port\.[0-9]+")
        for port in sorted(ports, key=lambda p: int(p.split(".")[1]))[:9 - len(fn.fpga_afus)]:
            fn.fpga_afus.append(root.line(f"{base}/fpga_region/{region}/{port}/afu_id") or "")
    for ctrl in root.names(f"{base}/nvme", r"nvme[0-9]+")[:1]:
        cdir = f"{base}/nvme/{ctrl}"
        fn.nvme_model = root.line(f"{cdir}/model")
        disks = root.names(cdir, rf"{ctrl}n[0-9]+")
        for disk in sorted(disks, key=lambda n: int(n[len(ctrl) + 1:]))[:17]:
            fn.nvme_namespaces.append((root.number(f"{cdir}/{disk}/size") or 0,
                                       root.number(f"{cdir}/{disk}/queue/logical_block_size")))
    return fn

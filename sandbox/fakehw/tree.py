"""The in-memory fake root: directories, files, relative symlinks and device nodes
(``CharDevice``, ``BlockDevice``).

A ``Tree`` is the single source both servers use: ``render`` writes it to a plain
directory, the FUSE server serves it live. It is plain data with no I/O. Paths are
POSIX strings relative to the fake root, such as ``sys/bus/pci/devices/0000:17:00.0``.

``DeviceState`` is the mutable part of a node's hardware (health, presence, SR-IOV VF
count). The builder turns (profile, node, states) into a Tree; the live server rebuilds
and swaps trees when a state changes.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class File:
    data: bytes
    mode: int = 0o444


@dataclass(frozen=True)
class Symlink:
    target: str


@dataclass(frozen=True)
class CharDevice:
    major: int
    minor: int
    mode: int = 0o666


@dataclass(frozen=True)
class BlockDevice:
    """A block device node (an NVMe namespace's ``dev/nvme0n1``). A class of its own, not
    a flag on ``CharDevice``: an entry's class is its file type everywhere (readers that
    take ``CharDevice`` never meet a disk; a path whose type changes is a new inode)."""

    major: int
    minor: int
    mode: int = 0o660  # as udev makes disks (owner root, group disk)


DeviceNode = CharDevice | BlockDevice


@dataclass
class Dir:
    children: dict[str, Entry] = field(default_factory=dict)
    mode: int = 0o755


Entry = Dir | File | Symlink | CharDevice | BlockDevice


class Health(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class Reason(enum.Enum):
    """Why a device is unhealthy; each maps onto a real kernel interface (``SIGNS``)."""

    AER_FATAL = "aer-fatal"  # PCI aer_dev_fatal counters rise
    LINK_DOWN = "link-down"  # net operstate down, carrier 0
    PORT_DOWN = "port-down"  # InfiniBand port state DOWN
    REMOVED = "removed"  # device falls off the bus (same as unplug)
    # A GPU's uncorrectable memory (ECC) errors: NVML reports each as its own Xid; the PCI
    # side shows them as aer-fatal does.
    ROW_REMAP_PENDING = "row-remap-pending"  # a row remap recorded, reset needed (Xid 63)
    ROW_REMAP_FAILURE = "row-remap-failure"  # no spare row left to remap (Xid 64)
    ECC_CONTAINED = "ecc-contained"  # an ECC error contained to its application (Xid 94)
    ECC_UNCONTAINED = "ecc-uncontained"  # an ECC error that could not be contained (Xid 95)


@dataclass(frozen=True)
class Signs:
    """What the readers of a node's tree see of one unhealthy reason."""

    aer_fatal: str | None  # the uncorrectable error aer_dev_fatal counts (None: none)
    pci_link_down: bool  # current_link_speed "Unknown", current_link_width 0
    xid: int  # the critical Xid NVML delivers for an NVIDIA GPU (docs/nvml.md)


# The one table of what each reason shows, for every reader (docs/sysfs-reference.md,
# docs/nvml.md). A NIC's link-down is its network link instead (operstate, carrier: _net)
# and port-down its InfiniBand ports; a removed device is gone from the tree.
SIGNS = {
    Reason.AER_FATAL: Signs("UncorrIntErr", False, 48),  # 48: double-bit ECC error
    Reason.LINK_DOWN: Signs("SDES", True, 79),  # 79: GPU has fallen off the bus
    Reason.PORT_DOWN: Signs(None, False, 74),  # 74: NVLink error
    Reason.REMOVED: Signs(None, False, 79),
    Reason.ROW_REMAP_PENDING: Signs("UncorrIntErr", False, 63),
    Reason.ROW_REMAP_FAILURE: Signs("UncorrIntErr", False, 64),
    Reason.ECC_CONTAINED: Signs("UncorrIntErr", False, 94),
    Reason.ECC_UNCONTAINED: Signs("UncorrIntErr", False, 95),
}


@dataclass(frozen=True, order=True)
class GpuInstance:
    """One MIG GPU instance of a GPU, as NVML's lifecycle calls leave it (docs/nvml.md,
    "Dynamic MIG"): each holds at most one compute instance, spanning it."""

    gi: int  # GPU instance id (1..MAX_GPU_INSTANCES)
    profile: int  # NVML GPU-instance profile id (by compute slices: 1,2,3,4,7,8,6 -> 0..6)
    start: int  # first memory slice (its placement)
    ci: bool = True  # its compute instance (id 0) exists


@dataclass(frozen=True)
class MigProfile:
    """A GPU-instance profile a MIG GPU offers."""

    id: int
    name: str  # 3g.40gb
    compute_slices: int
    memory_slices: int


@dataclass(frozen=True)
class MigGeometry:
    """What a MIG-capable GPU's profile fixes: its slices and profiles, and the MIG mode
    and instances it starts with (``sandbox.fakehw.mig`` changes them)."""

    memory_slices: int
    compute_slices: int
    profiles: tuple[MigProfile, ...]
    mode: bool
    layout: tuple[GpuInstance, ...]


@dataclass(frozen=True)
class DeviceState:
    """The runtime-changeable state of one device."""

    health: Health = Health.HEALTHY
    reason: Reason | None = None
    plugged: bool = True
    num_vfs: int | None = None  # None: the profile's numVFs (on every physical function)
    # Per-port overrides, (port, count) sorted by port: the kernel has one sriov_numvfs per
    # physical function, so a dual-port card's ports are set apart.
    port_vfs: tuple[tuple[int, int], ...] = ()
    # MIG (NVIDIA GPUs): None as the profile says; else set by NVML's lifecycle calls
    # (sandbox.fakehw.mig): the mode, and the GPU instances sorted by id.
    mig_mode: bool | None = None
    mig: tuple[GpuInstance, ...] | None = None

    def vfs_of(self, port: int) -> int | None:
        """The VF count set for ``port`` (its own, else the device's); None: the profile's."""
        for p, n in self.port_vfs:
            if p == port:
                return n
        return self.num_vfs


@dataclass(frozen=True)
class DeviceRecord:
    """What the tree knows about one device it contains, for listings and control."""

    id: str  # stable id, as `sandbox show` prints it (gpu0, nic1, ...)
    kind: str  # gpu | nic | fpga | generic
    vendor: str
    model: str
    pci_address: str
    numa_node: int
    dev_nodes: tuple[str, ...]  # paths under dev/ that belong to this device
    state: DeviceState
    mig: MigGeometry | None = None  # a MIG-capable GPU's slices and profiles


class TreeError(Exception):
    """A programming error while building a tree (a path used twice, a missing parent)."""


def check_component(name: str) -> str:
    """``name`` if it is one plain path component (what every tree entry name must be):
    not empty, not ``.`` or ``..``, no ``/`` or NUL. ValueError otherwise."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{name!r} is not a plain file name")
    return name


PartialBuild = Callable[[Mapping[str, DeviceState], Collection[str]], "Tree"]


class Tree:
    """A whole fake root. Build it with the add_* methods; read it with get/walk.

    ``partial(states, devices)``, when the builder sets it, builds only what the states
    of ``devices`` decide (``build.build_partial``): the live server diffs two of those
    instead of two whole trees."""

    def __init__(self, root: Dir | None = None) -> None:
        self.root = root if root is not None else Dir()
        self.devices: dict[str, DeviceRecord] = {}
        self.partial: PartialBuild | None = None

    # -- building -------------------------------------------------------------------
    def mkdir(self, path: str, mode: int = 0o755) -> Dir:
        node = self.root
        for part in _parts(path):
            child = node.children.get(part)
            if child is None:
                check_entry(path, part)
                child = Dir(mode=mode)
                node.children[part] = child
            elif not isinstance(child, Dir):
                raise TreeError(f"{path}: {part} is not a directory")
            node = child
        return node

    def _put(self, path: str, entry: Entry) -> None:
        parent, _, name = path.rpartition("/")
        check_entry(path, name)
        directory = self.mkdir(parent) if parent else self.root
        if name in directory.children:
            raise TreeError(f"{path}: already exists")
        directory.children[name] = entry

    def add_file(self, path: str, data: str | bytes, mode: int = 0o444) -> None:
        self._put(path, File(data.encode() if isinstance(data, str) else data, mode))

    def add_link(self, path: str, target: str) -> None:
        if target.startswith("/"):
            raise TreeError(f"{path}: symlink target {target!r} is absolute")
        self._put(path, Symlink(target))

    def add_chardev(self, path: str, major: int, minor: int, mode: int = 0o666) -> None:
        self._put(path, CharDevice(major, minor, mode))

    def add_blockdev(self, path: str, major: int, minor: int, mode: int = 0o660) -> None:
        self._put(path, BlockDevice(major, minor, mode))

    # -- reading --------------------------------------------------------------------
    def get(self, path: str) -> Entry | None:
        node: Entry = self.root
        for part in _parts(path):
            if not isinstance(node, Dir):
                return None
            child = node.children.get(part)
            if child is None:
                return None
            node = child
        return node

    def walk(self) -> Iterator[tuple[str, Entry]]:
        """Every entry below the root (not the root itself), parents first, sorted."""
        stack: list[tuple[str, Dir]] = [("", self.root)]
        while stack:
            prefix, directory = stack.pop()
            names = sorted(directory.children)
            subdirs: list[tuple[str, Dir]] = []
            for name in names:
                entry = directory.children[name]
                path = f"{prefix}/{name}" if prefix else name
                yield path, entry
                if isinstance(entry, Dir):
                    subdirs.append((path, entry))
            stack.extend(reversed(subdirs))

    def digest(self) -> str:
        """A hash of every path, type and content: equal digests mean equal trees."""
        h = hashlib.sha256()
        for path, entry in self.walk():
            h.update(path.encode() + b"\0")
            if isinstance(entry, File):
                h.update(b"F%o\0" % entry.mode + entry.data + b"\0")
            elif isinstance(entry, Symlink):
                h.update(b"L" + entry.target.encode() + b"\0")
            elif isinstance(entry, CharDevice):
                h.update(b"C%d:%d:%o\0" % (entry.major, entry.minor, entry.mode))
            elif isinstance(entry, BlockDevice):
                h.update(b"B%d:%d:%o\0" % (entry.major, entry.minor, entry.mode))
            else:
                h.update(b"D%o\0" % entry.mode)
        return h.hexdigest()


def check_entry(path: str, name: str) -> None:
    """TreeError unless ``name`` (the last part of ``path``) is one plain component."""
    try:
        check_component(name)
    except ValueError as exc:
        raise TreeError(f"{path}: {exc}") from None


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p]

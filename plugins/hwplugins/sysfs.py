"""Reading a (possibly fake) ``sys/`` and ``dev/`` under a root: what every plugin shares.

Every read stays inside the root and treats a vanished or unreadable file as absent
(a device may leave the bus between two reads), never as an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def read(path: Path) -> str | None:
    """A sysfs attribute, stripped; None when absent or unreadable."""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def read_int(path: Path, base: int = 10) -> int | None:
    text = read(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def numa_node(pci_dir: Path) -> int | None:
    """The device's ``numa_node``; None for -1 (no affinity) or when absent."""
    node = read_int(pci_dir / "numa_node")
    return node if node is not None and node >= 0 else None


def aer_fatal_count(pci_dir: Path) -> int:
    """TOTAL_ERR_FATAL from ``aer_dev_fatal`` (0 when the file is absent or unparsable)."""
    for line in (read(pci_dir / "aer_dev_fatal") or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "TOTAL_ERR_FATAL" and parts[1].isdigit():
            return int(parts[1])
    return 0


@dataclass(frozen=True)
class PciFunction:
    address: str
    path: Path
    vendor: int
    device: int
    pci_class: int
    physfn: bool  # an SR-IOV virtual function


class SysRoot:
    """Path helpers for one root (``/`` on a real node, a fake tree in the sandbox)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.dev = root / "dev"

    def dev_exists(self, node: str) -> bool:
        # lexists: a node may be a char device, a placeholder file or even a dangling link.
        return os.path.lexists(self.dev / node.removeprefix("/dev/"))

    def pci_functions(self) -> list[PciFunction]:
        """Every function under ``sys/bus/pci/devices`` with readable ids, by address."""
        base = self.sys / "bus" / "pci" / "devices"
        found = []
        for name in listdir(base):
            path = base / name
            if not path.is_dir():  # dangling link: the device left the bus
                continue
            vendor = read_int(path / "vendor", 16)
            pci_class = read_int(path / "class", 16)
            if vendor is None or pci_class is None:
                continue
            device = read_int(path / "device", 16) or 0  # 0: not given (hand-made trees)
            found.append(PciFunction(name, path, vendor, device, pci_class,
                                     os.path.lexists(path / "physfn")))
        return found

    def pcie_root(self, address: str) -> str | None:
        """``pci<domain>:<bus>`` of the root complex, as k8s.io/dynamic-resource-allocation's
        deviceattribute resolves it: the first component of the bus link's target."""
        link = Path("bus", "pci", "devices", address)
        try:
            target = os.readlink(self.sys / link)
        except OSError:
            return None
        parts = os.path.normpath(os.path.join(str(link.parent), target)).split(os.sep)
        if len(parts) < 3 or parts[0] != "devices" or not parts[1].startswith("pci"):
            return None
        return parts[1]

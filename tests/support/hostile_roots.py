"""Hostile sysfs roots for the capture fuzz (tests/capture/test_capture_fuzz.py): a small
valid machine built from a seeded ``random.Random``, then random hostile mutations (links
out of the root, FIFOs, sockets and device nodes where files belong, huge and binary files,
odd numbers, lines and names, loops, missing files); the canaries outside the root; and an
inotify ``Watch`` that reports every open and read below a path."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import socket
import stat
import struct
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox.capture.reading import CPUINFO_LIMIT
from sandbox.profile import catalogue

CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"
DMI = "sys/devices/virtual/dmi/id"
PCI = "sys/bus/pci/devices"
HOST = "sys/devices/pci0000:00"

# Odd file contents: numbers past every range, signs, Unicode digits int() takes (and
# the superscripts str.isdigit() takes but int() does not), floats Python parses but
# cannot round, cpulists too long to expand, text that ends YAML lines.
ODD_VALUES = [
    "", " ", "\n", "-1", "-0x1", "0", "0x0", "00000000000000000000000000007", "+3", " 7 ",
    "1_000", "99999999999999999999999999", "9" * 5000, "0x", "0xffffffffffffffff",
    "0x1ffff", "0x1ffffff", "-5", "inf", "-inf", "nan", "1e999", "²", "١٢", "①",
    "0-65535", "0-4294967295", "65535-0", "0,0,0,0", "0-65535," * 8000, "1-", "-", ",",
    "Unknown", "\x00\x00", "\u2028", "evil\n%YAML 1.2\n---\nfoo: bar", "x" * 300,
    "\ufeff12", "12\r", "TOTAL_ERR_FATAL ²", "TOTAL_ERR_FATAL 99999999999999999999",
    "4096 4096", "10 ²", "10 " + "9" * 5000, "00:11:22:33:44:55", "zz:zz",
]
ODD_LINES = [
    "cpu family\t: -1", "model\t\t: -7", "cpu family\t: 0x" + "f" * 5000, "cpu MHz\t\t: inf",
    "cpu MHz\t\t: 1e999", "cpu MHz\t\t: nan", "cpu MHz\t\t: 1e30", "model name\t: \u2028x",
    "vendor_id\t: \x1b[31m", "MemTotal:       ² kB", "MemTotal: 99999999999999999999 kB",
    "MemTotal: 1125899906842624 kB", "SwapTotal:  1125899906842624 kB", "SwapTotal: ² kB",
    "Node 0 MemTotal: " + "9" * 5000 + " kB", "MemTotal: -5 kB", "processor\t: 0",
]
ODD_NAMES: list[str | bytes] = [
    "x\ny", "x\u2028y", b"x\xff\xfey", "cpu1\n", "cpu\u20281", b"cpu\xff", "node0\n",
    "0000:00:09.0\n", b"0000:00:0a.0\xff", "eth\u2028x", b"eth\xff", "nvme0n9\n",
    "hugepages-2048kB\u2028", "region0\n", "dfl-port.1\u2029", "card1\n", ".", "-",
    "cpu99999999999999999999", "node4294967296", "hugepages-99999999999999999kB",
    "nvme0n99999999999999999999", "dfl-port.99999999999999999999",
]


# --- a small machine -----------------------------------------------------------------


def _write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


def _attrs(base: Path, values: dict[str, str]) -> None:
    for name, value in values.items():
        _write(base / name, value + "\n")


def _function(root: Path, address: str, ids: tuple[int, int, int],
              extra: dict[str, str] | None = None) -> str:
    vendor, device, cls = ids
    rel = f"{HOST}/{address}"
    _attrs(root / rel, {"vendor": f"0x{vendor:04x}", "device": f"0x{device:04x}",
                        "class": f"0x{cls:06x}", "numa_node": "0",
                        "subsystem_vendor": f"0x{vendor:04x}", "subsystem_device": "0x0001",
                        **(extra or {})})
    (root / PCI).mkdir(parents=True, exist_ok=True)
    os.symlink(f"../../../devices/pci0000:00/{address}", root / PCI / address)
    return rel


def _driver(root: Path, rel: str, name: str, group: int) -> None:
    os.symlink(f"../../../bus/pci/drivers/{name}", root / rel / "driver")
    os.symlink(f"../../../kernel/iommu_groups/{group}", root / rel / "iommu_group")


def _machine(root: Path, rng: random.Random) -> None:
    """A valid machine: 1 to 4 CPUs, 0 to 2 NUMA nodes, DMI, and up to 7 PCI functions."""
    ncpu = rng.choice([1, 2, 4])
    threads = 2 if ncpu > 1 and rng.random() < 0.5 else 1
    cores = ncpu // threads
    for cpu in range(ncpu):
        core = cpu % cores
        siblings = ",".join(str(core + t * cores) for t in range(threads))
        _attrs(root / CPU / f"cpu{cpu}" / "topology", {
            "physical_package_id": "0", "core_id": str(core), "thread_siblings_list": siblings})
    _attrs(root / CPU, {"online": f"0-{ncpu - 1}", "present": f"0-{ncpu - 1}"})
    _write(root / "proc/cpuinfo", "".join(
        f"processor\t: {c}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
        f"model name\t: Fuzz CPU\ncpu MHz\t\t: 2100.000\n\n" for c in range(ncpu)))
    _write(root / "proc/meminfo", "MemTotal:        8388608 kB\nSwapTotal:       1048572 kB\n")
    _write(root / "proc/swaps",
           "Filename\tType\tSize\tUsed\tPriority\n/swap\tfile\t1048572\t0\t-2\n")
    _write(root / "proc/sys/kernel/hostname", f"fuzz-{rng.randrange(1000)}\n")
    nodes = rng.choice([0, 1, 2]) if ncpu > 1 else rng.choice([0, 1])
    for n in range(nodes):
        mine = [c for c in range(ncpu) if c % nodes == n]
        base = root / NODE / f"node{n}"
        _attrs(base, {"cpulist": ",".join(map(str, mine)),
                      "meminfo": f"Node {n} MemTotal:       4194304 kB",
                      "distance": " ".join("10" if m == n else "20" for m in range(nodes))})
        _attrs(base / "hugepages/hugepages-2048kB", {"nr_hugepages": str(rng.choice([0, 16]))})
    _attrs(root / DMI, {"sys_vendor": "Acme", "product_name": "Fuzz Box", "product_version": "1",
                        "board_vendor": "Acme", "board_name": "B1", "bios_vendor": "Acme",
                        "bios_version": "1.0", "bios_date": "01/02/2024", "chassis_type": "23"})
    _attrs(root / HOST / "pci_bus/0000:00", {"cpulistaffinity": f"0-{ncpu - 1}"})
    generic = _function(root, "0000:00:01.0", (0x1234, 0x5678, 0x088000))
    _driver(root, generic, "acme", 1)
    kinds = rng.sample(["nic", "nvme", "gpu", "fpga", "bridge"], rng.randint(0, 3))
    if "nic" in kinds:
        nic = catalogue.NICS["mellanox"]["connectx-6"]
        ids = (nic.vendor_id, nic.device_id, nic.class_code)
        for port in range(2):
            rel = _function(root, f"0000:00:02.{port}", ids,
                            {"sriov_totalvfs": "8", "sriov_numvfs": "1"})
            _driver(root, rel, "mlx5_core", 2 + port)
            _attrs(root / rel / f"net/eth{port}", {"address": f"0c:42:a1:00:00:0{port}",
                                                   "speed": "100000"})
            (root / rel / "infiniband" / f"mlx5_{port}").mkdir(parents=True)
        vf = _function(root, "0000:00:02.2", (nic.vendor_id, 0x101c, nic.class_code))
        os.symlink("../0000:00:02.0", root / vf / "physfn")
    if "nvme" in kinds:
        nvme = catalogue.NVMES["samsung"]["pm1733"]
        rel = _function(root, "0000:00:03.0", (nvme.vendor_id, nvme.device_id, 0x010802))
        _attrs(root / rel / "nvme/nvme0", {"model": nvme.name})
        _attrs(root / rel / "nvme/nvme0/nvme0n1", {"size": str(nvme.capacity // 512)})
        _attrs(root / rel / "nvme/nvme0/nvme0n1/queue", {"logical_block_size": "512"})
    if "gpu" in kinds:
        gpu = catalogue.GPUS["nvidia"]["h100-sxm5-80gb"]
        rel = _function(root, "0000:00:04.0", (gpu.vendor_id, gpu.device_id, gpu.class_code),
                        {"aer_dev_fatal": "TOTAL_ERR_FATAL 0", "current_link_speed": "32.0 GT/s"})
        (root / rel / "drm/card0").mkdir(parents=True)
    if "fpga" in kinds:
        f = catalogue.FPGAS["intel"]["pac-a10"]
        rel = _function(root, "0000:00:05.0", (f.vendor_id, f.device_id, f.class_code))
        _attrs(root / rel / "fpga_region/region0/dfl-port.0", {"afu_id": "0" * 31 + "1"})
    if "bridge" in kinds:
        _function(root, "0000:00:06.0", (0x8086, 0x2030, 0x060400))


# Paths capture looks up that a machine need not have: mutations may create them.
LOOKED_UP = [
    f"{CPU}/present", "etc/hostname", f"{DMI}/bios_date", f"{NODE}/node1/cpulist",
    f"{PCI}/0000:00:01.0/physfn", f"{PCI}/0000:00:01.0/sriov_totalvfs",
    f"{PCI}/0000:00:01.0/sriov_numvfs", f"{PCI}/0000:00:01.0/aer_dev_fatal",
    f"{PCI}/0000:00:01.0/current_link_speed", f"{PCI}/0000:00:01.0/net",
    f"{PCI}/0000:00:01.0/nvme", f"{PCI}/0000:00:07.0", f"{CPU}/cpu9/topology/core_id",
    f"{NODE}/node0/hugepages/hugepages-1048576kB/nr_hugepages", "proc/swaps",
]


# --- hostile mutations ----------------------------------------------------------------


class HostileRoot:
    """One root being built: its paths, the canaries outside it, the special files made."""

    def __init__(self, root: Path, outside: Path, rng: random.Random) -> None:
        self.root, self.outside, self.rng = root, outside, rng
        self.special: list[Path] = []  # FIFOs, sockets, device nodes inside the root
        self.kinds: list[str] = []
        self.paths: list[str] = LOOKED_UP[:]  # the machine's, listed once (some may go)
        for top, dirs, files in os.walk(root):  # links are listed, not followed
            rel = os.path.relpath(top, root)
            self.paths += [os.path.join(rel, n) if rel != "." else n for n in dirs + files]
        self.deep = [p for p in self.paths if len(Path(p).parts) >= 4]

    def safe(self, rel: str) -> bool:
        """Whether ``rel`` can be changed without leaving the root: no directory on the way
        is a link or a non-directory (mutating through one would write outside)."""
        path = self.root
        for part in Path(rel).parts[:-1]:
            path = path / part
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return True  # the rest is made as plain directories
            if not stat.S_ISDIR(mode):
                return False
        return True

    def clear(self, rel: str) -> Path:
        """``rel`` removed (never following a link), its parent a directory."""
        path = self.root / rel
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def put(self, rel: str, text: str) -> None:
        """A file ``rel`` holding ``text``, unless the way there has a link or a file."""
        if self.safe(rel):
            self.clear(rel).write_text(text + "\n")

    def escape(self, rel: str, target: str) -> str:
        """A link target reaching ``outside/target`` from ``rel``: absolute, or climbing
        with ``..`` to the roots' parent or past the filesystem's top."""
        canary = str(self.outside / target).rstrip("/")
        choice = self.rng.randrange(3)
        if choice == 0:
            return canary
        if choice == 1:
            return os.path.relpath(canary, (self.root / rel).parent)
        return "../" * (len(Path(rel).parts) + 40) + canary.lstrip("/")

    def mutate(self) -> None:
        rng = self.rng  # mostly files and deep directories: sys/ gone tests little
        rel = rng.choice(self.deep if rng.random() < 0.85 else self.paths)
        kind = rng.choice(MUTATIONS)
        if not self.safe(rel):
            return
        self.kinds.append(kind.__name__)
        kind(self, rel)


def _link_out(t: HostileRoot, rel: str) -> None:
    canary = t.rng.choice(["secret", "fifo", "dir", "", f"dir/{Path(rel).name}"])
    os.symlink(t.escape(rel, canary), t.clear(rel))


def _link_in(t: HostileRoot, rel: str) -> None:
    other = t.rng.choice(t.paths)
    target = ("/" + other) if t.rng.random() < 0.5 else (
        "../" * (len(Path(rel).parts) - 1) + other)
    os.symlink(target, t.clear(rel))


def _loop(t: HostileRoot, rel: str) -> None:
    path = t.clear(rel)
    choice = t.rng.randrange(4)
    if choice == 0:
        os.symlink(path.name, path)  # itself
    elif choice == 1:
        os.symlink(path.name + ".b", path)
        if not os.path.lexists(str(path) + ".b"):
            os.symlink(path.name, str(path) + ".b")
    else:
        os.symlink(["..", "/"][choice - 2], path)  # a directory containing itself


def _dangling(t: HostileRoot, rel: str) -> None:
    os.symlink(t.rng.choice(["nowhere/at/all", "/nowhere", "../" * 30 + "nowhere"]),
               t.clear(rel))


def _fifo(t: HostileRoot, rel: str) -> None:
    path = t.clear(rel)
    os.mkfifo(path)
    t.special.append(path)


def _socket(t: HostileRoot, rel: str) -> None:
    path = t.clear(rel)
    if len(os.fsencode(path.name)) >= 100:
        return  # longer than a socket address
    here = os.getcwd()
    os.chdir(path.parent)  # the full path may be longer than a socket address takes
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.fsencode(path.name))
    finally:
        os.chdir(here)
    t.special.append(path)


def _device(t: HostileRoot, rel: str) -> None:
    path = t.clear(rel)
    try:  # /dev/null's and /dev/zero's numbers: harmless if opened
        os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, t.rng.choice([3, 5])))
    except PermissionError:
        return  # no CAP_MKNOD here
    t.special.append(path)


def _huge(t: HostileRoot, rel: str) -> None:
    path = t.clear(rel)
    with open(path, "wb") as f:
        f.truncate(t.rng.choice([(1 << 16) + 1, CPUINFO_LIMIT + 1, 1 << 40]))


def _binary(t: HostileRoot, rel: str) -> None:
    data = bytes(t.rng.randrange(256) for _ in range(t.rng.randrange(1, 200)))
    t.clear(rel).write_bytes(data)


def _odd_value(t: HostileRoot, rel: str) -> None:
    t.clear(rel).write_text(t.rng.choice(ODD_VALUES) + t.rng.choice(["", "\n"]))


def _odd_lines(t: HostileRoot, rel: str) -> None:
    path = t.root / rel
    lines = path.read_text(errors="replace").splitlines() if (
        path.is_file() and not path.is_symlink() and path.stat().st_size < 4096) else []
    for _ in range(t.rng.randint(1, 3)):
        lines.insert(t.rng.randint(0, len(lines)), t.rng.choice(ODD_LINES))
    t.clear(rel).write_text("\n".join(lines) + "\n")


def _dir_for_file(t: HostileRoot, rel: str) -> None:
    path = t.clear(rel)
    path.mkdir()
    if t.rng.random() < 0.5:
        (path / "0").write_text("0\n")


def _file_for_dir(t: HostileRoot, rel: str) -> None:
    t.clear(rel).write_text(t.rng.choice(["0\n", "", "cpu0\n"]))


def _remove(t: HostileRoot, rel: str) -> None:
    t.clear(rel)


def _odd_name(t: HostileRoot, rel: str) -> None:
    """An entry with an odd name next to ``rel``: a copy of it, a link or a directory."""
    parent = (t.root / rel).parent
    if not parent.is_dir() or parent.is_symlink():
        return
    name = t.rng.choice(ODD_NAMES)
    path = os.path.join(os.fsencode(parent), os.fsencode(name))
    if os.path.lexists(path):
        return
    choice = t.rng.randrange(3)
    if choice == 0:
        os.symlink(os.fsencode(Path(rel).name), path)
    elif choice == 1:
        os.mkdir(path)
        with open(os.path.join(path, b"0"), "w") as f:
            f.write("0\n")
    else:
        with open(path, "w") as f:
            f.write(t.rng.choice(ODD_VALUES))


def _odd_link_name(t: HostileRoot, rel: str) -> None:
    """A link whose target's name is odd (capture takes a driver's or group's name from
    its link's target)."""
    name = t.rng.choice(ODD_NAMES + ["evil\u2028x: y\n%YAML 1.2", "9" * 200, "²"])
    os.symlink(b"../../bus/pci/drivers/" + os.fsencode(name), os.fsencode(t.clear(rel)))


def _duplicate(t: HostileRoot, rel: str) -> None:
    """More entries where capture lists them: another name for a PCI function, another
    CPU or NUMA node directory."""
    choice = t.rng.randrange(3)
    if choice == 0:
        path = t.root / PCI / f"0000:{t.rng.randrange(256):02x}:1f.{t.rng.randrange(8)}"
        if t.safe(f"{PCI}/x") and not os.path.lexists(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(f"../../../devices/pci0000:00/0000:00:0{t.rng.randrange(1, 7)}.0", path)
    elif choice == 1:
        rel = f"{CPU}/cpu{t.rng.choice([7, 1023, 65536, 10**12])}/topology"
        t.put(f"{rel}/core_id", t.rng.choice(["0", "7", "-1"]))
        t.put(f"{rel}/physical_package_id", "0")
    else:
        rel = f"{NODE}/node{t.rng.choice([1, 5, 63, 64])}"
        t.put(f"{rel}/cpulist", t.rng.choice(["0", "0-3", "", "1-0"]))
        t.put(f"{rel}/meminfo", "MemTotal: 1 kB")


MUTATIONS: list[Callable[[HostileRoot, str], None]] = [
    _link_out, _link_out, _link_out, _link_in, _loop, _dangling, _fifo, _socket, _device,
    _huge, _binary, _odd_value, _odd_value, _odd_value, _odd_lines, _dir_for_file,
    _file_for_dir, _remove, _odd_name, _odd_link_name, _duplicate,
]


def build(base: Path, outside: Path, seed: int) -> HostileRoot:
    """Root number ``seed`` below ``base`` (made fresh), mutated; ``outside`` holds the
    canaries its links point at."""
    rng = random.Random(seed)
    name: str = f"root-{seed}"
    if rng.random() < 0.05:
        name += rng.choice(["\nfoo: bar", "\u2028x", " ", os.fsdecode(b"\xff\xfe")])
    root = base / name
    if os.path.lexists(root):
        shutil.rmtree(root)
    root.mkdir(parents=True)
    _machine(root, rng)
    tree = HostileRoot(root, outside, rng)
    for _ in range(rng.choice([1, 1, 2, 3, 4, 6, 10])):
        tree.mutate()
    return tree


def make_outside(outside: Path, secret: str) -> None:
    """The canaries: a file and a directory of attributes holding ``secret``, a FIFO."""
    outside.mkdir(parents=True)
    (outside / "secret").write_text(secret + "\n")
    os.mkfifo(outside / "fifo")
    names = {"vendor", "device", "class", "product_name", "sys_vendor", "hostname",
             "cpulist", "meminfo", "online", "core_id", "model", "address", "size"}
    for n in names:
        (outside / "dir" / n).parent.mkdir(exist_ok=True)
        (outside / "dir" / n).write_text(secret + "\n")
    (outside / "dir" / "cpu0").mkdir()
    (outside / "dir" / "cpuinfo").write_text(f"processor\t: 0\nmodel name\t: {secret}\n")


# --- watching for opens ---------------------------------------------------------------


class Watch:
    """inotify on some paths: which of them (or, for a directory, its entries) were opened
    or read since the last ``events()``, by any process."""

    _MASK = 0x1 | 0x20  # IN_ACCESS | IN_OPEN

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            pytest.skip("no inotify")
        self._names: dict[int, str] = {}

    def add(self, path: Path | str) -> None:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path),
                                          self._MASK | 0x02000000)  # IN_DONT_FOLLOW
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path!r}")
        self._names[wd] = os.fsdecode(path)

    def events(self) -> list[str]:
        out: list[str] = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            i = 0
            while i + 16 <= len(data):
                wd, mask, _cookie, size = struct.unpack_from("iIII", data, i)
                name = data[i + 16:i + 16 + size].rstrip(b"\0").decode(errors="replace")
                i += 16 + size
                if mask & self._MASK:
                    where = os.path.join(self._names.get(wd, "?"), name)
                    out.append(f"{'open' if mask & 0x20 else 'read'} {where}")

    def close(self) -> None:
        os.close(self.fd)

    def proven(self, path: Path, flags: int = os.O_RDONLY) -> None:
        """Check the watch sees an open of ``path`` here (so that seeing none means none
        happened), and forget it."""
        os.close(os.open(path, flags | os.O_NONBLOCK))
        assert self.events(), f"inotify did not report an open of {path}"


def one_line(path: Path) -> str:
    """How an error names the root: what would break the line escaped (a newline as
    ``\\n``, U+2028 as ``\\u2028``, a byte that is not UTF-8 as ``\\udcff``)."""
    return "".join(c.encode("unicode_escape").decode() if (
        unicodedata.category(c) in ("Cc", "Zl", "Zp", "Cs") or c == "\ufeff") else c
        for c in str(path))

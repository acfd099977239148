"""The SMBIOS tables firmware hands the kernel (``sys/firmware/dmi/tables``): a 64-bit
(SMBIOS 3) entry point and the structure table, encoded from the node's profile.

Readers such as ``dmidecode`` and ``lshw`` decode these tables, not ``dmi/id``; the kernel
derives ``dmi/id`` from the same table, so both come from one set of values here
(``dmi_values``). Structures: BIOS (type 0), System (1), Baseboard (2), Chassis (3), one
Processor (4) per socket, one Physical Memory Array (16) with Memory Devices (17) per
NUMA node summing to its memory, the array's Mapped Address (19), System Boot (32) and
End-of-Table (127). Layouts follow DMTF DSP0134 3.3.0 (section numbers below); the kernel
side is drivers/firmware/dmi_scan.c (``smbios_entry_point`` and ``DMI`` binary
attributes, mode 0400, the table cut at its End-of-Table structure).
"""

from __future__ import annotations

import struct
import uuid

from sandbox.profile.spec import CpuSpec, NodeSpec, SystemSpec

VERSION = (3, 3, 0)  # major, minor, docrev
TABLE_ADDRESS = 0x6F8FE000  # where firmware would have put the table (dmidecode ignores it)
MiB, GiB = 2**20, 2**30
NOT_PROVIDED = 0xFFFF  # a handle field with no structure behind it
NO_ERROR_INFO = 0xFFFE  # 7.17.4 / 7.18: "no error information structure provided"


def dmi_values(s: SystemSpec) -> dict[str, str]:
    """The ``dmi/id`` attributes the kernel reads out of types 0-3 (serials apart)."""
    return {
        "bios_vendor": s.bios_vendor,
        "bios_version": s.bios_version,
        "bios_date": s.bios_date,
        "bios_release": "{}.{}".format(*bios_release(s.bios_version)),
        "sys_vendor": s.sys_vendor,
        "product_name": s.product_name,
        "product_version": s.product_version,
        "product_family": "Family",
        "product_sku": "To be filled by O.E.M.",
        "board_vendor": s.board_vendor,
        "board_name": s.board_name,
        "board_version": s.board_version,
        "board_asset_tag": "Base Board Asset Tag",
        "chassis_vendor": s.sys_vendor,
        "chassis_type": str(s.chassis_type),
        "chassis_version": s.product_version,
        "chassis_asset_tag": "To be filled by O.E.M.",
    }


def bios_release(version: str) -> tuple[int, int]:
    """SMBIOS 2.8's BIOS major.minor release, as firmware derives it from the version."""
    parts = [p for p in version.split(".") if p.isdigit()][:2]
    major = int(parts[0]) % 256 if parts else 1
    minor = int(parts[1]) % 256 if len(parts) > 1 else 0
    return major, minor


def memory_devices(node: NodeSpec) -> list[tuple[int, int]]:
    """(NUMA node, bytes) of every DIMM: per node up to 8 equal DIMMs of at least 4 GiB
    (whole MiB), and a last device for any part below a MiB (type 17 can say KiB)."""
    out: list[tuple[int, int]] = []
    for n in node.numa:
        mib, rest = divmod(n.memory, MiB)
        count = next((d for d in (8, 4, 2) if mib % d == 0 and mib // d * MiB >= 4 * GiB), 1)
        out += [(n.id, mib // count * MiB)] * count if mib else []
        if rest:
            out.append((n.id, rest))
    return out


def smbios_tables(node: NodeSpec) -> tuple[bytes, bytes]:
    """(entry point, structure table) of ``node``; its ``system`` must be set."""
    s = node.system
    assert s is not None, "the resolver sets every replica's system"
    v = dmi_values(s)
    out: list[bytes] = []

    def add(kind: int, body: bytes, strings: list[str]) -> int:
        handle = len(out)
        out.append(_structure(kind, handle, body, strings))
        return handle

    add(0, *_bios(s))
    add(1, *_system(s, v))
    board = len(out)
    chassis = board + 1
    add(2, *_baseboard(s, v, chassis))
    add(3, *_chassis(s, v))
    for socket in range(node.cpu.sockets):
        add(4, *_processor(node.cpu, socket))
    dimms = memory_devices(node)
    array = add(16, struct.pack("<BBBIHHQ", 0x03, 0x03, 0x06, 0x80000000, NO_ERROR_INFO,
                                len(dimms), node.memory), [])  # 7.17: board, system, ECC
    slots: dict[int, int] = {}
    for numa, size in dimms:
        slots[numa] = slots.get(numa, 0) + 1
        add(17, *_memory_device(array, numa, slots[numa], size))
    add(19, _mapped_address(array, node.memory), [])
    add(32, bytes(6) + b"\x00", [])  # 7.33: reserved, "no errors detected"
    add(127, b"", [])
    table = b"".join(out)
    head = struct.pack("<5sBBBBBBBIQ", b"_SM3_", 0, 0x18, *VERSION, 0x01, 0, len(table),
                       TABLE_ADDRESS)  # 5.2.2: anchor, checksum, length, ..., revision 1
    entry = head[:5] + bytes([-sum(head) % 256]) + head[6:]
    return entry, table


def _structure(kind: int, handle: int, body: bytes, strings: list[str]) -> bytes:
    """6.1.2-6.1.3: header (type, formatted length, handle), formatted area, then the
    string set: each string NUL-terminated, the set ended by one more NUL (two NULs when
    it is empty)."""
    text = b"".join(t.replace("\0", "").encode() + b"\0" for t in strings)
    return struct.pack("<BBH", kind, 4 + len(body), handle) + body + (text or b"\0") + b"\0"


class _Strings:
    """A structure's string set: ``ref(text)`` is the 1-based number a STRING field holds
    (0: no string, which readers print as "Not Specified")."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def ref(self, text: str) -> int:
        text = text.replace("\0", "")
        if not text:
            return 0
        if text not in self.items:
            self.items.append(text)
        return self.items.index(text) + 1


def _bios(s: SystemSpec) -> tuple[bytes, list[str]]:
    """7.1, length 0x1A: vendor, version, segment F000, date, ROM size 32 MiB (extended),
    characteristics (PCI, flashable, shadowing, CD boot, selectable boot), extension bytes
    (ACPI, USB legacy; targeted content, UEFI), release, no embedded controller."""
    st = _Strings()
    major, minor = bios_release(s.bios_version)
    body = struct.pack("<BBHBBQBBBBBBH", st.ref(s.bios_vendor), st.ref(s.bios_version),
                       0xF000, st.ref(s.bios_date), 0xFF, 0x19880, 0x03, 0x0C, major, minor,
                       0xFF, 0xFF, 32)
    return body, st.items


def _system(s: SystemSpec, v: dict[str, str]) -> tuple[bytes, list[str]]:
    """7.2, length 0x1B; the UUID's first three fields little-endian (since 2.6), wake-up
    type power switch."""
    st = _Strings()
    head = struct.pack("<BBBB", st.ref(s.sys_vendor), st.ref(s.product_name),
                       st.ref(s.product_version), st.ref(s.product_serial))
    tail = struct.pack("<BBB", 0x06, st.ref(v["product_sku"]), st.ref(v["product_family"]))
    return head + uuid.UUID(s.product_uuid).bytes_le + tail, st.items


def _baseboard(s: SystemSpec, v: dict[str, str], chassis: int) -> tuple[bytes, list[str]]:
    """7.3, length 0x0F: a replaceable hosting board (motherboard), no contained objects."""
    st = _Strings()
    body = struct.pack("<BBBBBBBHBB", st.ref(s.board_vendor), st.ref(s.board_name),
                       st.ref(s.board_version), st.ref(s.board_serial),
                       st.ref(v["board_asset_tag"]), 0x09, st.ref("Default string"), chassis,
                       0x0A, 0)
    return body, st.items


def _chassis(s: SystemSpec, v: dict[str, str]) -> tuple[bytes, list[str]]:
    """7.4, length 0x16 (no contained elements): states safe, security none, one cord."""
    st = _Strings()
    body = struct.pack("<BBBBBBBBBIBBBBB", st.ref(v["chassis_vendor"]), s.chassis_type & 0x7F,
                       st.ref(v["chassis_version"]), st.ref(s.product_serial),
                       st.ref(v["chassis_asset_tag"]), 0x03, 0x03, 0x03, 0x03, 0, 0, 1, 0, 3,
                       st.ref("To be filled by O.E.M."))
    return body, st.items


def _processor(cpu: CpuSpec, socket: int) -> tuple[bytes, list[str]]:
    """7.5, length 0x30: a populated, enabled central processor; its family (7.5.2) from the
    vendor, its ID the CPUID leaf 1 signature (EAX) and feature flags (EDX); speeds in MHz
    as cpufreq reports them (base; 1.9x Intel or 1.4x AMD turbo); no cache structures."""
    st = _Strings()
    amd = cpu.vendor == "AuthenticAMD"
    family = 0x6B if amd and cpu.family >= 0x17 else (
        0xB3 if cpu.vendor == "GenuineIntel" and "Xeon" in cpu.model else 0x01)
    maker = {"GenuineIntel": "Intel(R) Corporation",
             "AuthenticAMD": "Advanced Micro Devices, Inc."}.get(cpu.vendor, cpu.vendor)
    edx = 0x178BFBFF if amd else 0xBFEBFBFF
    cores, threads = cpu.cores_per_socket, cpu.cores_per_socket * cpu.threads_per_core
    # 64-bit capable, execute protection, virtualization, power control; multi-core; HT
    traits = 0x00E4 | (0x08 if cores > 1 else 0) | (0x10 if cpu.threads_per_core > 1 else 0)
    # WORD fields: a profile's speeds are unbounded, the table's are not.
    mhz, top = (min(f, 0xFFFF) for f in (cpu.mhz, cpu.mhz * (14 if amd else 19) // 10))
    body = struct.pack(
        "<BBBBIIBBHHHBBHHHBBBBBBHHHHH",
        st.ref(f"CPU{socket}"), 0x03, family, st.ref(maker), _signature(cpu), edx,
        st.ref(cpu.model), 0x90, 100, top, mhz, 0x41, 0x01,
        NOT_PROVIDED, NOT_PROVIDED, NOT_PROVIDED, 0, 0, 0,
        min(cores, 0xFF), min(cores, 0xFF), min(threads, 0xFF), traits, family,
        cores, cores, threads)
    return body, st.items


def _signature(cpu: CpuSpec) -> int:
    """CPUID.1:EAX: stepping 8 (as /proc/cpuinfo says), model and family split into their
    base and extended fields (Intel SDM vol. 2A, CPUID); values past what the fields hold
    (family 0x10E, model 0xFF) are cut to them."""
    family, model = min(cpu.family, 0xF + 0xFF), min(cpu.model_number, 0xFF)
    base_family = min(family, 0xF)
    ext_family = family - 0xF if family >= 0xF else 0
    return ext_family << 20 | (model >> 4) << 16 | base_family << 8 | (model & 0xF) << 4 | 8


def _memory_device(array: int, numa: int, slot: int, size: int) -> tuple[bytes, list[str]]:
    """7.18, length 0x5C: a registered DDR4-3200 ECC DIMM (72/64 bits, 2 ranks, 1.2 V);
    ``size`` a whole MiB (Size in MB, or 7FFFh and Extended Size) or below a MiB (KB)."""
    st = _Strings()
    mib = size // MiB
    if mib == 0:
        small, extended = 0x8000 | size // 1024, 0
    else:
        small, extended = (mib, 0) if mib < 0x7FFF else (0x7FFF, mib)
    locator = st.ref(f"P{numa}-DIMM{chr(ord('A') + slot - 1)}1" if slot <= 26
                     else f"P{numa}-DIMM{slot}")
    body = struct.pack(
        "<HHHHHBBBBBHHBBBBBIHHHHBHBHHHHQQQQII",
        array, NO_ERROR_INFO, 72, 64, small, 0x09, 0, locator, st.ref(f"NODE {numa}"), 0x1A,
        0x2080, 3200, 0, 0, 0, 0, 0x02, extended, 3200, 1200, 1200, 1200,
        0x03, 0x0008, 0, 0, 0, 0, 0, 0, size, 0, 0, 0, 0)
    return body, st.items


def _mapped_address(array: int, total: int) -> bytes:
    """7.20, length 0x1F: the array's memory from address 0, in KiB (extended in bytes
    past 4 TiB), one device per row of the partition."""
    end_kb = total // 1024 - 1
    if end_kb < 0xFFFFFFFF:
        return struct.pack("<IIHBQQ", 0, end_kb, array, 1, 0, 0)
    return struct.pack("<IIHBQQ", 0xFFFFFFFF, 0xFFFFFFFF, array, 1, 0, total - 1)

"""Node-wide kernel interfaces beside CPUs and NUMA nodes: bus links for CPUs, NUMA nodes
and memory blocks, memory blocks (``sys/devices/system/memory``), ``/proc/swaps``, DMI
(``sys/devices/virtual/dmi/id`` and the SMBIOS tables ``sys/firmware/dmi/tables``, encoded
by ``_smbios``), IOMMU units (``sys/class/iommu``) and ``/proc/devices`` (the char and
block majors the node's drivers registered, by the names fs/char_dev.c and block/genhd.c
print; NVIDIA's DRA driver reads nvidia-caps' major there).

All of it depends on the node alone, so it belongs to the base tree every build grafts.
Kernel documents: Documentation/ABI/testing/sysfs-devices-memory,
admin-guide/mm/memory-hotplug.rst, drivers/firmware/dmi-id.c (no ABI file covers dmi/id),
ABI/testing/sysfs-class-iommu-{intel,amd}-iommu, filesystems/proc.rst (swaps;
mm/swapfile.c swap_show).
"""

from __future__ import annotations

from sandbox.fakehw.builder._common import RO, RW, WO, Ctx
from sandbox.fakehw.builder._cpu import CPU, NODE, swap_kb
from sandbox.fakehw.builder._smbios import dmi_values, smbios_tables
from sandbox.profile.devnames import BLOCK_EXT_MAJOR, node_class, owners

MEMORY = "sys/devices/system/memory"
MiB, GiB = 2**20, 2**30
MIN_BLOCK = 128 * MiB  # x86-64 MIN_MEMORY_BLOCK_SIZE
MAX_BLOCK = 2 * GiB  # x86-64 MAX_BLOCK_SIZE
LARGE_MEMORY = 64 * GiB  # MEM_SIZE_FOR_LARGE_BLOCK: from here on, 2 GiB blocks
MAX_BLOCKS = 8192  # sandbox limit: past 16 TiB blocks grow beyond 2 GiB (no kernel does)
DMA32_END = 4 * GiB
DMI = "sys/devices/virtual/dmi/id"
TABLES = "sys/firmware/dmi/tables"
ROOT_ONLY = 0o400
SWAP_FILE = "/swap.img"


def block_size(total: int) -> int:
    """Memory block size as x86-64 probe_memory_block_size() picks it on bare metal: 128
    MiB below 64 GiB of RAM, else 2 GiB (the largest; memory's end is 2 GiB aligned)."""
    size = MIN_BLOCK if total < LARGE_MEMORY else MAX_BLOCK
    while -(-total // size) > MAX_BLOCKS:
        size *= 2
    return size


def memory_blocks(ctx: Ctx) -> list[tuple[int, int]]:
    """(block number, NUMA node) of every memory block: each node's memory in contiguous
    blocks from address 0, node by node (its meminfo MemTotal rounded up to blocks)."""
    size = block_size(ctx.node.memory)
    out: list[tuple[int, int]] = []
    for n in ctx.node.numa:
        out += [(len(out) + k, n.id) for k in range(-(-n.memory // size))]
    return out


def add_system(ctx: Ctx) -> None:
    _bus_links(ctx)
    _memory(ctx)
    _swaps(ctx)
    _dmi(ctx)
    _smbios(ctx)
    _iommu(ctx)
    _proc_devices(ctx)


def _bus_links(ctx: Ctx) -> None:
    """``bus/{cpu,node}/devices/*`` and each device's ``subsystem`` link back."""
    for c in ctx.node.cpus:
        ctx.link(f"sys/bus/cpu/devices/cpu{c.id}", f"{CPU}/cpu{c.id}")
        ctx.link(f"{CPU}/cpu{c.id}/subsystem", "sys/bus/cpu")
    for n in ctx.node.numa:
        ctx.link(f"sys/bus/node/devices/node{n.id}", f"{NODE}/node{n.id}")
        ctx.link(f"{NODE}/node{n.id}/subsystem", "sys/bus/node")


def _memory(ctx: Ctx) -> None:
    size = block_size(ctx.node.memory)
    ctx.files(MEMORY, {"block_size_bytes": f"{size:x}\n", "uevent": ""})
    ctx.file(f"{MEMORY}/auto_online_blocks", "online\n", RW)
    ctx.files(MEMORY, {"soft_offline_page": "", "hard_offline_page": ""}, WO)
    for block, node in memory_blocks(ctx):
        base = f"{MEMORY}/memory{block}"
        start = block * size
        # A block holding several zones (the first: DMA and DMA32) reads "none".
        zone = "none" if block == 0 else ("DMA32" if start < DMA32_END else "Normal")
        ctx.files(base, {
            "phys_index": f"{block:08x}\n",
            "phys_device": "0\n",
            "removable": "1\n",
            "valid_zones": f"{zone}\n",
            "uevent": "",
        }, RO)
        ctx.files(base, {"online": "1\n", "state": "online\n"}, RW)
        ctx.link(f"{base}/node{node}", f"{NODE}/node{node}")
        ctx.link(f"{base}/subsystem", "sys/bus/memory")
        ctx.link(f"sys/bus/memory/devices/memory{block}", base)
        ctx.link(f"{NODE}/node{node}/memory{block}", base)


def _swaps(ctx: Ctx) -> None:
    """``/proc/swaps`` as mm/swapfile.c swap_show() prints it: one swap file, unused."""
    out = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
    kb = swap_kb(ctx.node)
    if kb:
        pad = " " * (40 - len(SWAP_FILE))
        tab = "\t" if kb < 10_000_000 else ""
        out += f"{SWAP_FILE}{pad}file\t\t{kb}\t{tab}0\t\t-2\n"
    ctx.file("proc/swaps", out)


def dmi_modalias(values: dict[str, str]) -> str:
    """drivers/firmware/dmi-id.c get_modalias(): ``dmi`` then ``:<prefix><value>`` per
    field, spaces, colons and non-ASCII dropped, and a final ``:``."""
    fields = (("bvn", "bios_vendor"), ("bvr", "bios_version"), ("bd", "bios_date"),
              ("br", "bios_release"), ("svn", "sys_vendor"), ("pn", "product_name"),
              ("pvr", "product_version"), ("rvn", "board_vendor"), ("rn", "board_name"),
              ("rvr", "board_version"), ("cvn", "chassis_vendor"), ("ct", "chassis_type"),
              ("cvr", "chassis_version"), ("sku", "product_sku"))
    out = "dmi"
    for prefix, name in fields:
        if name in values:
            kept = "".join(ch for ch in values[name] if " " < ch < "\x7f" and ch != ":")
            out += f":{prefix}{kept}"
    return out + ":"


def _dmi(ctx: Ctx) -> None:
    s = ctx.node.system
    if s is None:
        return
    values = dmi_values(s)
    ctx.files(DMI, {k: f"{v}\n" for k, v in values.items()})
    ctx.files(DMI, {
        "product_serial": f"{s.product_serial}\n",
        "product_uuid": f"{s.product_uuid}\n",
        "board_serial": f"{s.board_serial}\n",
        "chassis_serial": f"{s.product_serial}\n",
    }, ROOT_ONLY)
    modalias = dmi_modalias(values)
    ctx.files(DMI, {"modalias": f"{modalias}\n", "uevent": f"MODALIAS={modalias}\n"})
    ctx.link(f"{DMI}/subsystem", "sys/class/dmi")
    ctx.link("sys/class/dmi/id", DMI)


def _smbios(ctx: Ctx) -> None:
    """The firmware's SMBIOS tables (``sys/firmware/dmi/tables``), which dmidecode and lshw
    decode; dmi/id above holds the same values."""
    if ctx.node.system is None:
        return
    entry, table = smbios_tables(ctx.node)
    ctx.files(TABLES, {"smbios_entry_point": entry, "DMI": table}, ROOT_ONLY)


def _iommu(ctx: Ctx) -> None:
    """One IOMMU unit per PCI host bridge: Intel VT-d DMAR units (``dmarN``,
    ``intel-iommu/``) or AMD-Vi IVHD units (``ivhdN``, ``amd-iommu/``). Real AMD units
    sit below their IOMMU PCI function (00.2), which the tree has not; here they are
    virtual devices. No ``devices/`` links (they would follow device states)."""
    amd = ctx.node.cpu.vendor == "AuthenticAMD"
    for k, _hb in enumerate(ctx.node.host_bridges):
        if amd:
            name = f"ivhd{k}"
            attrs = {"cap": "190063\n", "features": "246577efa2254afa\n"}  # %x, %llx
            sub = "amd-iommu"
        else:
            name = f"dmar{k}"
            attrs = {
                "address": f"{0xD37FC000 - k * 0x1000000:x}\n",
                "cap": "8d2078c106f0466\n",
                "ecap": "60000f050df\n",
                "version": "1:0\n",
                "domains_supported": "65536\n",
                "domains_used": "1\n",
            }
            sub = "intel-iommu"
        base = f"sys/devices/virtual/iommu/{name}"
        ctx.files(f"{base}/{sub}", attrs)
        ctx.file(f"{base}/uevent", "")
        ctx.dir(f"{base}/devices")
        ctx.link(f"{base}/subsystem", "sys/class/iommu")
        ctx.link(f"sys/class/iommu/{name}", base)


# What every x86-64 machine has registered besides the emulated drivers (a typical kernel's).
BASE_CHRDEVS = ((4, "/dev/vc/0"), (4, "tty"), (4, "ttyS"), (5, "/dev/tty"), (5, "/dev/console"),
                (5, "/dev/ptmx"), (7, "vcs"), (13, "input"), (128, "ptm"), (136, "pts"))
BASE_BLKDEVS = ((7, "loop"), (BLOCK_EXT_MAJOR, "blkext"))


def _proc_devices(ctx: Ctx) -> None:
    """``/proc/devices`` as chrdev_show/blkdev_show print it: ``%3d %s`` per registered
    region, by major (a major's regions in registration order). A generic device's own
    major is listed under its class name (``accel``, or ``generic`` for a bare name)."""
    chars = list(BASE_CHRDEVS)
    for driver in owners(ctx.node):
        chars += driver.chrdevs
    known = {major for major, _ in chars}
    for d in ctx.node.devices:
        for n in d.generic.dev_nodes if d.generic is not None else ():
            if n.major not in known:
                chars.append((n.major, node_class(n.name)[0]))
                known.add(n.major)
    ordered = sorted(dict.fromkeys(chars), key=lambda c: c[0])  # stable: regions stay in order
    text = "Character devices:\n" + "".join(f"{m:3d} {name}\n" for m, name in ordered)
    text += "\nBlock devices:\n" + "".join(f"{m:3d} {name}\n" for m, name in BASE_BLKDEVS)
    ctx.file("proc/devices", text)

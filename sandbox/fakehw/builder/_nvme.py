"""NVMe drives: the controller (``<pci>/nvme/nvmeN``, ``class/nvme``, ``/dev/nvmeN``), its
subsystem (``class/nvme-subsystem``) and its namespaces as block disks (``<ctrl>/nvmeNnM``,
``/sys/block``, ``class/block``, ``sys/dev/block``) (Documentation/ABI/testing/
sysfs-class-nvme, sysfs-block; drivers/nvme/host/sysfs.c, core.c; block/genhd.c).

The layout is the kernel's without native NVMe multipath (``nvme_core.multipath=N``, as
``sys/module/nvme_core/parameters/multipath`` says): each namespace's disk sits below its
controller, so readers that walk a disk's path up to its PCI function (hwloc, lsblk) find
it, and the subsystem directory links its controller.

Each namespace is a block node ``/dev/nvmeNnM`` (259:k, ``tree.BlockDevice``, mode 0660 as
udev makes disks) with its ``dev`` and ``sys/dev/block/259:k``; the controller is the
character node ``/dev/nvmeN``.
"""

from __future__ import annotations

from sandbox.fakehw.builder._common import RW, Ctx, fault
from sandbox.fakehw.tree import Reason
from sandbox.profile.devnames import BLOCK_EXT_MAJOR, NVME_CHAR_MAJOR
from sandbox.profile.spec import DeviceSpec, NvmeSpec

# The controllers' character devices: a dynamic major (alloc_chrdev_region "nvme"); this
# is a typical value, free among the tree's other dynamic majors.
SECTOR = 512
MULTIPATH = "sys/module/nvme_core/parameters/multipath"


def serial(d: DeviceSpec, nvme: NvmeSpec) -> str:
    """The drive's serial number: the vendor's prefix and digits of the device's serial."""
    return nvme.serial_prefix + d.serial[:max(6, 14 - len(nvme.serial_prefix))]


def subsysnqn(d: DeviceSpec, nvme: NvmeSpec) -> str:
    """The NQN the kernel builds for a controller without one of its own (nvme_init_subnqn:
    ``nqn.2014.08.org.nvmexpress:`` vendor id, subsystem vendor id, serial and model,
    space padded to 20 and 40 characters)."""
    f = d.functions[0]
    return (f"nqn.2014.08.org.nvmexpress:{f.vendor_id:04x}{f.subsystem_vendor_id:04x}"
            f"{serial(d, nvme):<20}{nvme.model_number:<40}")


def namespace_sectors(nvme: NvmeSpec) -> int:
    """Each namespace's size in 512-byte sectors (whole logical blocks of the capacity
    split evenly)."""
    blocks = nvme.capacity // nvme.namespaces // nvme.lba_size
    return blocks * nvme.lba_size // SECTOR


def disk_name(nvme: NvmeSpec, nsid: int) -> str:
    return f"nvme{nvme.controller}n{nsid}"


def add_nvmes(ctx: Ctx, nvmes: list[DeviceSpec], pci: dict[str, str]) -> None:
    # Every machine has these, disk or not (inventory agents open /sys/block). Made in
    # partial builds too, so a change that removes the last disk leaves them empty.
    for path in ("sys/block", "sys/class/block", "sys/dev/block"):
        ctx.dir(path)
    if not nvmes:
        return
    if ctx.emits(None):
        ctx.file(MULTIPATH, "N\n")
    for d in nvmes:
        if d.nvme is None or d.address not in pci or not ctx.emits(d.id):
            continue
        _controller(ctx, d, d.nvme, pci[d.address])


def _state(ctx: Ctx, d: DeviceSpec) -> str:
    """The controller's state: a surprise link down leaves it dead, a fatal AER error
    resetting (the error handler resets the controller); otherwise live."""
    state = ctx.states[d.id]
    if fault(state, Reason.LINK_DOWN):
        return "dead"
    if fault(state, Reason.AER_FATAL):
        return "resetting"
    return "live"


def _controller(ctx: Ctx, d: DeviceSpec, nvme: NvmeSpec, fn: str) -> None:
    name = f"nvme{nvme.controller}"
    cdir = f"{fn}/nvme/{name}"
    sn, nqn = serial(d, nvme), subsysnqn(d, nvme)
    ctx.chardev(name, NVME_CHAR_MAJOR, nvme.controller, cdir, mode=0o600)
    ctx.files(cdir, {
        "model": f"{nvme.model_number}\n",
        "serial": f"{sn}\n",
        "firmware_rev": f"{nvme.firmware}\n",
        "transport": "pcie\n",
        "address": f"{d.address}\n",
        "cntlid": "0\n",  # sysfs prints it in decimal
        "state": f"{_state(ctx, d)}\n",
        "subsysnqn": f"{nqn}\n",
        "numa_node": f"{d.numa_node}\n",
        "queue_count": f"{min(ctx.ncpus, 64) + 1}\n",  # admin + an I/O queue per CPU
        "sqsize": "1023\n",
        "kato": "0\n",
        "cntrltype": "io\n",
        "dctype": "none\n",
    })
    ctx.file(f"{cdir}/reset_controller", b"", 0o200)
    ctx.file(f"{cdir}/rescan_controller", b"", 0o200)
    ctx.link(f"{cdir}/device", fn)
    ctx.link(f"{cdir}/subsystem", "sys/class/nvme")
    ctx.link(f"sys/class/nvme/{name}", cdir)
    # The subsystem: one per controller here (no shared namespaces, no multipath).
    sub = f"nvme-subsys{nvme.controller}"
    sdir = f"sys/devices/virtual/nvme-subsystem/{sub}"
    ctx.files(sdir, {
        "subsysnqn": f"{nqn}\n",
        "model": f"{nvme.model_number}\n",
        "serial": f"{sn}\n",
        "firmware_rev": f"{nvme.firmware}\n",
        "subsystype": "nvm\n",
        "uevent": "",
    })
    ctx.link(f"{sdir}/{name}", cdir)
    ctx.link(f"{sdir}/subsystem", "sys/class/nvme-subsystem")
    ctx.link(f"sys/class/nvme-subsystem/{sub}", sdir)
    for nsid in range(1, nvme.namespaces + 1):
        _namespace(ctx, d, nvme, cdir, nsid)


def _namespace(ctx: Ctx, d: DeviceSpec, nvme: NvmeSpec, cdir: str, nsid: int) -> None:
    name = disk_name(nvme, nsid)
    ddir = f"{cdir}/{name}"
    minor = nvme.first_minor + nsid - 1
    lba = nvme.lba_size
    eui = f"{int(d.serial) & 0xFFFFFFFFFF:010x}{nsid:06x}"
    ctx.blockdev(name, BLOCK_EXT_MAJOR, minor, ddir, f"DEVTYPE=disk\nDISKSEQ={minor + 1}\n")
    ctx.files(ddir, {
        "size": f"{namespace_sectors(nvme)}\n",
        "ro": "0\n",
        "removable": "0\n",
        "hidden": "0\n",
        "range": "0\n",
        "ext_range": "256\n",
        "capability": "0\n",
        "alignment_offset": "0\n",
        "discard_alignment": "0\n",
        "diskseq": f"{minor + 1}\n",
        "events": "\n",
        "events_async": "\n",
        "events_poll_msecs": "-1\n",
        "stat": " ".join(["       0"] * 17) + "\n",
        "inflight": "       0        0\n",
        "nsid": f"{nsid}\n",
        "eui": ":".join(eui[i:i + 2] for i in range(0, 16, 2)) + "\n",
        "wwid": f"eui.{eui}\n",
    })
    ctx.dir(f"{ddir}/holders")
    ctx.dir(f"{ddir}/slaves")
    ctx.link(f"{ddir}/device", cdir)
    ctx.link(f"{ddir}/subsystem", "sys/class/block")
    ctx.files(f"{ddir}/queue", {
        "logical_block_size": f"{lba}\n",
        "physical_block_size": f"{max(lba, 4096)}\n",
        "hw_sector_size": f"{lba}\n",
        "minimum_io_size": f"{max(lba, 4096)}\n",
        "optimal_io_size": "0\n",
        "rotational": "0\n",
        "zoned": "none\n",
        "nr_zones": "0\n",
        "chunk_sectors": "0\n",
        "dax": "0\n",
        "discard_granularity": f"{lba}\n",
        "discard_max_hw_bytes": "2199023255040\n",
        "discard_zeroes_data": "0\n",
        "max_discard_segments": "256\n",
        "max_hw_sectors_kb": "128\n",
        "max_segments": "127\n",
        "max_segment_size": "4294967295\n",
        "max_integrity_segments": "0\n",
        "virt_boundary_mask": "4095\n",
        "dma_alignment": "3\n",
        "fua": "0\n",
        "stable_writes": "0\n",
        "write_cache": "write through\n",  # enterprise drives: power-loss protected
        "write_same_max_bytes": "0\n",
        "write_zeroes_max_bytes": "0\n",
        "zone_append_max_bytes": "0\n",
    })
    ctx.files(f"{ddir}/queue", {
        "nr_requests": "1023\n",
        "scheduler": "[none] mq-deadline \n",
        "max_sectors_kb": "128\n",
        "read_ahead_kb": "128\n",
        "discard_max_bytes": "2199023255040\n",
        "nomerges": "0\n",
        "rq_affinity": "1\n",
        "add_random": "0\n",
        "iostats": "1\n",
        "io_poll": "0\n",
        "io_poll_delay": "-1\n",
        "wbt_lat_usec": "0\n",
    }, RW)
    ctx.link(f"sys/block/{name}", ddir)
    ctx.link(f"sys/class/block/{name}", ddir)


def dev_nodes(d: DeviceSpec) -> tuple[str, ...]:
    """The dev/ paths of a drive: its controller's character node, then its namespaces'
    block nodes."""
    if d.nvme is None:
        return ()
    nvme = d.nvme
    return (f"dev/nvme{nvme.controller}",
            *(f"dev/{disk_name(nvme, nsid)}" for nsid in range(1, nvme.namespaces + 1)))

"""NICs: network interfaces (``class/net``, ``<BDF>/net/<if>``) for physical and virtual
functions, and RDMA devices (``class/infiniband``, ``infiniband_verbs``,
``infiniband_mad``, ``/dev/infiniband``) (Documentation/ABI/testing/sysfs-class-net,
Documentation/ABI/stable/sysfs-class-infiniband, drivers/infiniband/core/{uverbs_main,
user_mad}.c for the char-device numbering)."""

from __future__ import annotations

from dataclasses import dataclass

from sandbox.fakehw.builder._common import RW, Ctx, fault
from sandbox.fakehw.builder._pci import PciPlan
from sandbox.fakehw.tree import DeviceState, Reason
from sandbox.profile.devnames import (
    IB_MAJOR,
    MISC_MAJOR,
    RDMA_CM_MINOR,
    UMAD_DYNAMIC_MAJOR,
    UVERBS_DYNAMIC_MAJOR,
)
from sandbox.profile.spec import DeviceSpec

UMAD_FIXED, ISSM_BASE = 64, 64  # umadN = 231:N, issmN = 231:64+N for N < 64
UVERBS_BASE, UVERBS_FIXED = 192, 32  # uverbsN = 231:192+N for N < 32
# Beyond the fixed ranges the kernel allocates a dynamic major (devnames: the values are
# typical); issm minors there start after the umad ones.
UMAD_DYNAMIC_ISSM = 960
RDMA_MAX_PORTS = 1024
ARPHRD_ETHER, ARPHRD_INFINIBAND = 1, 32
# P_Key table: mlx5 reports 128 entries on an InfiniBand port and a single one on a RoCE
# port (irdma too); entry 0 holds the default full-membership key 0xffff, the rest are 0.
PKEY_TABLE_IB, PKEY_TABLE_ROCE, DEFAULT_PKEY = 128, 1, 0xFFFF


def _pkey_table(size: int) -> dict[str, str]:
    return {str(i): f"0x{DEFAULT_PKEY if i == 0 else 0:04x}\n" for i in range(size)}


_PKEYS = {True: _pkey_table(PKEY_TABLE_IB), False: _pkey_table(PKEY_TABLE_ROCE)}

_RATES = {
    400_000: "4X NDR",
    200_000: "4X HDR",
    100_000: "4X EDR",
    56_000: "4X FDR",
    50_000: "2X HDR",
    40_000: "4X QDR",
    25_000: "1X EDR",
    10_000: "1X QDR",
}
_FW = {"mellanox": "28.39.1002", "intel": "1.71"}


def ib_rate(speed_mbps: int) -> str:
    gbps = speed_mbps // 1000
    width = _RATES.get(speed_mbps)
    return f"{gbps} Gb/sec ({width})" if width else f"{gbps} Gb/sec"


def umad_dev(index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(major, minor) of umadN and issmN."""
    if index < UMAD_FIXED:
        return (IB_MAJOR, index), (IB_MAJOR, ISSM_BASE + index)
    k = index - UMAD_FIXED
    return (UMAD_DYNAMIC_MAJOR, k), (UMAD_DYNAMIC_MAJOR, UMAD_DYNAMIC_ISSM + k)


def uverbs_dev(index: int) -> tuple[int, int]:
    if index < UVERBS_FIXED:
        return IB_MAJOR, UVERBS_BASE + index
    return UVERBS_DYNAMIC_MAJOR, index - UVERBS_FIXED


def _mac(value: int) -> str:
    return ":".join(f"{(value >> s) & 0xFF:02x}" for s in range(40, -8, -8))


def _guid_bytes(guid: str) -> list[str]:
    return guid.split(":")


def _guid_sysfs(guid: str) -> str:
    b = "".join(_guid_bytes(guid))
    return ":".join(b[i : i + 4] for i in range(0, 16, 4))


@dataclass(frozen=True)
class _Port:
    """What one function's netdev and RDMA device show."""

    netdev: str
    mac: str
    guid: str
    ibdev: str | None
    rdma_index: int
    ifindex: int


def _rdma_index(name: str) -> int:
    stem = name.rstrip("0123456789")
    return int(name[len(stem) :] or 0)


def add_nics(
    ctx: Ctx, nics: list[DeviceSpec], pci: dict[str, str], plan: PciPlan, vf_counts: dict[str, int]
) -> None:
    _loopback(ctx)
    ifindex = 2
    pf_rdma = 0
    for d in nics:
        assert d.nic is not None
        pf_rdma += len(d.nic.rdma_devs)
        ifindex += len(d.functions)
    # VF interfaces and RDMA devices are numbered over every POSSIBLE VF, so that enabling
    # VFs on one NIC never renames another's.
    vf_ifindex, vf_rdma = ifindex, pf_rdma
    pf_ifindex = 2
    any_rdma = any(d.nic is not None and d.nic.rdma for d in nics)
    if any_rdma:
        ctx.file("sys/class/infiniband_verbs/abi_version", "6\n")
        ctx.file("sys/class/infiniband_mad/abi_version", "5\n")
        misc = "sys/devices/virtual/misc/rdma_cm"
        ctx.chardev("infiniband/rdma_cm", MISC_MAJOR, RDMA_CM_MINOR, misc)
        ctx.link("sys/class/misc/rdma_cm", misc)
    for d in nics:
        nic = d.nic
        assert nic is not None
        state = ctx.states[d.id]
        mlx_vf_rdma = nic.rdma and d.vendor == "mellanox"
        for p, f in enumerate(d.functions):
            pf = _Port(
                nic.netdevs[p],
                nic.macs[p],
                nic.node_guids[p],
                nic.rdma_devs[p] if p < len(nic.rdma_devs) else None,
                _rdma_index(nic.rdma_devs[p]) if p < len(nic.rdma_devs) else 0,
                pf_ifindex + p,
            )
            vfs = plan.pf_vfs.get(f.address, [])
            if f.address in pci and ctx.emits(d.id):
                _function(ctx, d, pci[f.address], pf, state, f.device_id)
                pf_mac = int(pf.mac.replace(":", ""), 16)
                guid = int(pf.guid.replace(":", ""), 16)
                # a VF on vfio-pci has no netdev and no RDMA device (/dev/vfio/<group>)
                live_vfs = 0 if nic.vf_driver == "vfio-pci" else vf_counts.get(f.address, 0)
                for v in range(min(len(vfs), live_vfs)):
                    ibdev = f"mlx5_{vf_rdma + v}" if mlx_vf_rdma else None
                    vguid = (guid & ~0xFFFF) | ((v + 1) << 4) | (p & 0xF)
                    vf = _Port(
                        f"{pf.netdev}v{v}",
                        _mac(0x02 << 40 | (pf_mac & 0xFFFFFF) << 16 | (v + 1)),
                        ":".join(f"{(vguid >> s) & 0xFF:02x}" for s in range(56, -8, -8)),
                        ibdev,
                        vf_rdma + v,
                        vf_ifindex + v,
                    )
                    _function(ctx, d, pci[vfs[v]], vf, state, nic.vf_device_id)
            vf_ifindex += len(vfs)
            if mlx_vf_rdma:
                vf_rdma += len(vfs)
        pf_ifindex += len(d.functions)


def _loopback(ctx: Ctx) -> None:
    lo = "sys/devices/virtual/net/lo"
    ctx.files(
        lo,
        {
            "address": "00:00:00:00:00:00\n",
            "addr_len": "6\n",
            "broadcast": "00:00:00:00:00:00\n",
            "carrier": "1\n",
            "operstate": "unknown\n",
            "type": "772\n",
            "ifindex": "1\n",
            "iflink": "1\n",
            "flags": "0x9\n",
            "uevent": "INTERFACE=lo\nIFINDEX=1\n",
        },
    )
    ctx.file(f"{lo}/mtu", "65536\n", RW)
    ctx.link(f"{lo}/subsystem", "sys/class/net")
    ctx.link("sys/class/net/lo", lo)


def _function(
    ctx: Ctx, d: DeviceSpec, fn_path: str, port: _Port, state: DeviceState, device_id: int
) -> None:
    nic = d.nic
    assert nic is not None
    ib = nic.link_layer == "infiniband"
    link_down = fault(state, Reason.LINK_DOWN)
    port_down = fault(state, Reason.PORT_DOWN)
    # Without an RDMA port to take down, port-down takes the interface down instead.
    net_down = link_down or (port_down and port.ibdev is None)
    ndir = f"{fn_path}/net/{port.netdev}"
    if ib:
        address = "00:00:10:87:fe:80:00:00:00:00:00:00:" + port.guid
        broadcast = "00:ff:ff:ff:ff:12:40:1b:ff:ff:00:00:00:00:00:00:ff:ff:ff:ff"
    else:
        address, broadcast = port.mac, "ff:ff:ff:ff:ff:ff"
    ctx.files(
        ndir,
        {
            "address": f"{address}\n",
            "addr_assign_type": "0\n",
            "addr_len": "20\n" if ib else "6\n",
            "broadcast": f"{broadcast}\n",
            "carrier": "0\n" if net_down else "1\n",
            "carrier_changes": "3\n" if net_down else "2\n",
            "operstate": "down\n" if net_down else "up\n",
            "speed": "-1\n" if net_down else f"{nic.speed}\n",
            "duplex": "unknown\n" if net_down else "full\n",
            "type": f"{ARPHRD_INFINIBAND if ib else ARPHRD_ETHER}\n",
            "ifindex": f"{port.ifindex}\n",
            "iflink": f"{port.ifindex}\n",
            "dev_id": "0x0\n",
            "dev_port": "0\n",
            "dormant": "0\n",
            "flags": "0x1003\n",
            "link_mode": "0\n",
            "name_assign_type": "4\n",
            "netdev_group": "0\n",
            "proto_down": "0\n",
            "uevent": f"INTERFACE={port.netdev}\nIFINDEX={port.ifindex}\n",
        },
    )
    ctx.file(f"{ndir}/mtu", "4092\n" if ib else "1500\n", RW)
    ctx.file(f"{ndir}/tx_queue_len", "256\n" if ib else "1000\n", RW)
    ctx.files(
        f"{ndir}/statistics",
        dict.fromkeys(
            (
                "rx_bytes",
                "tx_bytes",
                "rx_packets",
                "tx_packets",
                "rx_errors",
                "tx_errors",
                "rx_dropped",
                "tx_dropped",
                "multicast",
                "collisions",
            ),
            "0\n",
        ),
    )
    ctx.link(f"{ndir}/device", fn_path)
    ctx.link(f"{ndir}/subsystem", "sys/class/net")
    ctx.link(f"sys/class/net/{port.netdev}", ndir)
    if port.ibdev is not None:
        _rdma(ctx, d, fn_path, port, link_down, port_down, device_id)


def _rdma(
    ctx: Ctx,
    d: DeviceSpec,
    fn_path: str,
    port: _Port,
    link_down: bool,
    port_down: bool,
    device_id: int,
) -> None:
    nic = d.nic
    assert nic is not None
    assert port.ibdev is not None
    ib = nic.link_layer == "infiniband"
    ibdev, index = port.ibdev, port.rdma_index
    base = f"{fn_path}/infiniband/{ibdev}"
    guid = _guid_sysfs(port.guid)
    ctx.files(
        base,
        {
            "node_type": "1: CA\n",
            "node_guid": f"{guid}\n",
            "sys_image_guid": f"{guid}\n",
            "fw_ver": f"{_FW.get(d.vendor, '1.0')}\n",
            "hca_type": f"MT{device_id}\n" if d.vendor == "mellanox" else "\n",
            "board_id": "MT_0000000838\n" if d.vendor == "mellanox" else "INTEL_E810\n",
            "node_desc": f"{ctx.node.name} {ibdev}\n",
            "hw_rev": "0\n",  # mlx5 and irdma print the revision id with %x
            "uevent": f"NAME={ibdev}\n",
        },
    )
    ctx.link(f"{base}/device", fn_path)
    ctx.link(f"{base}/subsystem", "sys/class/infiniband")
    ctx.link(f"sys/class/infiniband/{ibdev}", base)
    if port_down:
        state, phys = "1: DOWN", "3: Disabled"
    elif link_down:
        state, phys = "1: DOWN", "2: Polling"
    else:
        state, phys = "4: ACTIVE", "5: LinkUp"
    pdir = f"{base}/ports/1"
    lid = f"0x{index + 1:x}" if ib else "0x0"
    gid_tail = ":".join("".join(_guid_bytes(port.guid))[i : i + 4] for i in range(0, 16, 4))
    ctx.files(
        pdir,
        {
            "state": f"{state}\n",
            "phys_state": f"{phys}\n",
            "rate": f"{ib_rate(nic.speed)}\n",
            "link_layer": "InfiniBand\n" if ib else "Ethernet\n",
            "lid": f"{lid}\n",
            "sm_lid": "0x1\n" if ib else "0x0\n",
            "lid_mask_count": "0\n",
            "sm_sl": "0\n",
            "cap_mask": "0x2651e848\n" if ib else "0x00010000\n",
        },
    )
    ctx.file(f"{pdir}/gids/0", f"fe80:0000:0000:0000:{gid_tail}\n")
    ctx.files(f"{pdir}/pkeys", _PKEYS[ib])
    ctx.file(f"{pdir}/gid_attrs/types/0", "IB/RoCE v1\n")
    ctx.file(f"{pdir}/gid_attrs/ndevs/0", "\n" if ib else f"{port.netdev}\n")
    # User-space verbs and MAD char devices; the kernel has minors for RDMA_MAX_PORTS only.
    if index >= RDMA_MAX_PORTS:
        return
    vdir = f"{fn_path}/infiniband_verbs/uverbs{index}"
    major, minor = uverbs_dev(index)
    ctx.chardev(f"infiniband/uverbs{index}", major, minor, vdir)
    ctx.files(vdir, {"ibdev": f"{ibdev}\n", "abi_version": "1\n"})
    ctx.link(f"{vdir}/device", fn_path)
    ctx.link(f"{vdir}/subsystem", "sys/class/infiniband_verbs")
    ctx.link(f"sys/class/infiniband_verbs/uverbs{index}", vdir)
    umad, issm = umad_dev(index)
    for name, (ma, mi) in ((f"umad{index}", umad), (f"issm{index}", issm)):
        mdir = f"{fn_path}/infiniband_mad/{name}"
        ctx.chardev(f"infiniband/{name}", ma, mi, mdir)
        ctx.files(mdir, {"ibdev": f"{ibdev}\n", "port": "1\n"})
        ctx.link(f"{mdir}/device", fn_path)
        ctx.link(f"{mdir}/subsystem", "sys/class/infiniband_mad")
        ctx.link(f"sys/class/infiniband_mad/{name}", mdir)

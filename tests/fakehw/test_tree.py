"""``build_tree``: kernel formats, cross-links that agree, determinism (no readers here; see
test_readers.py; health and hot-unplug states: test_tree_states.py)."""

from __future__ import annotations

import re

import pytest

from sandbox.fakehw.builder import _net, build_tree
from sandbox.fakehw.builder._gpu import drm_minors
from sandbox.fakehw.serve.treediff import diff_index, kind_of
from sandbox.fakehw.tree import (
    BlockDevice,
    CharDevice,
    Dir,
    Entry,
    File,
    Symlink,
    Tree,
)
from sandbox.profile import load_profile
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.spec import DeviceSpec, NodeSpec
from tests.support.paths import REPO

PROFILES = sorted(REPO.glob("profiles/*.yaml")) + sorted(REPO.glob("tests/data/tree-*.yaml"))
NODES = [
    pytest.param(node, id=f"{path.stem}/{node.name}")
    for path in PROFILES
    for node in load_profile(path).cluster.nodes
]
MODALIAS = re.compile(r"^pci:v[0-9A-F]{8}d[0-9A-F]{8}sv[0-9A-F]{8}sd[0-9A-F]{8}"
                      r"bc[0-9A-F]{2}sc[0-9A-F]{2}i[0-9A-F]{2}\n$")
# Registered with register_chrdev and mknod-ed by nvidia-modprobe: no sysfs class device.
NO_SYSFS_NODE = re.compile(r"^dev/(nvidia\d+|nvidiactl|nvidia-uvm(-tools)?|nvidia-caps/.*)$")


def node_of(profile: str, name: str | None = None) -> NodeSpec:
    cluster = load_profile(REPO / profile).cluster
    node = cluster.nodes[0] if name is None else cluster.node(name)
    assert node is not None
    return node


def resolve(tree: Tree, path: str, hops: int = 0) -> str | None:
    """Follow symlinks like the kernel would; the final path, or None if it dangles."""
    assert hops < 40, f"symlink loop at {path}"
    parts: list[str] = []
    todo = path.split("/")
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            assert parts, f"{path} climbs out of the root"
            parts.pop()
            continue
        entry = tree.get("/".join([*parts, part]))
        if entry is None:
            return None
        if isinstance(entry, Symlink):
            target = "/".join([*parts, entry.target])
            resolved = resolve(tree, target, hops + 1)
            if resolved is None:
                return None
            parts = resolved.split("/") if resolved else []
        else:
            parts.append(part)
    return "/".join(parts)


def text(tree: Tree, path: str) -> str:
    real = resolve(tree, path)
    entry = tree.get(real) if real is not None else None
    assert isinstance(entry, File), f"{path} is not a file"
    return entry.data.decode()


def entries(tree: Tree) -> dict[str, Entry]:
    return dict(tree.walk())


def first(node: NodeSpec, pred: object) -> DeviceSpec:
    assert callable(pred)
    return next(d for d in node.devices if pred(d))


# -- every profile ----------------------------------------------------------------------
@pytest.mark.parametrize("node", NODES)
def test_links_are_relative_and_resolve_inside(node: NodeSpec) -> None:
    tree = build_tree(node)
    for path, entry in tree.walk():
        if isinstance(entry, Symlink):
            assert not entry.target.startswith("/"), path
            assert resolve(tree, path) is not None, f"{path} -> {entry.target} dangles"


@pytest.mark.parametrize("node", NODES)
def test_every_device_node_agrees_with_sysfs(node: NodeSpec) -> None:
    tree = build_tree(node)
    all_entries = entries(tree)
    devs = {p: e for p, e in all_entries.items() if isinstance(e, (CharDevice, BlockDevice))}
    assert devs, "no device nodes"
    for path, dev in devs.items():
        assert path.startswith("dev/")
        kind = "block" if isinstance(dev, BlockDevice) else "char"
        link = f"sys/dev/{kind}/{dev.major}:{dev.minor}"
        if NO_SYSFS_NODE.match(path):
            assert tree.get(link) is None
            continue
        real = resolve(tree, link)
        assert real is not None, f"{path}: {link} dangles"
        assert real.startswith("sys/devices/"), f"{path}: {link}"
        assert text(tree, f"{real}/dev") == f"{dev.major}:{dev.minor}\n"
        assert f"DEVNAME={path.removeprefix('dev/')}\n" in text(tree, f"{real}/uevent")
        if kind == "block":  # a disk's node has its sysfs name (nvme0n1 <- sys/block)
            assert resolve(tree, f"sys/block/{path.removeprefix('dev/')}") == real
    majmin = {(type(d), d.major, d.minor) for d in devs.values()}
    assert len(majmin) == len(devs), "two device nodes share a type and major:minor"
    for path in all_entries:
        for kind, cls in (("char", CharDevice), ("block", BlockDevice)):
            if path.startswith(f"sys/dev/{kind}/"):
                major, minor = (int(x) for x in path.rsplit("/", 1)[1].split(":"))
                assert (cls, major, minor) in majmin, f"{path} has no /dev node"


def test_block_and_character_nodes_are_different_entries() -> None:
    """Same path and numbers, another type: another digest, and a diff names it as a
    node of one kind removed and one of the other added (a new inode for the mount)."""
    chars, blocks = Tree(), Tree()
    chars.add_chardev("dev/x", 259, 0, 0o660)
    blocks.add_blockdev("dev/x", 259, 0)
    assert blocks.get("dev/x") == BlockDevice(259, 0, 0o660)
    assert chars.get("dev/x") != blocks.get("dev/x")
    assert chars.digest() != blocks.digest()
    old, new = dict(chars.walk()), dict(blocks.walk())
    assert (kind_of(old["dev/x"]), kind_of(new["dev/x"])) == ("chr", "blk")
    diff = diff_index(old, new)
    assert (diff.removed, diff.added, diff.changed) == (
        (("dev/x", "chr"),), (("dev/x", "blk"),), ())


@pytest.mark.parametrize("node", NODES)
def test_pci_attributes_use_kernel_formats(node: NodeSpec) -> None:
    tree = build_tree(node)
    devices = tree.get("sys/bus/pci/devices")
    assert isinstance(devices, Dir)
    cpus_of = {n.id: n.cpus for n in node.numa}
    for addr in devices.children:
        base = f"sys/bus/pci/devices/{addr}"
        vendor = int(text(tree, f"{base}/vendor"), 16)
        device = int(text(tree, f"{base}/device"), 16)
        klass, rev = int(text(tree, f"{base}/class"), 16), int(text(tree, f"{base}/revision"), 16)
        assert re.fullmatch(r"0x[0-9a-f]{4}\n", text(tree, f"{base}/vendor"))
        assert re.fullmatch(r"0x[0-9a-f]{6}\n", text(tree, f"{base}/class"))
        assert MODALIAS.match(text(tree, f"{base}/modalias"))
        numa = int(text(tree, f"{base}/numa_node"))
        assert text(tree, f"{base}/local_cpulist") == format_cpulist(cpus_of[numa]) + "\n"
        mask = int(text(tree, f"{base}/local_cpus").replace(",", ""), 16)
        assert mask == sum(1 << c for c in cpus_of[numa])
        config = tree.get(resolve(tree, f"{base}/config") or "")
        assert isinstance(config, File)
        assert len(config.data) == 256
        c = config.data
        assert int.from_bytes(c[0:2], "little") == vendor
        assert int.from_bytes(c[2:4], "little") == device
        assert c[8] == rev
        assert int.from_bytes(c[9:12], "little") == klass
        assert (c[0x0E] & 0x7F) == (1 if klass == 0x060400 else 0)
        uevent = text(tree, f"{base}/uevent")
        assert f"PCI_SLOT_NAME={addr}\n" in uevent
        assert f"PCI_ID={vendor:04X}:{device:04X}\n" in uevent
        for name, total in (("aer_dev_fatal", "TOTAL_ERR_FATAL"),
                            ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
                            ("aer_dev_correctable", "TOTAL_ERR_COR")):
            lines = text(tree, f"{base}/{name}").splitlines()
            assert all(re.fullmatch(r"[A-Za-z]+ \d+", ln) for ln in lines[:-1])
            assert lines[-1].startswith(f"{total} ")
        group = resolve(tree, f"{base}/iommu_group")
        assert group is not None
        assert group.startswith("sys/kernel/iommu_groups/")
        assert resolve(tree, f"{group}/devices/{addr}") == resolve(tree, base)
        drv = tree.get(f"{resolve(tree, base)}/driver")
        if drv is not None:
            driver = resolve(tree, f"{base}/driver")
            assert driver is not None
            assert resolve(tree, f"{driver}/{addr}") == resolve(tree, base)


@pytest.mark.parametrize("node", NODES)
def test_build_is_deterministic_and_records_every_device(node: NodeSpec) -> None:
    a, b = build_tree(node), build_tree(node)
    assert a.digest() == b.digest()
    assert sorted(a.devices) == sorted(d.id for d in node.devices)
    for d in node.devices:
        rec = a.devices[d.id]
        assert (rec.kind, rec.pci_address, rec.numa_node) == (d.kind, d.address, d.numa_node)


# -- CPU and NUMA -----------------------------------------------------------------------
def test_cpu_topology_masks_and_cpuinfo() -> None:
    node = node_of("profiles/8gpu-2numa.yaml")
    tree = build_tree(node)
    topo = "sys/devices/system/cpu/cpu0/topology"
    assert text(tree, f"{topo}/thread_siblings_list") == "0,32\n"
    assert text(tree, f"{topo}/thread_siblings") == "00000001,00000001\n"
    assert text(tree, f"{topo}/core_siblings_list") == "0-15,32-47\n"
    assert text(tree, f"{topo}/core_siblings") == "0000ffff,0000ffff\n"
    assert text(tree, "sys/devices/system/node/node1/cpumap") == "ffff0000,ffff0000\n"
    assert text(tree, "sys/devices/system/node/node0/distance") == "10 21\n"
    assert resolve(tree, "sys/devices/system/cpu/cpu17/node1") == "sys/devices/system/node/node1"
    cpuinfo = text(tree, "proc/cpuinfo")
    assert cpuinfo.count("processor\t: ") == 64
    assert "physical id\t: 1\nsiblings\t: 32\ncore id\t\t: 0\ncpu cores\t: 16\n" in cpuinfo
    meminfo = text(tree, "sys/devices/system/node/node0/meminfo")
    assert f"Node 0 MemTotal:       {256 * 2**20:8d} kB\n" in meminfo
    assert text(tree, "sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages") \
        == "1024\n"
    assert "HugePages_Total:    2048\n" in text(tree, "proc/meminfo")


# -- vendors ------------------------------------------------------------------------------
def test_nvidia_nodes_and_proc_information() -> None:
    node = node_of("profiles/8gpu-2numa.yaml")
    tree = build_tree(node)
    for path, (major, minor) in (("dev/nvidiactl", (195, 255)), ("dev/nvidia-uvm", (235, 0)),
                                 ("dev/nvidia-uvm-tools", (235, 1))):
        dev = tree.get(path)
        assert isinstance(dev, CharDevice)
        assert (dev.major, dev.minor) == (major, minor)
    for d in node.devices:
        if d.gpu is None:
            continue
        dev = tree.get(f"dev/nvidia{d.gpu.minor}")
        assert isinstance(dev, CharDevice)
        assert (dev.major, dev.minor) == (195, d.gpu.minor)
        info = text(tree, f"proc/driver/nvidia/gpus/{d.address}/information")
        assert f"Device Minor: \t {d.gpu.minor}\n" in info
        assert f"GPU UUID: \t {d.uuid}\n" in info
        assert text(tree, f"sys/bus/pci/devices/{d.address}/numa_node") == f"{d.numa_node}\n"


def test_amd_module_kfd_topology_and_partitions() -> None:
    node = node_of("profiles/amd-mi300x.yaml")
    tree = build_tree(node)
    gpus = [d for d in node.devices if d.gpu is not None]
    for d in gpus:
        assert resolve(tree, f"sys/module/amdgpu/drivers/pci:amdgpu/{d.address}") == \
            resolve(tree, f"sys/bus/pci/devices/{d.address}")
        base = f"sys/bus/pci/devices/{d.address}"
        assert text(tree, f"{base}/current_compute_partition") == "SPX\n"
        assert text(tree, f"{base}/current_memory_partition") == "NPS1\n"
    nodes = "sys/class/kfd/kfd/topology/nodes"
    ncpu = len(node.numa)
    for n in node.numa:
        props = text(tree, f"{nodes}/{n.id}/properties")
        assert f"cpu_cores_count {len(n.cpus)}\n" in props
        assert "simd_count 0\n" in props
    for i, d in enumerate(gpus):
        assert d.gpu is not None
        lines = text(tree, f"{nodes}/{ncpu + i}/properties").splitlines()
        gprops = {k: v for k, v in (ln.split() for ln in lines)}
        f = d.functions[0]
        card, render_minor = drm_minors(d.gpu.minor)
        assert gprops["drm_render_minor"] == str(render_minor)
        assert gprops["location_id"] == str(f.bus << 8 | int(f.address[8:10], 16) << 3)
        assert gprops["domain"] == str(f.domain)
        assert gprops["gfx_target_version"] == str(d.gpu.gfx_target_version)
        assert gprops["simd_count"] == str(d.gpu.simd_count)
        link = text(tree, f"{nodes}/{ncpu + i}/io_links/0/properties")
        assert f"node_to {d.numa_node}\n" in link
        assert resolve(tree, f"{base_drm(d)}/card{card}") is not None
    kfd = tree.get("dev/kfd")
    assert isinstance(kfd, CharDevice)
    assert (kfd.major, kfd.minor) == (234, 0)


def base_drm(d: DeviceSpec) -> str:
    return f"sys/bus/pci/devices/{d.address}/drm"


def test_intel_drm_cards_by_path_and_sriov() -> None:
    node = node_of("profiles/intel-flex-sriov.yaml")
    tree = build_tree(node)
    for d in node.devices:
        assert d.gpu is not None
        card, render_minor = drm_minors(d.gpu.minor)
        real = resolve(tree, f"sys/class/drm/card{card}")
        assert real == f"{resolve(tree, f'sys/bus/pci/devices/{d.address}')}/drm/card{card}"
        assert text(tree, f"sys/class/drm/card{card}/device/vendor") == "0x8086\n"
        assert resolve(tree, f"sys/class/drm/card{card}/device/driver") == \
            "sys/bus/pci/drivers/i915"
        assert resolve(tree, f"dev/dri/by-path/pci-{d.address}-card") == f"dev/dri/card{card}"
        assert resolve(tree, f"dev/dri/by-path/pci-{d.address}-render") == \
            f"dev/dri/renderD{render_minor}"
    pf = first(node, lambda d: d.gpu is not None and d.gpu.total_vfs)
    assert pf.gpu is not None
    base = f"sys/bus/pci/devices/{pf.address}"
    assert text(tree, f"{base}/sriov_numvfs") == f"{pf.gpu.num_vfs}\n"
    for v in range(pf.gpu.num_vfs):
        vf = resolve(tree, f"{base}/virtfn{v}")
        assert vf is not None
        assert vf.endswith(pf.gpu.vf_addresses[v])
        assert resolve(tree, f"{vf}/physfn") == resolve(tree, base)
        assert tree.get(f"{vf}/drm") is not None
    assert resolve(tree, f"{base}/virtfn{pf.gpu.num_vfs}") is None


def test_nic_netdevs_sriov_and_rdma() -> None:
    node = node_of("profiles/sriov-rdma.yaml")
    tree = build_tree(node)
    nic = first(node, lambda d: d.nic is not None and d.nic.total_vfs and d.nic.rdma)
    n = nic.nic
    assert n is not None
    pf = nic.functions[0].address
    base = f"sys/bus/pci/devices/{pf}"
    netdev = n.netdevs[0]
    assert resolve(tree, f"sys/class/net/{netdev}/device") == resolve(tree, base)
    assert text(tree, f"sys/class/net/{netdev}/address") == f"{n.macs[0]}\n"
    assert text(tree, f"sys/class/net/{netdev}/operstate") == "up\n"
    assert text(tree, f"sys/class/net/{netdev}/speed") == f"{n.speed}\n"
    assert text(tree, f"{base}/sriov_totalvfs") == f"{n.total_vfs}\n"
    assert text(tree, f"{base}/sriov_numvfs") == f"{n.num_vfs}\n"
    for v in range(n.num_vfs):
        vf = resolve(tree, f"{base}/virtfn{v}")
        assert vf is not None
        assert vf.endswith(n.vf_addresses[0][v])
        assert text(tree, f"{vf}/device") == f"0x{n.vf_device_id:04x}\n"
        assert tree.get(f"{vf}/net/{netdev}v{v}") is not None
    ib = n.rdma_devs[0]
    index = int(ib.rsplit("_", 1)[1])
    port = f"sys/class/infiniband/{ib}/ports/1"
    assert resolve(tree, f"sys/class/infiniband/{ib}/device") == resolve(tree, base)
    assert text(tree, f"{port}/state") == "4: ACTIVE\n"
    assert text(tree, f"{port}/phys_state") == "5: LinkUp\n"
    assert text(tree, f"sys/class/infiniband_verbs/uverbs{index}/ibdev") == f"{ib}\n"
    uverbs = tree.get(f"dev/infiniband/uverbs{index}")
    assert isinstance(uverbs, CharDevice)
    assert (uverbs.major, uverbs.minor) == _net.uverbs_dev(index) == (231, 192 + index)
    umad = tree.get(f"dev/infiniband/umad{index}")
    issm = tree.get(f"dev/infiniband/issm{index}")
    assert isinstance(umad, CharDevice)
    assert (umad.major, umad.minor) == (231, index)
    assert isinstance(issm, CharDevice)
    assert (issm.major, issm.minor) == (231, 64 + index)
    assert isinstance(tree.get("dev/infiniband/rdma_cm"), CharDevice)


def test_fpga_dfl_regions_ports_and_char_links() -> None:
    node = node_of("profiles/fpga-dfl.yaml")
    tree = build_tree(node)
    for d in node.devices:
        fpga = d.fpga
        if fpga is None or fpga.flavor != "dfl":
            continue
        assert text(tree, f"sys/bus/pci/devices/{d.address}/class") == "0x120000\n"
        region = f"sys/class/fpga_region/region{fpga.region}"
        assert text(tree, f"{region}/dfl-fme.{fpga.region}/bitstream_id") == \
            f"{fpga.bitstream_id}\n"
        assert text(tree, f"{region}/dfl-fme.{fpga.region}/ports_num") == f"{fpga.ports}\n"
        compat = [p for p, _ in tree.walk() if p.endswith("/compat_id")
                  and f"/dfl-fme.{fpga.region}/" in p]
        assert len(compat) == 1
        for k in range(fpga.ports):
            n = fpga.first_port + k
            assert text(tree, f"{region}/dfl-port.{n}/afu_id") == f"{fpga.afu_ids[k]}\n"
            dev = tree.get(f"dev/dfl-port.{n}")
            assert isinstance(dev, CharDevice)
            real = resolve(tree, f"sys/dev/char/{dev.major}:{dev.minor}")
            assert real is not None
            assert real.startswith("sys/devices/pci")
            assert real.endswith(f"/dfl-port.{n}")


def test_generic_vfio_device_nodes() -> None:
    node = node_of("tests/data/tree-kitchen-sink.yaml")
    tree = build_tree(node)
    qat = first(node, lambda d: d.generic is not None)
    accel = tree.get("dev/accel/accel0")
    assert isinstance(accel, CharDevice)
    assert (accel.major, accel.minor) == (261, 0)
    assert resolve(tree, "sys/dev/char/261:0") == \
        f"{resolve(tree, f'sys/bus/pci/devices/{qat.address}')}/accel/accel0"
    group = qat.functions[0].iommu_group
    vfio = tree.get(f"dev/vfio/{group}")
    assert isinstance(vfio, CharDevice)
    assert isinstance(tree.get("dev/vfio/vfio"), CharDevice)
    gone = first(node, lambda d: d.health_reason == "removed")
    assert tree.get(f"sys/bus/pci/devices/{gone.address}") is None

"""NVMe drives (``type: nvme``): the controller, subsystem and namespace entries in the
kernel's formats (Documentation/ABI/testing/sysfs-class-nvme, ABI/stable/sysfs-block),
their faults, and the real readers that read them back: lsblk, lspci, hwloc and nvme-cli."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from sandbox.fakehw.builder import _nvme, build_tree
from sandbox.fakehw.render import render
from sandbox.fakehw.tree import (
    BlockDevice,
    CharDevice,
    DeviceState,
    File,
    Health,
    Reason,
    Symlink,
    Tree,
)
from sandbox.profile import load_profile, load_profile_text
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.spec import DeviceSpec, NodeSpec
from tests.support.paths import REPO
from tests.support.readers import bracket_id, lspci_records, lstopo, parents, run

pytestmark = [pytest.mark.root]

PROFILE = """
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: drives}
nodes:
  - name: n
    cpu: {sockets: 2, coresPerSocket: 2}
    devices:
      - {type: gpu, vendor: nvidia, model: h100-sxm5-80gb}
      - {type: nvme, vendor: samsung, model: pm1733}
      - {type: nvme, vendor: intel, model: d7-p5510, numaNode: 1, namespaces: 2, lbaSize: 4096}
      - {type: nvme, vendor: kioxia, model: cm6, numaNode: 1, capacity: 7680Gi}
"""
SECTORS_3_84_TB = 7501476528


def node() -> NodeSpec:
    return load_profile_text(PROFILE).cluster.nodes[0]


def drives(n: NodeSpec) -> list[DeviceSpec]:
    return [d for d in n.devices if d.nvme is not None]


def text(tree: Tree, path: str) -> str:
    entry = tree.get(path)
    assert isinstance(entry, File), path
    return entry.data.decode()


def need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: apt-get install -y {package}")
    return path


def target(tree: Tree, link: str) -> str:
    """Where a root-relative symlink points, root-relative."""
    entry = tree.get(link)
    assert isinstance(entry, Symlink), link
    return os.path.normpath(os.path.join(os.path.dirname(link), entry.target))


def test_resolved_drives_are_numbered_in_probe_order() -> None:
    ds = drives(node())
    assert [(d.id, d.functions[0].class_code, d.functions[0].driver) for d in ds] == [
        ("nvme0", 0x010802, "nvme"), ("nvme1", 0x010802, "nvme"), ("nvme2", 0x010802, "nvme")]
    assert [(d.functions[0].vendor_id, d.functions[0].device_id) for d in ds] == [
        (0x144D, 0xA824), (0x8086, 0x0B60), (0x1E0F, 0x0003)]
    nv = [d.nvme for d in ds if d.nvme is not None]
    assert [(n.controller, n.first_minor, n.namespaces) for n in nv] == [
        (0, 0, 1), (1, 1, 2), (2, 3, 1)]
    assert nv[0].capacity == SECTORS_3_84_TB * 512
    assert nv[2].capacity == 7680 * 2**30


def test_controller_subsystem_and_char_device() -> None:
    n = node()
    tree = build_tree(n)
    d = drives(n)[0]
    assert d.nvme is not None
    fn = d.functions[0].path
    ctrl = f"{fn}/nvme/nvme0"
    assert target(tree, "sys/class/nvme/nvme0") == ctrl
    assert target(tree, f"{ctrl}/device") == fn
    assert target(tree, f"{ctrl}/subsystem") == "sys/class/nvme"
    assert text(tree, f"{ctrl}/model") == "SAMSUNG MZWLJ3T8HBLS-00007\n"
    serial = text(tree, f"{ctrl}/serial").strip()
    assert serial.startswith("S4YNNE0R")
    assert len(serial) == 14
    assert text(tree, f"{ctrl}/firmware_rev") == "EPK9CB5Q\n"
    assert text(tree, f"{ctrl}/transport") == "pcie\n"
    assert text(tree, f"{ctrl}/address") == f"{d.address}\n"
    assert text(tree, f"{ctrl}/state") == "live\n"
    assert text(tree, f"{ctrl}/numa_node") == "0\n"
    assert text(tree, f"{ctrl}/cntlid") == "0\n"
    # nvme_init_subnqn's NQN for a controller without one: vid, ssvid, SN (20), MN (40).
    nqn = text(tree, f"{ctrl}/subsysnqn").rstrip("\n")
    model = "SAMSUNG MZWLJ3T8HBLS-00007"
    assert nqn == f"nqn.2014.08.org.nvmexpress:144d144d{serial:<20}{model:<40}"
    dev = tree.get("dev/nvme0")
    assert isinstance(dev, CharDevice)
    assert (dev.major, dev.minor) == (_nvme.NVME_CHAR_MAJOR, 0)
    assert text(tree, f"{ctrl}/dev") == f"{_nvme.NVME_CHAR_MAJOR}:0\n"
    assert target(tree, f"sys/dev/char/{_nvme.NVME_CHAR_MAJOR}:0") == ctrl
    sub = "sys/devices/virtual/nvme-subsystem/nvme-subsys0"
    assert target(tree, "sys/class/nvme-subsystem/nvme-subsys0") == sub
    assert target(tree, f"{sub}/nvme0") == ctrl
    assert text(tree, f"{sub}/subsysnqn") == f"{nqn}\n"
    assert text(tree, f"{sub}/subsystype") == "nvm\n"
    assert text(tree, _nvme.MULTIPATH) == "N\n"
    assert tree.devices["nvme0"].dev_nodes == ("dev/nvme0", "dev/nvme0n1")
    assert tree.devices["nvme0"].kind == "nvme"


def test_namespaces_are_block_disks_below_their_controller() -> None:
    n = node()
    tree = build_tree(n)
    expected = {  # disk -> (minor, sectors, logical block size, controller BDF)
        "nvme0n1": (0, SECTORS_3_84_TB, 512),
        "nvme1n1": (1, SECTORS_3_84_TB // 2 // 8 * 8, 4096),
        "nvme1n2": (2, SECTORS_3_84_TB // 2 // 8 * 8, 4096),
        "nvme2n1": (3, 7680 * 2**30 // 512, 512),
    }
    blocks = tree.get("sys/block")
    assert blocks is not None
    assert sorted(getattr(blocks, "children", {})) == sorted(expected)
    for name, (minor, sectors, lba) in expected.items():
        disk = target(tree, f"sys/block/{name}")
        ctrl = disk.rsplit("/", 1)[0]
        assert ctrl.endswith("/nvme/" + name.rsplit("n", 1)[0])
        assert target(tree, f"sys/class/block/{name}") == disk
        assert target(tree, f"sys/dev/block/259:{minor}") == disk
        assert target(tree, f"{disk}/device") == ctrl
        assert target(tree, f"{disk}/subsystem") == "sys/class/block"
        assert text(tree, f"{disk}/dev") == f"259:{minor}\n"
        assert tree.get(f"dev/{name}") == BlockDevice(259, minor, 0o660)  # as udev makes it
        assert text(tree, f"{disk}/size") == f"{sectors}\n"
        assert text(tree, f"{disk}/nsid") == f"{name[-1]}\n"
        assert f"DEVNAME={name}\nDEVTYPE=disk\n" in text(tree, f"{disk}/uevent")
        assert text(tree, f"{disk}/queue/logical_block_size") == f"{lba}\n"
        assert text(tree, f"{disk}/queue/hw_sector_size") == f"{lba}\n"
        assert text(tree, f"{disk}/queue/physical_block_size") == f"{max(lba, 4096)}\n"
        assert text(tree, f"{disk}/queue/rotational") == "0\n"
        assert int(text(tree, f"{disk}/queue/nr_requests")) > 0
        assert len(text(tree, f"{disk}/stat").split()) == 17
        assert text(tree, f"{disk}/wwid").startswith("eui.")


def test_faults_unplug_and_replug() -> None:
    n = node()
    d = drives(n)[1]
    whole = build_tree(n)
    ctrl = f"{d.functions[0].path}/nvme/nvme1"
    down = build_tree(n, {d.id: DeviceState(Health.UNHEALTHY, Reason.LINK_DOWN)})
    assert text(down, f"{ctrl}/state") == "dead\n"
    assert "SDES 1" in text(down, f"{d.functions[0].path}/aer_dev_fatal")
    aer = build_tree(n, {d.id: DeviceState(Health.UNHEALTHY, Reason.AER_FATAL)})
    assert text(aer, f"{ctrl}/state") == "resetting\n"
    gone = build_tree(n, {d.id: DeviceState(plugged=False)})
    for path in ("sys/class/nvme/nvme1", "sys/block/nvme1n1", "sys/block/nvme1n2",
                 "sys/class/block/nvme1n2", "sys/dev/block/259:1", "sys/dev/char/241:1",
                 "dev/nvme1", "dev/nvme1n1", "dev/nvme1n2",
                 "sys/class/nvme-subsystem/nvme-subsys1",
                 "sys/devices/virtual/nvme-subsystem/nvme-subsys1",
                 f"sys/bus/pci/devices/{d.address}"):
        assert gone.get(path) is None, path
    assert gone.get("sys/block/nvme0n1") is not None  # the others keep their names
    assert gone.get("sys/block/nvme2n1") is not None
    assert build_tree(n, {d.id: DeviceState()}).digest() == whole.digest()


def test_the_demo_profile_has_one_drive_on_numa_node_0() -> None:
    n = load_profile(REPO / "profiles/8gpu-2numa.yaml").cluster.nodes[0]
    ds = drives(n)
    assert [(d.id, d.numa_node, d.model) for d in ds] == [("nvme0", 0, "pm1733")]
    tree = build_tree(n)
    numa0 = next(x for x in n.numa if x.id == 0)
    cpus = format_cpulist(numa0.cpus)
    assert text(tree, f"{ds[0].functions[0].path}/local_cpulist") == f"{cpus}\n"
    # The NVIDIA GPUs keep their minors and addresses: the drive comes after them.
    assert [d.address for d in n.devices if d.gpu is not None][:4] == [
        "0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"]


# -- real readers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[NodeSpec, Path]:
    n = node()
    root = tmp_path_factory.mktemp("nvme") / "root"
    render(build_tree(n), root)
    return n, root


def test_lsblk_lists_every_namespace(rendered: tuple[NodeSpec, Path]) -> None:
    n, root = rendered
    out = run([need("lsblk", "util-linux"), "--sysroot", str(root), "-J", "-b", "-o",
               "NAME,MAJ:MIN,SIZE,TYPE,MODEL,SERIAL,TRAN,ROTA,LOG-SEC,PHY-SEC"])
    got = {b["name"]: b for b in json.loads(out)["blockdevices"]}
    tree = build_tree(n)
    want = {}
    for d in drives(n):
        assert d.nvme is not None
        for nsid in range(1, d.nvme.namespaces + 1):
            want[_nvme.disk_name(d.nvme, nsid)] = (d, nsid)
    assert sorted(got) == sorted(want)
    for name, (d, nsid) in want.items():
        assert d.nvme is not None
        b = got[name]
        assert b["maj:min"] == f"259:{d.nvme.first_minor + nsid - 1}"
        assert b["size"] == _nvme.namespace_sectors(d.nvme) * 512
        assert b["type"] == "disk"
        assert b["model"] == d.nvme.model_number
        ctrl = f"{d.functions[0].path}/nvme/nvme{d.nvme.controller}"
        assert b["serial"] == text(tree, f"{ctrl}/serial").strip()
        assert b["tran"] == "nvme"
        assert b["rota"] is False
        assert b["log-sec"] == d.nvme.lba_size
        assert b["phy-sec"] == max(d.nvme.lba_size, 4096)


def test_lsblk_reads_the_demo_render_with_real_block_nodes(tmp_path: Path) -> None:
    """``render --mknod --real-numbers`` of the demo profile: /dev/nvme0n1 is the block
    device 259:0 and lsblk, reading the fake sysfs, lists the namespace with that number."""
    if os.geteuid() != 0:
        pytest.fail("mknod needs root: run this test as root")
    n = load_profile(REPO / "profiles/8gpu-2numa.yaml").cluster.nodes[0]
    root = tmp_path / "root"
    render(build_tree(n), root, mknod=True, real_numbers=True)
    st = (root / "dev/nvme0n1").lstat()
    assert stat.S_ISBLK(st.st_mode)
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (259, 0)
    assert stat.S_ISCHR((root / "dev/nvme0").lstat().st_mode)  # the controller
    out = run([need("lsblk", "util-linux"), "--sysroot", str(root), "-J", "-o",
               "NAME,MAJ:MIN,TYPE,TRAN"])
    assert json.loads(out)["blockdevices"] == [
        {"name": "nvme0n1", "maj:min": "259:0", "type": "disk", "tran": "nvme"}]


def test_lspci_sees_nvme_controllers(rendered: tuple[NodeSpec, Path]) -> None:
    n, root = rendered
    records = lspci_records(root)
    for d in drives(n):
        rec = records[d.address]
        assert bracket_id(rec["Class"]) == "0108"
        assert rec["Class"].startswith("Non-Volatile memory controller")
        assert rec["ProgIf"] == "02"
        assert rec["Driver"] == "nvme"
        assert rec["NUMANode"] == str(d.numa_node)
    text_out = run(["lspci", "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci",
                    "-nn", "-s", drives(n)[0].address])
    assert "Non-Volatile memory controller [0108]" in text_out
    assert "[144d:a824]" in text_out


def test_hwloc_places_block_devices_under_their_pci_function(
        rendered: tuple[NodeSpec, Path]) -> None:
    n, root = rendered
    xml = lstopo(root, "--filter", "io:all", "--filter", "osdev:all")
    up = parents(xml)
    blocks = {o.get("name"): o for o in xml.iter("object")
              if o.get("type") == "OSDev" and o.get("subtype") == "Disk"}
    for d in drives(n):
        assert d.nvme is not None
        for nsid in range(1, d.nvme.namespaces + 1):
            obj = blocks[_nvme.disk_name(d.nvme, nsid)]
            pcidev = up[obj]
            assert pcidev.get("pci_busid") == d.address
            info = {i.get("name"): i.get("value") for i in obj.iter("info")}
            assert info["LinuxDeviceID"] == f"259:{d.nvme.first_minor + nsid - 1}"
            assert int(info["Size"]) == _nvme.namespace_sectors(d.nvme) * 512 // 1024
            anc = up[pcidev]
            while anc.get("type") in ("Bridge", "PCIDev"):
                anc = up[anc]
            nodeset = int(anc.get("nodeset", "0x0").replace(",", "").replace("0x", ""), 16)
            assert nodeset == 1 << d.numa_node


def test_nvme_cli_lists_subsystems_and_controllers(rendered: tuple[NodeSpec, Path]) -> None:
    """nvme-cli reads subsystems and controllers from /sys/class (bind-mounted from the
    fake root in a private mount namespace); it identifies namespaces with ioctls on
    /dev/nvmeXnY, which a fake root cannot answer, so it lists none (docs/sysfs-reference.md)."""
    n, root = rendered
    if os.geteuid() != 0:
        pytest.fail("nvme list over a fake sysfs needs root (unshare -m and bind mounts)")
    nvme = need("nvme", "nvme-cli")
    script = (f"mount --bind '{root}/sys/class' /sys/class && "
              f"mount --bind '{root}/sys/devices' /sys/devices && exec '{nvme}' list -v -o json")
    out = run([need("unshare", "util-linux"), "-m", "--propagation", "private", "sh", "-c",
               script])
    subsystems = {s["Subsystem"]: s for dev in json.loads(out)["Devices"]
                  for s in dev["Subsystems"]}
    tree = build_tree(n)
    assert sorted(subsystems) == [f"nvme-subsys{i}" for i in range(len(drives(n)))]
    for d in drives(n):
        assert d.nvme is not None
        k = d.nvme.controller
        ctrl = f"{d.functions[0].path}/nvme/nvme{k}"
        sub = subsystems[f"nvme-subsys{k}"]
        assert sub["SubsystemNQN"].rstrip() == text(tree, f"{ctrl}/subsysnqn").rstrip()
        (c,) = sub["Controllers"]
        assert c["Controller"] == f"nvme{k}"
        assert c["SerialNumber"] == text(tree, f"{ctrl}/serial").strip()
        assert c["ModelNumber"] == d.nvme.model_number
        assert c["Firmware"] == d.nvme.firmware
        assert c["Transport"] == "pcie"
        assert c["Address"] == d.address


def test_our_plugins_leave_the_demo_drive_alone(tmp_path: Path) -> None:
    """The device plugin and the DRA driver offer GPUs, NICs and FPGAs: the demo's NVMe
    drive (class 0x0108) is no resource of theirs."""
    from hwplugins.deviceplugin.discovery import discover as plugin_discover
    from hwplugins.dra.discovery import discover as dra_discover

    n = load_profile(REPO / "profiles/8gpu-2numa.yaml").cluster.nodes[0]
    root = tmp_path / "root"
    render(build_tree(n), root)
    drive = drives(n)[0].address
    offered = plugin_discover(root)
    assert [d.resource for d in offered] == ["nvidia.com/gpu"] * 8
    assert drive not in {getattr(d, "address", None) for d in offered}
    names = [d.name for d in dra_discover(root)]
    assert len(names) == 10
    assert all(name.startswith(("gpu-", "nic-")) for name in names)

"""`sandbox mount` of a real profile: the live mount equals the render, faults show at once.

Everything goes through the CLI a user would type (`sandbox mount --daemon`,
`sandbox render`, `sandbox fault --socket ...`) and the real readers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.agent import unmount
from sandbox.errors import ControlError
from sandbox.fakehw.control import ControlClient
from sandbox.profile.spec import FORMAT_VERSION
from tests.support.fakehw_toy import require_fuse
from tests.support.paths import REPO as ROOT
from tests.support.readers import lstopo, run

pytestmark = [pytest.mark.root, pytest.mark.fuse]

PROFILE = ROOT / "profiles" / "8gpu-2numa.yaml"


def sandbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=ROOT, text=True,
                          capture_output=True, check=False, timeout=120)


@pytest.fixture(scope="module")
def mounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    require_fuse()
    base = tmp_path_factory.mktemp("mount")
    root = base / "root"
    result = sandbox("mount", str(PROFILE), "--node", "gpu-worker", str(root), "--daemon",
                     "--state-dir", str(base), "--pid-file", str(base / "pid"))
    assert result.returncode == 0, result.stderr
    pid = int((base / "pid").read_text())
    try:
        yield root, base / "control.sock"
    finally:
        os.kill(pid, signal.SIGTERM)  # the server unmounts itself and exits
        for _ in range(600):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            unmount(root)
            raise AssertionError(f"server {pid} did not exit within 30 s of SIGTERM")
        assert not root.is_mount()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("render") / "root"
    result = sandbox("render", str(PROFILE), "--node", "gpu-worker", "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def _snapshot(root: Path) -> dict[str, tuple[str, bytes | str]]:
    """Every entry below root: type and content (file bytes, link target)."""
    out: dict[str, tuple[str, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir", "")
            elif path.is_char_device():
                out[rel] = ("chr", "")
            elif path.is_block_device():
                out[rel] = ("blk", "")
            else:
                out[rel] = ("file", path.read_bytes())
    return out


def test_mount_serves_the_same_bytes_and_links_as_render(mounted: tuple[Path, Path],
                                                         rendered: Path) -> None:
    root, _ = mounted
    _assert_same_as_render(root, rendered)


def _assert_same_as_render(root: Path, rendered: Path) -> None:
    live = _snapshot(root)
    plain = _snapshot(rendered)
    # The render writes device entries as placeholders plus dev/.devices; the mount
    # serves them as char and block devices. Everything else must be identical.
    plain.pop("dev/.devices")
    plain.pop(".hwsandbox-render", None)
    for rel, (kind, _) in live.items():
        if kind in ("chr", "blk"):
            assert plain.pop(rel)[0] == "file"
    live = {k: v for k, v in live.items() if v[0] not in ("chr", "blk")}
    assert live.keys() == plain.keys()
    different = [k for k in live if live[k] != plain[k]]
    assert different == []


def test_mount_serves_a_resolved_spec_file(tmp_path: Path, rendered: Path) -> None:
    """`sandbox show -o spec` then `sandbox mount --spec`: the same tree as the profile's."""
    require_fuse()
    result = sandbox("show", str(PROFILE), "-o", "spec", "--node", "gpu-worker")
    assert result.returncode == 0, result.stderr
    spec_file = tmp_path / "gpu-worker.json"
    spec_file.write_text(result.stdout)
    root = tmp_path / "root"
    result = sandbox("mount", "--spec", str(spec_file), str(root), "--daemon")
    assert result.returncode == 0, result.stderr
    try:
        _assert_same_as_render(root, rendered)
    finally:
        unmount(root)


@pytest.mark.parametrize(("args", "message"), [
    (("--spec", "{bad}"), "{bad}: resolved spec version 0; this sandbox reads version "
                          f"{FORMAT_VERSION} (resolve the profile again)"),
    ((str(PROFILE), "--spec"), "{bad}: not a resolved spec (not JSON: Expecting value: "
                               "line 1 column 1 (char 0))".replace("{bad}", str(PROFILE))),
    ((str(PROFILE),), "--node NAME is needed with a profile"),
])
def test_mount_refuses_a_bad_source_before_mounting(tmp_path: Path, args: tuple[str, ...],
                                                    message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "hwsandbox.dev/resolved-spec", "version": 0}')
    root = tmp_path / "root"
    result = sandbox("mount", *(a.replace("{bad}", str(bad)) for a in args), str(root),
                     "--daemon")
    expected = f"error: {message.replace('{bad}', str(bad))}\n"
    assert (result.returncode, result.stderr) == (1, expected)
    assert not root.exists()


def _gpus(xml: ET.Element) -> list[str]:
    return sorted(o.get("pci_busid", "") for o in xml.iter("object")
                  if o.get("type") == "PCIDev" and o.get("pci_type", "").startswith("0302"))


def test_hwloc_sees_the_same_topology_through_the_mount(mounted: tuple[Path, Path],
                                                        rendered: Path) -> None:
    root, _ = mounted
    a, b = lstopo(root), lstopo(rendered)
    # gp_index numbers objects in discovery order, which follows readdir order: the
    # on-disk render lists directories in hash order, the mount in sorted order.
    for xml in (a, b):
        for obj in xml.iter("object"):
            obj.attrib.pop("gp_index", None)
    assert ET.tostring(a) == ET.tostring(b)
    assert len(_gpus(a)) == 8


def test_the_nvme_namespace_is_a_block_device_through_the_mount(
        mounted: tuple[Path, Path]) -> None:
    """/dev/nvme0n1 is served as the block device 259:0 (the controller /dev/nvme0 as a
    character device), and lsblk reads the namespace through the mount."""
    root, _ = mounted
    st = os.lstat(root / "dev/nvme0n1")
    assert stat.S_ISBLK(st.st_mode)
    assert st.st_rdev == os.makedev(259, 0)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert stat.S_ISCHR(os.lstat(root / "dev/nvme0").st_mode)
    assert os.path.realpath(root / "sys/dev/block/259:0") == os.path.realpath(
        root / "sys/block/nvme0n1")
    lsblk = shutil.which("lsblk")
    if lsblk is None:
        pytest.fail("lsblk is not installed: apt-get install -y util-linux")
    out = run([lsblk, "--sysroot", str(root), "-J", "-o", "NAME,MAJ:MIN,TYPE"])
    assert json.loads(out)["blockdevices"] == [
        {"name": "nvme0n1", "maj:min": "259:0", "type": "disk"}]


def test_a_dev_mapped_mount_shows_block_nodes_as_the_character_stand_in(
        tmp_path: Path) -> None:
    """With ``--dev --dev-map`` every node is the stand-in 1:3 (/dev/null), block nodes as
    CHARACTER devices: a block 1:3 would be /dev/ram3."""
    require_fuse()
    root = tmp_path / "root"
    result = sandbox("mount", str(PROFILE), "--node", "gpu-worker", str(root), "--daemon",
                     "--dev", "--dev-map", "1:3")
    assert result.returncode == 0, result.stderr
    try:
        for node in ("dev/nvme0n1", "dev/nvme0", "dev/nvidia0"):
            st = os.lstat(root / node)
            assert stat.S_ISCHR(st.st_mode), node
            assert st.st_rdev == os.makedev(1, 3), node
    finally:
        unmount(root)


def test_unplug_and_plug_a_gpu_through_the_cli(mounted: tuple[Path, Path]) -> None:
    root, sock = mounted
    pci = root / "sys/bus/pci/devices/0000:03:00.0"
    before = _snapshot(root)
    assert pci.exists()
    assert (root / "dev/nvidia2").exists()
    started = time.monotonic()
    result = sandbox("fault", "--socket", str(sock), "unplug", "gpu-worker", "gpu2")
    assert result.returncode == 0, result.stderr
    assert "gpu2: unplugged" in result.stdout
    assert time.monotonic() - started < 5  # CLI start-up included; the change itself is ms
    assert not pci.exists()
    assert "nvidia2" not in os.listdir(root / "dev")
    assert "0000:03:00.0" not in os.listdir(root / "sys/bus/pci/devices")
    assert "0000:03:00.0" not in os.listdir(root / "sys/bus/pci/drivers/nvidia")
    assert len(_gpus(lstopo(root))) == 7
    result = sandbox("fault", "--socket", str(sock), "plug", "gpu-worker", "gpu2")
    assert result.returncode == 0, result.stderr
    assert _snapshot(root) == before
    assert len(_gpus(lstopo(root))) == 8


def test_health_flip_shows_in_aer_counters_on_next_open(mounted: tuple[Path, Path]) -> None:
    root, sock = mounted
    aer = root / "sys/bus/pci/devices/0000:81:00.0/aer_dev_fatal"
    assert aer.read_text().splitlines()[-1] == "TOTAL_ERR_FATAL 0"
    with ControlClient(sock) as client:
        client.health("gpu4", "unhealthy", "aer-fatal")
        assert aer.read_text().splitlines()[-1] == "TOTAL_ERR_FATAL 1"
        client.health("gpu4", "healthy")
    assert aer.read_text().splitlines()[-1] == "TOTAL_ERR_FATAL 0"


def test_link_down_shows_in_operstate(mounted: tuple[Path, Path]) -> None:
    root, sock = mounted
    nets = sorted((root / "sys/class/net").iterdir())
    pf = next(p for p in nets if (p / "device").resolve().name == "0000:05:00.0")
    assert (pf / "operstate").read_text() == "up\n"
    result = sandbox("fault", "--socket", str(sock), "health", "gpu-worker", "nic0",
                     "unhealthy", "--reason", "link-down")
    assert result.returncode == 0, result.stderr
    assert (pf / "operstate").read_text() == "down\n"
    assert (pf / "carrier").read_text() == "0\n"
    sandbox("fault", "--socket", str(sock), "health", "gpu-worker", "nic0", "healthy")
    assert (pf / "operstate").read_text() == "up\n"


def test_fault_list_names_every_device(mounted: tuple[Path, Path]) -> None:
    _, sock = mounted
    result = sandbox("fault", "--socket", str(sock), "list")
    assert result.returncode == 0, result.stderr
    ids = [line.split()[1] for line in result.stdout.splitlines()[1:]]
    assert ids == [f"gpu{i}" for i in range(8)] + ["nic0", "nic1", "nvme0"]


def test_nvme_unplug_and_link_down_through_the_cli(mounted: tuple[Path, Path]) -> None:
    """The demo's NVMe drive takes the generic PCI faults: unplugged, its controller, disk
    and block links vanish; a surprise link down leaves the controller dead."""
    root, sock = mounted
    state = root / "sys/class/nvme/nvme0/state"
    disk = root / "sys/block/nvme0n1"
    assert state.read_text() == "live\n"
    assert (disk / "queue/rotational").read_text() == "0\n"
    result = sandbox("fault", "--socket", str(sock), "unplug", "gpu-worker", "nvme0")
    assert result.returncode == 0, result.stderr
    assert not disk.exists()
    assert not (root / "sys/class/nvme/nvme0").exists()
    assert not (root / "sys/dev/block/259:0").exists()
    assert not os.path.lexists(root / "dev/nvme0n1")
    assert not (root / "sys/bus/pci/devices/0000:06:00.0").exists()
    result = sandbox("fault", "--socket", str(sock), "plug", "gpu-worker", "nvme0")
    assert result.returncode == 0, result.stderr
    assert (disk / "size").read_text() == "7501476528\n"
    assert stat.S_ISBLK(os.lstat(root / "dev/nvme0n1").st_mode)
    result = sandbox("fault", "--socket", str(sock), "health", "gpu-worker", "nvme0",
                     "unhealthy", "--reason", "link-down")
    assert result.returncode == 0, result.stderr
    assert state.read_text() == "dead\n"
    sandbox("fault", "--socket", str(sock), "health", "gpu-worker", "nvme0", "healthy")
    assert state.read_text() == "live\n"


def test_bad_fault_is_a_clear_error(mounted: tuple[Path, Path]) -> None:
    _, sock = mounted
    result = sandbox("fault", "--socket", str(sock), "unplug", "gpu-worker", "gpu99")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ")
    assert "gpu99" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("device", "count", "message"), [
    ("nic0", "4096", "nic0 has no SR-IOV"),  # this profile's NICs have no sriov
    ("gpu0", "0", "gpu0 has no SR-IOV"),
])
def test_set_vfs_is_refused_where_the_kernel_refuses_it(mounted: tuple[Path, Path], device: str,
                                                        count: str, message: str) -> None:
    root, sock = mounted
    result = sandbox("fault", "--socket", str(sock), "set-vfs", "gpu-worker", device, count)
    assert result.returncode == 1
    assert message in result.stderr
    state = json.loads((sock.parent / "state.json").read_text()) if (
        sock.parent / "state.json").exists() else {}
    assert state.get(device, {}).get("num_vfs") is None  # refused: not saved either


def test_set_vfs_past_totalvfs_is_refused(tmp_path: Path) -> None:
    require_fuse()
    root = tmp_path / "root"
    result = sandbox("mount", str(ROOT / "profiles" / "sriov-rdma.yaml"), "--node",
                     "net-worker", str(root), "--daemon")
    assert result.returncode == 0, result.stderr
    try:
        with ControlClient(f"{root}.sock") as c:
            nic = next(d for d in c.devices().values() if d["kind"] == "nic")
            total = int((root / "sys/bus/pci/devices" / nic["pci_address"] /
                         "sriov_totalvfs").read_text())
            with pytest.raises(ControlError, match=f"exceeds sriov_totalvfs {total}"):
                c.set_vfs(nic["id"], total + 1)
            assert c.set_vfs(nic["id"], total)["ok"]
    finally:
        unmount(root)


def test_set_vfs_targets_one_port_of_a_dual_port_card(tmp_path: Path) -> None:
    """The kernel has one sriov_numvfs per physical function: --port sets one of them."""
    require_fuse()
    root = tmp_path / "root"
    result = sandbox("mount", str(ROOT / "profiles" / "sriov-rdma.yaml"), "--node",
                     "net-worker", str(root), "--daemon")
    assert result.returncode == 0, result.stderr
    sock = f"{root}.sock"
    try:
        with ControlClient(sock) as c:
            nic = next(d for d in c.devices().values() if d["kind"] == "nic")
        pf0 = root / "sys/bus/pci/devices" / nic["pci_address"]
        pf1 = pf0.parent / (nic["pci_address"][:-1] + "1")
        before = (pf0 / "sriov_numvfs").read_text()

        def virtfns(pf: Path) -> int:
            return sum(1 for p in pf.iterdir() if p.name.startswith("virtfn"))

        fault = ("fault", "--socket", sock, "set-vfs", "net-worker", nic["id"])
        result = sandbox(*fault, "3", "--port", "1")
        assert result.returncode == 0, result.stderr
        assert (pf1 / "sriov_numvfs").read_text() == "3\n"
        assert virtfns(pf1) == 3
        assert (pf0 / "sriov_numvfs").read_text() == before  # the other port is untouched
        assert virtfns(pf0) == int(before)

        result = sandbox(*fault, "2", "--port", "2")  # a dual-port card has ports 0 and 1
        assert result.returncode == 1
        assert "has 2 port(s), no port 2" in result.stderr
        assert (pf1 / "sriov_numvfs").read_text() == "3\n"  # refused: nothing changed

        assert sandbox(*fault, "1").returncode == 0  # no --port: every physical function
        assert (pf0 / "sriov_numvfs").read_text() == "1\n"
        assert (pf1 / "sriov_numvfs").read_text() == "1\n"
    finally:
        unmount(root)

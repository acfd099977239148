"""``render`` and ``sandbox render``: what lands on disk, and where it refuses to write."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from sandbox.agent import create_device_nodes, remove_device_nodes
from sandbox.cli import main
from sandbox.errors import MountError, RenderError, SandboxError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import DEVICES_LIST, MARKER, render
from sandbox.fakehw.serve.mountroot import check_mount_root
from sandbox.fakehw.tree import (
    BlockDevice,
    CharDevice,
    DeviceState,
    Dir,
    File,
    Symlink,
    Tree,
    TreeError,
)
from sandbox.profile import load_profile
from sandbox.profile.spec import NodeSpec
from tests.support.paths import REPO

pytestmark = [pytest.mark.root]

DEMO = REPO / "profiles" / "8gpu-2numa.yaml"


@pytest.fixture(scope="module")
def node() -> NodeSpec:
    return load_profile(DEMO).cluster.nodes[0]


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str | int]]:
    """Every path below root: (kind, content/target/rdev) — to compare renders byte for byte."""
    out: dict[str, tuple[str, bytes | str | int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            elif stat.S_ISCHR(st.st_mode):
                out[rel] = ("chr", st.st_rdev)
            elif stat.S_ISBLK(st.st_mode):
                out[rel] = ("blk", st.st_rdev)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


def test_render_writes_the_tree_with_placeholders(tmp_path: Path, node: NodeSpec) -> None:
    tree = build_tree(node)
    stats = render(tree, tmp_path / "root")
    root = tmp_path / "root"
    assert not stats.mknod
    listed = (root / DEVICES_LIST).read_text().splitlines()
    devices = {p: e for p, e in tree.walk() if isinstance(e, (CharDevice, BlockDevice))}
    assert len(listed) == len(devices) == stats.devices
    assert any(isinstance(e, BlockDevice) for e in devices.values())  # the NVMe namespace
    for line in listed:
        name, kind, major, minor = line.split()
        dev = devices[f"dev/{name}"]
        assert kind == ("b" if isinstance(dev, BlockDevice) else "c"), name
        assert (int(major), int(minor)) == (dev.major, dev.minor)
        assert (root / "dev" / name).is_file()
    for path, entry in tree.walk():
        p = root / path
        if isinstance(entry, File):
            assert p.read_bytes() == entry.data
            assert stat.S_IMODE(p.lstat().st_mode) == entry.mode
        elif isinstance(entry, Symlink):
            assert os.readlink(p) == entry.target
            real = os.path.realpath(p)
            assert real.startswith(str(root) + "/"), path
            assert os.path.exists(real), path
        elif isinstance(entry, Dir):
            assert p.is_dir()
            assert not p.is_symlink()


def test_two_renders_are_byte_identical(tmp_path: Path, node: NodeSpec) -> None:
    render(build_tree(node), tmp_path / "a")
    render(build_tree(node), tmp_path / "b")
    assert snapshot(tmp_path / "a") == snapshot(tmp_path / "b")


def test_unplug_replug_renders_identically(tmp_path: Path, node: NodeSpec) -> None:
    gpu = node.devices[0].id
    render(build_tree(node), tmp_path / "a")
    render(build_tree(node, {gpu: DeviceState(plugged=False)}), tmp_path / "b")
    render(build_tree(node, {gpu: DeviceState(plugged=True)}), tmp_path / "c")
    assert snapshot(tmp_path / "a") != snapshot(tmp_path / "b")
    assert snapshot(tmp_path / "a") == snapshot(tmp_path / "c")


def test_mknod_makes_harmless_stand_ins_only(tmp_path: Path, node: NodeSpec) -> None:
    """--mknod: every node a character device, the five memory devices as themselves and
    every other one (NVIDIA's 195:N, the NVMe block node 259:0...) as 1:3; modes never
    wider than 0660, the umask applied (no chmod past it)."""
    if os.geteuid() != 0:
        pytest.fail("mknod needs root: run this test as root")
    tree = build_tree(node)
    old = os.umask(0o027)
    try:
        stats = render(tree, tmp_path / "root", mknod=True)
    finally:
        os.umask(old)
    assert stats.mknod
    assert not (tmp_path / "root" / DEVICES_LIST).exists()
    seen = 0
    for path, entry in tree.walk():
        if isinstance(entry, (CharDevice, BlockDevice)):
            st = (tmp_path / "root" / path).lstat()
            assert stat.S_ISCHR(st.st_mode), path
            numbers = (os.major(st.st_rdev), os.minor(st.st_rdev))
            if path in ("dev/zero", "dev/full", "dev/null", "dev/random", "dev/urandom"):
                assert numbers == (entry.major, entry.minor), path
            else:
                assert numbers == (1, 3), path
            assert stat.S_IMODE(st.st_mode) == entry.mode & 0o660 & ~0o027, path
            assert st.st_uid == 0
            seen += 1
    assert seen == stats.devices
    assert stat.S_ISCHR((tmp_path / "root" / "dev" / "nvme0n1").lstat().st_mode)
    assert os.readlink(tmp_path / "root" / "sys/dev/block/259:0").endswith("/nvme0/nvme0n1")
    render(tree, tmp_path / "root", mknod=True, force=True)  # replaces its own nodes
    assert "c dev/nvme0n1" in (tmp_path / "root" / MARKER).read_text().splitlines()


def test_real_numbers_keep_the_trees_own_but_never_wider_than_0660(
        tmp_path: Path, node: NodeSpec) -> None:
    if os.geteuid() != 0:
        pytest.fail("mknod needs root: run this test as root")
    tree = build_tree(node)
    render(tree, tmp_path / "root", mknod=True, real_numbers=True)
    disk = (tmp_path / "root" / "dev" / "nvme0n1").lstat()
    assert stat.S_ISBLK(disk.st_mode)
    assert (os.major(disk.st_rdev), os.minor(disk.st_rdev)) == (259, 0)
    gpu = (tmp_path / "root" / "dev" / "nvidia0").lstat()
    assert (os.major(gpu.st_rdev), os.minor(gpu.st_rdev)) == (195, 0)
    assert stat.S_IMODE(gpu.st_mode) & ~0o660 == 0
    # a forced render removes its block nodes too (the manifest's "b" lines)
    render(tree, tmp_path / "root", mknod=True, force=True, real_numbers=True)
    assert "b dev/nvme0n1" in (tmp_path / "root" / MARKER).read_text().splitlines()


HOSTILE_NODES = """\
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: hostile}
nodes:
  - name: n
    cpu: {sockets: 1, coresPerSocket: 2}
    memory: 4Gi
    devices:
      - type: generic
        vendorId: 0x8086
        deviceId: 0x1
        classCode: 0x120000
        devNodes:
          - {name: vcs-host, major: 7, minor: 0}
          - {name: ttyS0-host, major: 4, minor: 64}
          - {name: sg0, major: 21, minor: 0}
          - {name: snd/pcm, major: 116, minor: 3}
"""


@pytest.mark.parametrize("verb", ["render", "dev-dir"])
def test_a_profiles_own_numbers_never_reach_a_real_node(tmp_path: Path, verb: str) -> None:
    """The host console (7:0), serial port (4:64), raw SCSI (21:0) and sound named by a
    profile become 1:3 stand-ins, root-only: `render --mknod` and a runtime's device dir."""
    if os.geteuid() != 0:
        pytest.fail("mknod needs root: run this test as root")
    profile = tmp_path / "hostile.yaml"
    profile.write_text(HOSTILE_NODES)
    if verb == "render":
        assert main(["render", str(profile), "--out", str(tmp_path / "out"), "--mknod"]) == 0
        dev = tmp_path / "out" / "dev"
    else:
        dev = tmp_path / "dev"
        tree = build_tree(load_profile(str(profile)).cluster.nodes[0])
        made = create_device_nodes(tree, dev)
    for name in ("vcs-host", "ttyS0-host", "sg0", "snd/pcm"):
        st = (dev / name).lstat()
        assert stat.S_ISCHR(st.st_mode), name
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3), name
        assert stat.S_IMODE(st.st_mode) & ~0o660 == 0, (name, oct(st.st_mode))
        assert st.st_uid == 0
    if verb == "dev-dir":
        remove_device_nodes(made, dev)
        assert os.listdir(dev) == []  # the nodes and the snd/ directory it made


@pytest.mark.parametrize("target", ["/", "/sys", "/sys/devices/x", "/proc", "/proc/1",
                                    "/dev", "/dev/dri/x"])
def test_refuses_the_hosts_own_trees(tmp_path: Path, target: str) -> None:
    with pytest.raises(RenderError, match="refusing"):
        render(Tree(), target, force=True)


def test_refuses_a_path_resolving_into_sys(tmp_path: Path) -> None:
    (tmp_path / "sneaky").symlink_to("/sys/kernel")
    with pytest.raises(RenderError, match="refusing"):
        render(Tree(), tmp_path / "sneaky", force=True)


def test_refuses_what_looks_like_a_real_sysfs_even_with_force(tmp_path: Path) -> None:
    for name in ("devices", "bus", "class", "kernel", "module"):
        (tmp_path / name).mkdir()
    with pytest.raises(RenderError, match="real sysfs"):
        render(Tree(), tmp_path, force=True)
    assert sorted(os.listdir(tmp_path)) == ["bus", "class", "devices", "kernel", "module"]


def test_non_empty_needs_force_and_force_replaces_a_render(tmp_path: Path,
                                                           node: NodeSpec) -> None:
    out = tmp_path / "root"
    out.mkdir()
    (out / "keep.txt").write_text("user data\n")
    (out / "sys").mkdir()
    (out / "sys" / "notes").write_text("user data in a dir the tree also has\n")
    with pytest.raises(RenderError, match="--force"):
        render(build_tree(node), out)
    render(build_tree(node), out, force=True)
    assert (out / "keep.txt").read_text() == "user data\n"  # not ours: left alone
    assert (out / MARKER).exists()
    gpu = node.devices[0]
    for _ in range(2):  # the second and third forced renders replace only what a render wrote
        render(build_tree(node, {gpu.id: DeviceState(plugged=False)}), out, force=True)
        assert not (out / "sys/bus/pci/devices" / gpu.address).exists()
        assert (out / "keep.txt").read_text() == "user data\n"
        assert (out / "sys" / "notes").read_text() == "user data in a dir the tree also has\n"
    render(build_tree(node), out, force=True)
    assert (out / "sys/bus/pci/devices" / gpu.address).is_dir()
    fresh = tmp_path / "fresh"
    render(build_tree(node), fresh)
    mine = snapshot(out)
    for extra in ("keep.txt", "sys/notes", MARKER):
        mine.pop(extra)
    theirs = snapshot(fresh)
    theirs.pop(MARKER)
    assert mine == theirs


def test_force_never_replaces_a_foreign_file(tmp_path: Path, node: NodeSpec) -> None:
    out = tmp_path / "root"
    (out / "proc").mkdir(parents=True)
    (out / "proc" / "cpuinfo").write_text("mine\n")
    with pytest.raises(RenderError, match="proc/cpuinfo: already exists and was not written"):
        render(build_tree(node), out, force=True)
    assert (out / "proc" / "cpuinfo").read_text() == "mine\n"
    # What that failed render did write is in the manifest: a later one can undo it.
    (out / "proc" / "cpuinfo").unlink()
    render(build_tree(node), out, force=True)
    assert (out / "proc" / "cpuinfo").read_text().startswith("processor")


def test_force_does_not_follow_planted_symlinks(tmp_path: Path, node: NodeSpec) -> None:
    out = tmp_path / "root"
    victim = tmp_path / "victim"
    victim.mkdir()
    out.mkdir()
    (out / "proc").symlink_to(victim)
    with pytest.raises(RenderError, match="proc: already exists and was not written"):
        render(build_tree(node), out, force=True)
    assert os.listdir(victim) == []
    assert (out / "proc").is_symlink()  # not ours: not replaced either


def test_a_symlink_planted_between_renders_is_not_followed(tmp_path: Path,
                                                           node: NodeSpec) -> None:
    out = tmp_path / "root"
    victim = tmp_path / "victim"
    (victim / "class").mkdir(parents=True)
    (victim / "class" / "precious").write_text("keep me")
    render(build_tree(node), out)
    shutil.rmtree(out / "sys" / "class")
    (out / "sys" / "class").symlink_to(victim / "class")
    # Manifest lines naming paths through it, or out of the target, are not followed.
    with open(out / MARKER, "a") as fh:
        fh.write("f sys/class/precious\nf ../victim/class/precious\nd ..\n")
    with pytest.raises(RenderError, match="sys/class: already exists and was not written"):
        render(build_tree(node), out, force=True)
    assert (victim / "class" / "precious").read_text() == "keep me"


@pytest.mark.parametrize("target", ["/etc", "/var", "/home", "/root", "/boot", "/run", "/tmp",
                                    "/lib", "/usr", "/etc/hw", "/usr/local/x", "/boot/x"])
def test_refuses_the_hosts_top_level_and_system_dirs(target: str) -> None:
    with pytest.raises(RenderError, match="refusing to render into"):
        render(Tree(), target, force=True)
    assert not Path(target, MARKER).exists()


@pytest.mark.parametrize("target", ["/etc/hw-sandbox-root", "/etc", "/tmp", "/usr/x", "/"])
def test_mount_root_refuses_the_same_host_paths(target: str) -> None:
    with pytest.raises(MountError, match="refusing to mount there"):
        check_mount_root(target)


@pytest.mark.parametrize("bad", ["..", ".", "x\0y"])
def test_tree_refuses_names_that_are_not_one_component(bad: str) -> None:
    tree = Tree()
    with pytest.raises(TreeError, match="is not a plain file name"):
        tree.add_file(f"dev/{bad}", "x")
    with pytest.raises(TreeError, match="is not a plain file name"):
        tree.mkdir(f"sys/{bad}/x")


def test_device_nodes_stay_inside_their_dir_and_only_ours_are_removed(
        tmp_path: Path, node: NodeSpec) -> None:
    if os.geteuid() != 0:
        pytest.fail("mknod needs root: run this test as root")
    dev = tmp_path / "dev"
    outside = tmp_path / "outside"
    outside.mkdir()
    dev.mkdir()
    (dev / "infiniband").symlink_to(outside)  # planted: must not be followed
    tree = build_tree(node)
    with pytest.raises(SandboxError, match="infiniband"):
        create_device_nodes(tree, dev)
    assert os.listdir(outside) == []
    (dev / "infiniband").unlink()
    os.mknod(dev / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # "the host's own"
    made = create_device_nodes(tree, dev)
    assert "null" not in made
    assert "nvidia0" in made
    assert (dev / "nvidia0").is_char_device()
    # every node is the stand-in character device, the NVMe namespace's block node too
    assert "nvme0n1" in made
    disk = (dev / "nvme0n1").lstat()
    assert stat.S_ISCHR(disk.st_mode)
    assert disk.st_rdev == os.makedev(1, 3)
    remove_device_nodes(made, dev)
    assert (dev / "null").is_char_device()
    assert not (dev / "nvidia0").exists()
    assert not (dev / "nvme0n1").exists()


def test_device_dir_keeps_a_node_of_ours_and_refuses_any_other(
        tmp_path: Path, node: NodeSpec) -> None:
    """A node already there as we would make it (a kind node's own /dev/full) is kept and
    not removed; one of the same name but another number is refused, and what the run had
    made is removed again."""
    if os.geteuid() != 0:
        pytest.fail("mknod needs root: run this test as root")
    tree = build_tree(node)
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "nvme0n1", stat.S_IFBLK | 0o660, os.makedev(259, 0))  # a real disk's
    with pytest.raises(SandboxError, match="nvme0n1: exists and is not the device"):
        create_device_nodes(tree, dev)
    assert sorted(os.listdir(dev)) == ["nvme0n1"]  # what it had made is removed again
    (dev / "nvme0n1").unlink()
    os.mknod(dev / "full", stat.S_IFCHR | 0o666, os.makedev(1, 7))  # the node's own
    made = create_device_nodes(tree, dev)
    assert "full" not in made
    zero = (dev / "zero").lstat()
    assert (os.major(zero.st_rdev), os.minor(zero.st_rdev)) == (1, 5)
    remove_device_nodes(made, dev)
    assert os.listdir(dev) == ["full"]


def test_cli_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "root"
    assert main(["render", str(DEMO), "--node", "gpu-worker", "--out", str(out)]) == 0
    assert "rendered node gpu-worker" in capsys.readouterr().out
    assert (out / "sys/devices/system/node/node1/meminfo").is_file()
    assert (out / "proc/cpuinfo").is_file()


def test_cli_render_unknown_node_lists_the_nodes(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    profile = REPO / "profiles" / "workshop-mixed.yaml"
    code = main(["render", str(profile), "--node", "nope", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 1
    assert "error: no node nope" in err
    assert "control-plane, gpu-worker-0, gpu-worker-1, net-worker" in err
    code = main(["render", str(profile), "--out", str(tmp_path / "x")])
    assert code == 1
    assert "pick one with --node" in capsys.readouterr().err
    code = main(["render", str(profile), "--node", "gpu-worker", "--index", "1",
                 "--out", str(tmp_path / "y")])
    assert code == 0

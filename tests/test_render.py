"""``render`` and ``sandbox render``: what lands on disk, and where it refuses to write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sandbox.cli import main
from sandbox.errors import RenderError
from sandbox.fakehw.build import build_tree
from sandbox.fakehw.render import DEVICES_LIST, MARKER, render
from sandbox.fakehw.tree import CharDevice, DeviceState, Dir, File, Symlink, Tree
from sandbox.profile import load_profile
from sandbox.profile.resolve import NodeSpec

REPO = Path(__file__).resolve().parent.parent
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
            else:
                out[rel] = ("file", p.read_bytes())
    return out


def test_render_writes_the_tree_with_placeholders(tmp_path: Path, node: NodeSpec) -> None:
    tree = build_tree(node)
    stats = render(tree, tmp_path / "root")
    root = tmp_path / "root"
    assert not stats.mknod
    listed = (root / DEVICES_LIST).read_text().splitlines()
    devices = {p: e for p, e in tree.walk() if isinstance(e, CharDevice)}
    assert len(listed) == len(devices) == stats.devices
    for line in listed:
        name, kind, major, minor = line.split()
        dev = devices[f"dev/{name}"]
        assert kind == "c"
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


def test_mknod_makes_real_character_devices(tmp_path: Path, node: NodeSpec) -> None:
    if os.geteuid() != 0:
        pytest.fail("mknod needs root: run this test as root")
    tree = build_tree(node)
    stats = render(tree, tmp_path / "root", mknod=True)
    assert stats.mknod
    assert not (tmp_path / "root" / DEVICES_LIST).exists()
    for path, entry in tree.walk():
        if isinstance(entry, CharDevice):
            st = (tmp_path / "root" / path).lstat()
            assert stat.S_ISCHR(st.st_mode)
            assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (entry.major, entry.minor)


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
    with pytest.raises(RenderError, match="--force"):
        render(build_tree(node), out)
    render(build_tree(node), out, force=True)
    assert (out / "keep.txt").read_text() == "user data\n"  # not ours: left alone
    assert (out / MARKER).exists()
    gpu = node.devices[0]
    render(build_tree(node, {gpu.id: DeviceState(plugged=False)}), out, force=True)
    assert not (out / "sys/bus/pci/devices" / gpu.address).exists()
    assert not (out / "keep.txt").exists()  # the marker says the whole dir is ours


def test_force_does_not_follow_planted_symlinks(tmp_path: Path, node: NodeSpec) -> None:
    out = tmp_path / "root"
    victim = tmp_path / "victim"
    victim.mkdir()
    out.mkdir()
    (out / "proc").symlink_to(victim)
    render(build_tree(node), out, force=True)
    assert os.listdir(victim) == []
    assert (out / "proc").is_dir()
    assert not (out / "proc").is_symlink()


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

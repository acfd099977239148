"""``sandbox capture --root DIR`` on a hostile tree (issue 21 items 3 and 4).

A root someone else wrote may hold symlinks that point out of it (absolute, or ``../``
past its top), FIFOs where sysfs files belong, oversized files, and names carrying
newlines or U+2028 meant to break out of the header comment. Capture must read the tree
as a chroot would see it, never hang, and always write a profile that validates.
Real files in ``tmp_path``; nothing of ours is mocked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sandbox.capture import capture
from sandbox.profile import load_profile_text

CPU = "sys/devices/system/cpu"
DMI = "sys/devices/virtual/dmi/id"
PCI = "sys/bus/pci/devices"
HOSTNAME = "proc/sys/kernel/hostname"
SECRET = "CANARY-SECRET"
ADDRESS = "0000:3b:00.0"
DEVICE = f"sys/devices/pci0000:3a/{ADDRESS}"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _machine(root: Path) -> None:
    """The smallest root capture accepts: 2 CPUs, cpuinfo, meminfo, a DMI identity and one
    generic PCI function (reached, as on real sysfs, through a relative bus link)."""
    for c in range(2):
        topo = root / CPU / f"cpu{c}" / "topology"
        for name, value in {"physical_package_id": "0", "core_id": str(c),
                            "thread_siblings_list": str(c)}.items():
            _write(topo / name, value + "\n")
    _write(root / CPU / "online", "0-1\n")
    _write(root / "proc" / "cpuinfo", "processor\t: 0\nvendor_id\t: GenuineIntel\n"
                                      "model name\t: Some CPU\ncpu MHz\t\t: 2000.0\n")
    _write(root / "proc" / "meminfo", "MemTotal:        4096 kB\n")
    for name, value in {"sys_vendor": "Acme", "product_name": "Box 1",
                        "board_vendor": "Acme"}.items():
        _write(root / DMI / name, value + "\n")
    for name, value in {"vendor": "0x1234", "device": "0x5678", "class": "0x088000",
                        "numa_node": "0"}.items():
        _write(root / DEVICE / name, value + "\n")
    (root / PCI).mkdir(parents=True)
    os.symlink(f"../../../devices/pci0000:3a/{ADDRESS}", root / PCI / ADDRESS)


def _link(root: Path, rel: str, target: str) -> None:
    """Replace ``rel`` below ``root`` with a symlink to ``target``."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    os.symlink(target, path)


def _escape(rel: str, canary: Path) -> str:
    """A relative target that climbs from ``rel``'s directory past the root to ``canary``
    (which sits next to the root): one ``..`` per directory level, plus one more."""
    depth = rel.count("/") + 1
    return "../" * depth + canary.name


def _header(text: str) -> list[str]:
    lines = text.splitlines()
    return lines[:next(i for i, ln in enumerate(lines) if not ln.startswith("#"))]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "canary").write_text(SECRET + "\n")
    (tmp_path / "canary").chmod(0o600)
    machine = tmp_path / "root"
    _machine(machine)
    return machine


@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
@pytest.mark.parametrize("rel", [f"{DMI}/product_name", f"{DMI}/sys_vendor", HOSTNAME,
                                 "etc/hostname", f"{DEVICE}/driver"])
def test_links_out_of_the_root_are_not_followed(root: Path, kind: str, rel: str) -> None:
    """A link out of the root resolves inside it, as in a chroot: the canary next to the
    root is never read (here the in-root path it names does not exist)."""
    canary = root.parent / "canary"
    _link(root, rel, str(canary) if kind == "absolute" else _escape(rel, canary))
    result = capture(root)
    assert SECRET not in result.text
    assert SECRET not in repr(result.profile)


def test_a_directory_link_out_of_the_root_is_not_followed(root: Path) -> None:
    """A directory linked out of the root (here the whole DMI directory) is looked up in
    the root, where the absolute target does not exist."""
    _write(root.parent / "id" / "product_name", SECRET + "\n")  # <outside>/id/product_name
    _link(root, "sys/devices/virtual/dmi", str(root.parent))
    result = capture(root)
    assert SECRET not in result.text


def test_an_absolute_link_resolves_against_the_root(root: Path) -> None:
    """An absolute link means the same path below the root, as a chroot sees it."""
    _write(root / "etc" / "product", "Inside Box\n")
    _link(root, f"{DMI}/product_name", "/etc/product")
    assert capture(root).profile["nodes"][0]["system"]["product"] == "Inside Box"


def test_a_relative_link_inside_the_root_still_works(root: Path) -> None:
    """Real sysfs is full of ``../../devices/...`` links; those inside the root work."""
    _write(root / "sys" / "firmware" / "name", "Relative Box\n")
    _link(root, f"{DMI}/product_name", "../../../../firmware/name")
    result = capture(root)
    assert result.profile["nodes"][0]["system"]["product"] == "Relative Box"
    assert [d["vendorId"] for d in result.profile["nodes"][0]["devices"]] == [0x1234]


@pytest.mark.parametrize("rel", [f"{DMI}/product_name", HOSTNAME, "proc/meminfo"])
def test_a_fifo_does_not_hang_capture(root: Path, tmp_path: Path, rel: str) -> None:
    """A FIFO where a file belongs is treated as missing (opening one for a blocking read
    would wait for a writer forever)."""
    (root / rel).unlink(missing_ok=True)
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(root / rel)
    out = tmp_path / "out.yaml"
    done = subprocess.run([sys.executable, "-m", "sandbox", "capture", "--root", str(root),
                           "-o", str(out)], capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0, done.stderr
    load_profile_text(out.read_text(), str(out))


def test_an_oversized_file_is_treated_as_missing(root: Path) -> None:
    """Reads are bounded: a file past the limit is not taken in part."""
    _write(root / DMI / "product_name", "X" * (1 << 17) + "\n")
    result = capture(root)
    assert "product" not in result.profile["nodes"][0]["system"]


@pytest.mark.parametrize("host", [
    "evil\n%YAML 1.2\n---\nfoo: bar",
    "evil\u2028foo: bar\u2029%YAML 1.2",
    "evil\r\x85---\x1b[31m",
    "h" * 2001,
])
def test_a_hostile_hostname_gives_one_comment_block(root: Path, host: str) -> None:
    """The hostname goes into the header, description and names cleaned: the header stays
    one comment block, the document validates and has only its own keys."""
    _write(root / HOSTNAME, host + "\n")
    result = capture(root)
    load_profile_text(result.text, "<hostile>")
    header = _header(result.text)
    assert header[0].startswith("# Hardware profile captured")
    assert all(ln.startswith("#") for ln in header)
    assert not any(ch in result.text for ch in "\r\x85\u2028\u2029\x1b")
    assert not any(ln.startswith(("%", "---", "foo")) for ln in result.text.splitlines())
    doc = yaml.safe_load(result.text)
    assert set(doc) == {"apiVersion", "kind", "metadata", "nodes"}
    assert "foo" not in doc["metadata"]
    assert "foo" not in doc["nodes"][0]
    assert len(doc["metadata"]["description"]) <= 256
    assert all(len(ln) <= 200 for ln in header)


def test_a_hostile_driver_link_and_root_path(tmp_path: Path) -> None:
    """The driver link's name and the --root path itself are cleaned the same way."""
    root = tmp_path / "odd\u2028root\nfoo: bar"
    _machine(root)
    _link(root, f"{DEVICE}/driver", "../../../bus/pci/drivers/evil\u2028x: y\n%YAML 1.2")
    result = capture(root)
    load_profile_text(result.text, "<hostile>")
    assert all(ln.startswith("#") for ln in _header(result.text))
    assert not any(ch in result.text for ch in "\u2028\u2029")
    assert set(yaml.safe_load(result.text)) == {"apiVersion", "kind", "metadata", "nodes"}

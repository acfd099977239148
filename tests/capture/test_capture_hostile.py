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
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sandbox.capture import CaptureError, capture, write_capture
from sandbox.profile import catalogue, load_profile_text
from tests.support.hostile_roots import Watch

pytestmark = [pytest.mark.root]

CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"
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


# What the capture fuzz (tests/capture/test_capture_fuzz.py) found, one test each.


def test_a_fifo_or_device_node_is_never_opened(root: Path) -> None:
    """Capture checks what a path is (O_PATH) before it opens it: a FIFO or device node
    where a file belongs is never opened, not even O_NONBLOCK (that lets a FIFO's waiting
    writer go on, and runs a device's driver). inotify sees every open of them."""
    watch = Watch()
    made = []
    for rel in (f"{DMI}/product_name", f"{DEVICE}/class", "proc/meminfo"):
        (root / rel).unlink()
        os.mkfifo(root / rel)
        made.append(root / rel)
    (root / DMI / "sys_vendor").unlink()
    try:  # /dev/null's numbers: harmless, were it opened
        os.mknod(root / DMI / "sys_vendor", 0o644 | stat.S_IFCHR, os.makedev(1, 3))
        made.append(root / DMI / "sys_vendor")
    except PermissionError:
        pass  # no CAP_MKNOD here: the FIFOs still show it
    for path in made:
        watch.add(path)
    watch.proven(made[0])
    try:
        result = capture(root)
        opened = watch.events()
    finally:
        watch.close()
    assert opened == []
    load_profile_text(result.text, "<hostile>")


def test_numa_cpulists_that_are_not_a_partition_are_made_one(root: Path) -> None:
    """CPU 0 listed by two NUMA nodes, CPU 1 by none: a profile gives every CPU exactly
    one node, so CPU 0 stays in node 0, CPU 1 goes there, and the header says both."""
    for n in range(2):
        _write(root / NODE / f"node{n}" / "cpulist", "0\n")
        _write(root / NODE / f"node{n}" / "meminfo", f"Node {n} MemTotal: 4096 kB\n")
    result = capture(root)
    load_profile_text(result.text, "<hostile>")
    assert [n["cpus"] for n in result.profile["nodes"][0]["numa"]["nodes"]] == ["0-1", ""]
    assert any("CPUs 0 are in more than one NUMA node" in n for n in result.left_out)
    assert any("CPUs 1 are in no NUMA node" in n for n in result.left_out)


def test_hugepages_past_the_node_memory_are_left_out_and_said(root: Path) -> None:
    _write(root / NODE / "node0" / "cpulist", "0-1\n")
    _write(root / NODE / "node0" / "meminfo", "Node 0 MemTotal: 4096 kB\n")
    _write(root / NODE / "node0/hugepages/hugepages-2048kB/nr_hugepages", "16\n")
    result = capture(root)
    load_profile_text(result.text, "<hostile>")
    assert "hugepages" not in result.profile["nodes"][0]["numa"]["nodes"][0]
    assert any("hugepages (16 x 2Mi) more than its memory" in n for n in result.left_out)


@pytest.mark.parametrize(("rel", "text"), [
    (f"{DEVICE}/vendor", "0x1ffff"), (f"{DEVICE}/device", "-0x1"),
    (f"{DEVICE}/class", "0x1ffffff"), (f"{DEVICE}/vendor", "0x١٢٣٤"),
])
def test_a_pci_id_out_of_range_is_no_function(root: Path, rel: str, text: str) -> None:
    """An id a PCI function cannot have is no id: the function is not read, and said."""
    _write(root / rel, text + "\n")
    result = capture(root)
    load_profile_text(result.text, "<hostile>")
    assert result.profile["nodes"][0]["devices"] == []
    assert any(f"without readable vendor, device and class ids (not read): {ADDRESS}" in n
               for n in result.left_out)


@pytest.mark.parametrize(("rel", "text"), [
    ("proc/cpuinfo", "processor\t: 0\ncpu family\t: -1\nmodel\t\t: -7\ncpu MHz\t\t: inf\n"),
    ("proc/cpuinfo", "processor\t: 0\ncpu MHz\t\t: 1e999\nmodel\t\t: 0x" + "f" * 5000 + "\n"),
    ("proc/meminfo", "MemTotal: ² kB\nSwapTotal: ² kB\n"),  # isdigit() says yes, int() no
    (f"{DEVICE}/aer_dev_fatal", "TOTAL_ERR_FATAL ²\n"),
    (f"{CPU}/online", "0-65535," * 8000),  # 64 KiB naming 500 million CPUs
])
def test_numbers_python_parses_but_sysfs_never_writes(root: Path, rel: str, text: str) -> None:
    _write(root / rel, text)
    result = capture(root)
    load_profile_text(result.text, "<hostile>")


def test_a_negative_vf_count(root: Path) -> None:
    nic = catalogue.NICS["mellanox"]["connectx-6"]
    for name, value in {"vendor": f"0x{nic.vendor_id:04x}", "device": f"0x{nic.device_id:04x}",
                        "class": f"0x{nic.class_code:06x}", "sriov_totalvfs": "8",
                        "sriov_numvfs": "-5"}.items():
        _write(root / DEVICE / name, value + "\n")
    result = capture(root)
    load_profile_text(result.text, "<hostile>")
    assert result.profile["nodes"][0]["devices"][0]["sriov"] == {"totalVFs": 8, "numVFs": 0}


def test_a_cpu_listed_again_is_one_sibling(root: Path) -> None:
    """thread_siblings_list names CPUs: 0 listed 12 times is one thread (not 12, which a
    profile cannot hold, nor 8)."""
    _write(root / CPU / "cpu0/topology/thread_siblings_list", "0,0,0,0,0,0,0,0,0,0,0,0\n")
    result = capture(root)
    load_profile_text(result.text, "<hostile>")
    assert result.profile["nodes"][0]["cpu"]["threadsPerCore"] == 1


def test_an_iommu_group_named_by_a_superscript(root: Path) -> None:
    _link(root, f"{DEVICE}/iommu_group", "../../../kernel/iommu_groups/²")
    load_profile_text(capture(root).text, "<hostile>")


@pytest.mark.parametrize("host", ["12", "yes", "null", "0x1f"])
def test_a_hostname_yaml_reads_as_another_type(root: Path, host: str) -> None:
    """The profile's names are strings, whatever YAML would make of them unquoted."""
    _write(root / HOSTNAME, host + "\n")
    result = capture(root)
    load_profile_text(result.text, "<hostile>")
    assert result.profile["metadata"]["name"] == host
    assert yaml.safe_load(result.text)["nodes"][0]["name"] == host


def test_names_that_are_not_utf8(tmp_path: Path) -> None:
    """A root path and a driver name that are not UTF-8 (os.fsdecode gives lone
    surrogates, which UTF-8 cannot encode): the profile is still text, and written."""
    root = tmp_path / os.fsdecode(b"root\xff\xfe")
    _machine(root)
    os.symlink(b"../../../bus/pci/drivers/\xff\xfe", os.fsencode(root / DEVICE / "driver"))
    result = capture(root)
    load_profile_text(result.text, "<hostile>")
    write_capture(result, tmp_path / "out.yaml")
    assert (tmp_path / "out.yaml").read_bytes() == result.text.encode()


def test_more_memory_than_a_profile_holds_is_a_located_error(root: Path) -> None:
    _write(root / "proc" / "meminfo", "MemTotal: 1125899906842624 kB\n")
    with pytest.raises(CaptureError) as err:
        capture(root)
    assert str(err.value) == (f"{root}: proc/meminfo: MemTotal 1125899906842624 kB; a "
                              "profile holds at most 1024Ti there")


def test_an_error_names_a_root_with_a_newline_on_one_line(tmp_path: Path) -> None:
    root = tmp_path / "odd\nroot\u2028x"
    root.mkdir()
    with pytest.raises(CaptureError) as err:
        capture(root)
    assert str(err.value).startswith(f"{tmp_path}/odd\\nroot\\u2028x: not a machine root")
    assert len(str(err.value).splitlines()) == 1

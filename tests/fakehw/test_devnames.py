"""The loader checks generic devNodes against what the emulated drivers own
(``sandbox.profile.devnames``), without building a tree. That table must cover
everything the builder makes: every /dev node of a device, every sysfs class and every
entry of a PCI function's directory in the trees of the shipped and test profiles belongs
to a driver on that node (or to the node's own generic devNodes). Then the checks
themselves, one refusal at a time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sandbox.errors import ProfileError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.tree import BlockDevice, CharDevice, Dir, File
from sandbox.profile import load_profile, load_profile_text
from sandbox.profile.devnames import (
    class_owner,
    name_owner,
    node_class,
    number_owner,
    owners,
)
from tests.support.paths import REPO

PROFILES = sorted((REPO / "profiles").glob("*.yaml")) + sorted(
    (REPO / "tests/data").glob("*.yaml"))
BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_the_table_covers_every_tree_the_builder_makes(path: Path) -> None:
    for node in load_profile(path).cluster.nodes:
        drivers = owners(node)
        tree = build_tree(node)
        generic = {n.name for d in node.devices if d.generic for n in d.generic.dev_nodes}
        generic_classes = {node_class(n)[0] for n in generic}
        for p, entry in tree.walk():
            if not p.startswith("dev/") or p[4:] in generic:
                continue
            if isinstance(entry, (CharDevice, BlockDevice)):
                assert name_owner(p[4:], drivers), f"{node.name}: {p} has no owner"
            if isinstance(entry, CharDevice):
                assert number_owner(entry.major, entry.minor, drivers), \
                    f"{node.name}: {p} {entry.major}:{entry.minor} has no owner"
        classes = tree.get("sys/class")
        assert isinstance(classes, Dir)
        for cls in classes.children:
            assert cls in generic_classes or class_owner(cls, drivers), \
                f"{node.name}: sys/class/{cls} has no owner"
        for p, entry in tree.walk():
            if p.startswith("sys/devices/pci") and BDF.match(p.rsplit("/", 1)[-1]) \
                    and isinstance(entry, Dir):
                for name in entry.children:
                    assert BDF.match(name) or name in generic_classes \
                        or class_owner(name, drivers), f"{node.name}: {p}/{name}"


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_proc_devices_lists_every_major_the_tree_uses(path: Path) -> None:
    """/proc/devices (fs/char_dev.c's chrdev_show, block/genhd.c's blkdev_show): every char
    and block major of the tree's /dev under its section, sorted, ``%3d name``."""
    for node in load_profile(path).cluster.nodes:
        tree = build_tree(node)
        entry = tree.get("proc/devices")
        assert isinstance(entry, File), node.name
        text = entry.data.decode()
        chars, _, blocks = text.partition("\n\nBlock devices:\n")
        assert chars.startswith("Character devices:\n"), text
        assert text.endswith("\n"), text
        listed = {section: [(int(line[:3]), line[4:]) for line in body.splitlines()[1:]
                            if line] for section, body in (("c", chars), ("b", "x\n" + blocks))}
        for lines in listed.values():
            assert [m for m, _ in lines] == sorted(m for m, _ in lines), text
            assert all(re.fullmatch(r"[ \d]{2}\d [^\s].*", f"{m:3d} {n}") for m, n in lines)
        for p, dev in tree.walk():
            if isinstance(dev, CharDevice):
                assert dev.major in {m for m, _ in listed["c"]}, f"{node.name}: {p}\n{text}"
            elif isinstance(dev, BlockDevice):
                assert dev.major in {m for m, _ in listed["b"]}, f"{node.name}: {p}\n{text}"


NODE = """apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {{name: t}}
nodes:
  - name: n
    devices:
{devices}
      - type: generic
        vendorId: 0x8086
        deviceId: 0x1
        classCode: 0x120000
        devNodes:
{nodes}
"""


def problems(devices: list[str], nodes: list[str]) -> list[str]:
    """The field path and message of each problem (where in the file is tested with the
    other invalid fixtures); the generic device's index reads ``G``."""
    text = NODE.format(devices="\n".join(f"      - {d}" for d in devices),
                       nodes="\n".join(f"          - {n}" for n in nodes))
    try:
        load_profile_text(text, "t.yaml")
    except ProfileError as exc:
        found = exc.problems
    else:
        return []
    assert all(p.line > 1 and p.column > 1 for p in found)
    return [str(p).split(": ", 1)[1].replace(f"devices[{len(devices)}]", "devices[G]")
            for p in found]


GPU = "{type: gpu, vendor: nvidia, model: t4}"
FPGA = "{type: fpga, vendor: intel, model: pac-n3000}"


@pytest.mark.parametrize(("devices", "nodes", "expected"), [
    ([GPU], ["{name: nvidia1, major: 240, minor: 0}"],
     ["nodes[0].devices[G].devNodes[0].name: /dev/nvidia1 is a node of the "
      "nvidia driver"]),
    ([GPU], ["{name: x, major: 195, minor: 7}"],
     ["nodes[0].devices[G].devNodes[0].major: char major 195 belongs to the "
      "nvidia driver"]),
    ([], ["{name: x, major: 1, minor: 42}"],
     ["nodes[0].devices[G].devNodes[0].major: char major 1 belongs to the mem "
      "driver"]),
    ([], ["{name: x, major: 10, minor: 196}"],
     ["nodes[0].devices[G].devNodes[0].minor: char 10:196 is the vfio "
      "driver's"]),
    ([], ["{name: net/tun, major: 10, minor: 200}"],
     ["nodes[0].devices[G].devNodes[0].name: /dev/net/tun: sysfs class 'net' "
      "belongs to the kernel"]),
    ([], ["{name: driver/x, major: 500, minor: 0}"],
     ["nodes[0].devices[G].devNodes[0].name: /dev/driver/x: its class "
      "directory 'driver' would be the PCI function's own 'driver' entry"]),
    ([], ["{name: a, major: 500, minor: 0}", "{name: b, major: 500, minor: 0}"],
     ["nodes[0].devices[G].devNodes[1].minor: char 500:0 is already /dev/a "
      "(one number, one node)"]),
    ([FPGA], ["{name: x, major: 240, minor: 9}"],
     ["nodes[0].devices[G].devNodes[0].major: char major 240 belongs to the "
      "dfl driver"]),
])
def test_a_devnode_taking_what_a_driver_owns_is_refused_where_it_is(
        devices: list[str], nodes: list[str], expected: list[str]) -> None:
    assert problems(devices, nodes) == expected


@pytest.mark.parametrize(("devices", "nodes"), [
    ([], ["{name: nvidia1, major: 240, minor: 0}"]),  # no NVIDIA GPU on the node
    ([], ["{name: x, major: 240, minor: 9}"]),  # no DFL FPGA: 240 is free
    ([], ["{name: qat_adf_ctl, major: 10, minor: 60}"]),  # a misc minor of its own
    ([], ["{name: accel/accel0, major: 261, minor: 0}",
          "{name: accel/accel1, major: 261, minor: 1}"]),
])
def test_a_devnode_of_its_own_is_accepted_and_builds(devices: list[str],
                                                     nodes: list[str]) -> None:
    assert problems(devices, nodes) == []

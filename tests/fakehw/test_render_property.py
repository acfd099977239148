"""Property: any profile ``validate`` accepts renders (issue 21 item 5).

A profile that loads without a problem must build and render: every class device, /dev
node and bus entry the builder numbers (fpga_region, dfl-fme/port, DRM cards and render
nodes, netdevs, RDMA devices, NVMe controllers and namespaces, vfio groups ...) unique
over every device entry and every vendor of the node. The profiles are generated from
the catalogue: several entries per node, mixed vendors, each kind of device, counts,
SR-IOV, NUMA placement, switches, host bridges, given PCI addresses, NVIDIA DRM,
RDMA/InfiniBand, NVMe namespaces, generic devNodes. Each that loads is built and
rendered with the real renderer (no FUSE) into a scratch directory, on tmpfs where there
is one (a render is file creation: twenty times faster there than on a busy disk); one
that does not must say where (``file:line:col``). Generic devNodes that take another
device's node are refused by the loader (``devnames``), so no accepted profile
may fail to build.
``HWSANDBOX_RENDER_EXAMPLES`` sets the number of examples (default 120).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sandbox.errors import ProfileError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.fakehw.tree import CharDevice, Dir, Symlink, Tree
from sandbox.profile import catalogue, load_profile_text
from sandbox.profile.spec import NodeSpec
from tests.support.fuzz_inputs import unlocated

pytestmark = pytest.mark.cpu_bound  # scripts/test runs these beside the e2e envs

ITEM5 = """apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata:
  name: fpga-mixed
nodes:
  - name: w
    devices:
      - {type: fpga, vendor: intel, model: pac-n3000, count: 2}
      - {type: fpga, vendor: xilinx, model: alveo-u250}
      - {type: fpga, vendor: intel, model: pac-n3000, count: 2}
"""


def _names(tree: Tree, path: str) -> list[str]:
    d = tree.get(path)
    return sorted(d.children) if isinstance(d, Dir) else []


def test_item5_dfl_fpgas_around_a_xilinx_one_render(tmp_path: Path) -> None:
    """Two Intel DFL cards, a Xilinx one, two more Intel ones: validated, and then render
    failed with ``sys/class/fpga_region/region4: already exists`` (the cards' regions
    were numbered over every FPGA, the FMEs' PR regions after the DFL cards only)."""
    node = load_profile_text(ITEM5, "item5.yaml").cluster.nodes[0]
    tree = build_tree(node)
    render(tree, tmp_path / "root")
    dfl = [d for d in node.devices if d.fpga is not None and d.fpga.flavor == "dfl"]
    assert len(dfl) == 4
    # The kernel numbers each id space over the devices that have one (one IDA each):
    # dfl-fme.0-3, dfl-port.0-3, fpga_region0-7 (the cards' and their FMEs' PR regions).
    assert _names(tree, "sys/class/fpga_region") == sorted(f"region{i}" for i in range(8))
    fmes = [n for n in _names(tree, "sys/bus/platform/devices") if n.startswith("dfl-fme.")]
    ports = [n for n in _names(tree, "sys/bus/platform/devices") if n.startswith("dfl-port.")]
    assert fmes == [f"dfl-fme.{i}" for i in range(4)]
    assert ports == [f"dfl-port.{i}" for i in range(4)]
    root = tmp_path / "root"
    for d in dfl:
        assert d.fpga is not None
        fme = f"sys/class/fpga_region/region{d.fpga.region}/dfl-fme.{d.fpga.region}"
        assert (root / fme / "ports_num").read_text() == f"{d.fpga.ports}\n"
        assert (root / fme / "bitstream_id").read_text() == f"{d.fpga.bitstream_id}\n"
        assert (root / "sys/bus/pci/devices" / d.address / "fpga_region").is_dir()
        pr = f"{fme}/dfl-fme-region.{d.fpga.region}/fpga_region/region{4 + d.fpga.region}"
        assert (root / pr / "compat_id").is_file()  # the FME's PR region, after the cards'
        assert (root / f"sys/class/fpga_region/region{4 + d.fpga.region}").resolve() == \
            (root / pr).resolve()
        assert isinstance(tree.get(f"dev/dfl-fme.{d.fpga.region}"), CharDevice)
    xilinx = [d for d in node.devices if d.vendor == "xilinx"]
    assert len(xilinx) == 1
    assert xilinx[0].fpga is not None
    assert (xilinx[0].fpga.region, xilinx[0].fpga.first_port) == (-1, -1)  # numbered nowhere
    assert (root / "sys/bus/pci/devices" / xilinx[0].address / "vendor").read_text() == \
        "0x10ee\n"
    assert not (root / "sys/bus/pci/devices" / xilinx[0].address / "fpga_region").exists()
    for p in ("sys/class/fpga_region", "sys/bus/platform/devices"):
        for name in _names(tree, p):
            assert isinstance(tree.get(f"{p}/{name}"), Symlink)


def _one_of_catalogue(table: dict[str, dict[str, Any]]) -> st.SearchStrategy[tuple[str, str]]:
    """A vendor, then one of its models: every vendor as likely as any other."""
    return st.sampled_from(sorted(table)).flatmap(
        lambda v: st.tuples(st.just(v), st.sampled_from(sorted(table[v]))))


NAMES = st.sampled_from([None, None, None, "gpu", "nic", "fpga", "nvme", "acc", "dev"])


@st.composite
def _base(draw: st.DrawFn, kind: str, numa: int, switches: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": kind}
    if draw(st.booleans()):
        out["count"] = draw(st.integers(1, 3) | st.integers(1, 12))
    if numa > 1 or draw(st.booleans()):
        out["numaNode"] = draw(st.integers(0, numa - 1))
    name = draw(NAMES)
    if name is not None:
        out["name"] = name
    if switches and draw(st.booleans()):
        out["switch"] = draw(st.sampled_from(switches))
    if draw(st.integers(0, 5)) == 0:  # given addresses: behind bridges of their own
        bus = draw(st.integers(0x10, 0xFE))
        domain = draw(st.sampled_from([0, 0, 1]))
        out["pciAddresses"] = [f"{domain:04x}:{bus + k:02x}:00.0"
                               for k in range(out.get("count", 1))]
    if draw(st.integers(0, 7)) == 0:
        out["health"] = "unhealthy"
        out["healthReason"] = draw(st.sampled_from(["aer-fatal", "link-down", "port-down",
                                                    "removed"]))
    return out


@st.composite
def gpus(draw: st.DrawFn, numa: int, switches: list[str]) -> dict[str, Any]:
    out = draw(_base("gpu", numa, switches))
    vendor, name = draw(_one_of_catalogue(catalogue.GPUS))
    out.update(vendor=vendor, model=name)
    entry = catalogue.GPUS[vendor][name]
    if vendor == "nvidia" and draw(st.booleans()):
        out["drm"] = True
    if entry.max_vfs and draw(st.booleans()):
        total = draw(st.integers(1, 8) | st.integers(1, entry.max_vfs))
        out["sriov"] = {"totalVFs": total, "numVFs": draw(st.integers(0, total))}
    if entry.memory_slices and draw(st.integers(0, 3)) == 0:
        out["partitions"] = {"profiles": [
            {"name": "1g.small", "memorySlices": 1, "computeSlices": 1},
            {"name": "all", "memorySlices": entry.memory_slices,
             "computeSlices": entry.compute_slices}]}
    return out


@st.composite
def nics(draw: st.DrawFn, numa: int, switches: list[str]) -> dict[str, Any]:
    out = draw(_base("nic", numa, switches))
    vendor, name = draw(_one_of_catalogue(catalogue.NICS))
    out.update(vendor=vendor, model=name)
    entry = catalogue.NICS[vendor][name]
    if draw(st.booleans()):
        out["ports"] = draw(st.integers(1, 4))
    if vendor == "mellanox" and draw(st.integers(0, 2)) == 0:
        out["linkLayer"] = "infiniband"
    if draw(st.integers(0, 3)) == 0:
        out["rdma"] = draw(st.booleans())
    if entry.max_vfs and draw(st.booleans()):
        total = draw(st.integers(1, 8) | st.integers(1, entry.max_vfs))
        out["sriov"] = {"totalVFs": total, "numVFs": draw(st.integers(0, total))}
    return out


@st.composite
def fpgas(draw: st.DrawFn, numa: int, switches: list[str]) -> dict[str, Any]:
    out = draw(_base("fpga", numa, switches))
    vendor, name = draw(_one_of_catalogue(catalogue.FPGAS))
    out.update(vendor=vendor, model=name)
    if draw(st.booleans()):
        ports = draw(st.integers(1, 8))
        out["ports"] = ports
        if draw(st.booleans()):
            out["afuIds"] = [f"{k:032x}" for k in range(ports)]
    return out


@st.composite
def nvmes(draw: st.DrawFn, numa: int, switches: list[str]) -> dict[str, Any]:
    out = draw(_base("nvme", numa, switches))
    vendor, name = draw(_one_of_catalogue(catalogue.NVMES))
    out.update(vendor=vendor, model=name)
    if draw(st.booleans()):
        out["namespaces"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        out["lbaSize"] = draw(st.sampled_from([512, 4096]))
    return out


@st.composite
def generics(draw: st.DrawFn, numa: int, switches: list[str]) -> dict[str, Any]:
    out = draw(_base("generic", numa, switches))
    out.update(vendorId=draw(st.sampled_from(["0x8086", "0x1d0f", "0x1ded"])),
               deviceId=draw(st.sampled_from(["0x4940", "0x7064", "0x1"])),
               classCode=draw(st.sampled_from(["0x120000", "0x0b4000", "0x088000"])))
    if draw(st.booleans()):
        out["driver"] = draw(st.sampled_from(["4xxx", "habanalabs", "vfio-pci", "qat"]))
    nodes = draw(st.lists(st.sampled_from([
        {"name": "accel/accel{i}", "major": 261, "minor": 0},
        {"name": "qat_adf_ctl", "major": 10, "minor": 60},
        {"name": "hl{i}", "major": 508, "minor": 0},
        {"name": "dri/card{i}", "major": 226, "minor": 0},
        {"name": "infiniband/uverbs{i}", "major": 231, "minor": 192},
        {"name": "nvme{i}", "major": 240, "minor": 0},
    ]), max_size=2, unique_by=lambda n: n["name"]))
    if nodes:
        out["devNodes"] = nodes
    return out


@st.composite
def profiles(draw: st.DrawFn) -> str:
    """A profile of 1-2 nodes, each with 1-6 device entries of any kind and vendor."""
    nodes = []
    for k in range(draw(st.integers(1, 2))):
        sockets = draw(st.integers(1, 2))
        switches = draw(st.lists(st.sampled_from(["sw0", "sw1"]), max_size=2, unique=True))
        # A few kinds per node (often one), so entries of one kind from several vendors
        # sit next to each other: where one id space spans vendors and entries.
        chosen = draw(st.lists(st.sampled_from([fpgas, gpus, nics, nvmes, generics]),
                               min_size=1, max_size=5, unique=True))
        kinds = st.one_of(*(kind(sockets, switches) for kind in chosen))
        node: dict[str, Any] = {"name": f"n{k}", "cpu": {"sockets": sockets,
                                                           "coresPerSocket": 2}}
        if draw(st.integers(0, 4)) == 0:
            node["count"] = 2
        pci: dict[str, Any] = {}
        if switches:
            pci["switches"] = [{"name": s, "numaNode": draw(st.integers(0, sockets - 1))}
                               for s in switches]
        if draw(st.integers(0, 4)) == 0:
            pci["hostBridges"] = [{"domain": draw(st.sampled_from([0, 1])) if s else 0,
                                   "bus": draw(st.integers(0, 0xF0)), "numaNode": s}
                                  for s in range(sockets)]
        if pci:
            node["pci"] = pci
        node["devices"] = draw(st.lists(kinds, min_size=1, max_size=6))
        nodes.append(node)
    doc = {"apiVersion": "hwsandbox.dev/v1alpha1", "kind": "HardwareProfile",
           "metadata": {"name": "prop"}, "nodes": nodes}
    return yaml.safe_dump(doc, sort_keys=False)


def _check_tree(tree: Tree) -> None:
    """What the kernel never shows: one device number on two /dev nodes (the numbers a
    profile gives its generic devices aside: they are the profile's own)."""
    chosen = {n for r in tree.devices.values() if r.kind == "generic" for n in r.dev_nodes}
    numbers: dict[tuple[int, int], str] = {}
    for path, entry in tree.walk():
        if isinstance(entry, CharDevice) and path.startswith("dev/") and path not in chosen:
            key = (entry.major, entry.minor)
            assert key not in numbers, f"{path} and {numbers[key]} are both char {key}"
            numbers[key] = path


def _check_rendered(root: Path) -> None:
    """Every class device and bus device link of the render leads somewhere."""
    for top in ("sys/class", "sys/bus"):
        for dirpath, dirnames, filenames in os.walk(root / top):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                if p.is_symlink():
                    assert p.exists(), f"{p.relative_to(root)} -> {os.readlink(p)} dangles"


# Rendering is file creation: on tmpfs it takes a twentieth of the time a loaded disk does.
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


@settings(max_examples=int(os.environ.get("HWSANDBOX_RENDER_EXAMPLES", "120")),
          deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profiles())
def test_any_profile_validate_accepts_renders(text: str) -> None:
    try:
        cluster = load_profile_text(text, "prop.yaml").cluster
    except ProfileError as exc:  # validate refused it: nothing to render, but say where
        wrong = unlocated(exc, text, "prop.yaml")
        event("refused: " + exc.problems[0].message.split(":")[0][:50])
    else:
        wrong = None
        event("valid")
        _render_all(cluster.nodes)
    assert wrong is None, wrong


def _render_all(nodes: tuple[NodeSpec, ...]) -> None:
    out = Path(tempfile.mkdtemp(prefix="render-prop-", dir=SCRATCH))
    try:
        for node in nodes:
            tree = build_tree(node)
            _check_tree(tree)
            render(tree, out / node.name)
            _check_rendered(out / node.name)
    finally:
        shutil.rmtree(out)

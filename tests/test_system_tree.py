"""The node-wide kernel interfaces of the fake tree, read back by real programs where one
exists (lscpu, lstopo, lsmem, lspci) and otherwise checked against the formats of the
kernel's Documentation/ABI: caches per CPU model, root ports per CPU vendor, memory blocks,
bus links, /proc/swaps, DMI, cpufreq/cpuidle, IOMMU units and the loopback interface."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.fakehw.build import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import load_profile_text
from sandbox.profile.spec import NodeSpec
from tests.readers import lscpu, lspci_records

AMD_CPU = ("cpu: {sockets: 2, coresPerSocket: 24, threadsPerCore: 2, vendor: AuthenticAMD, "
           "model: AMD EPYC 9454 48-Core Processor, family: 25, modelNumber: 17}")
INTEL_CPU = "cpu: {sockets: 2, coresPerSocket: 16, threadsPerCore: 2}"


def profile(node: str, name: str = "n") -> str:
    return (
        "apiVersion: hwsandbox.dev/v1alpha1\nkind: HardwareProfile\n"
        f"metadata: {{name: t}}\nnodes:\n  - name: {name}\n"
        + "".join(f"    {line}\n" for line in node.strip().splitlines())
    )


def node_of(text: str) -> NodeSpec:
    return load_profile_text(profile(text)).cluster.nodes[0]


_rendered: dict[str, tuple[NodeSpec, Path]] = {}


def rendered(tmp_path_factory: pytest.TempPathFactory, text: str) -> tuple[NodeSpec, Path]:
    if text not in _rendered:
        node = node_of(text)
        root = tmp_path_factory.mktemp("root")
        render(build_tree(node), root, force=True)
        _rendered[text] = (node, root)
    return _rendered[text]


AMD_NODE = f"{AMD_CPU}\nmemory: 256Gi\ndevices:\n  - {{type: gpu, vendor: amd, model: mi300x}}"
INTEL_NODE = f"{INTEL_CPU}\nmemory: 32Gi\ndevices:\n  - {{type: gpu, vendor: nvidia, model: t4}}"


@pytest.fixture
def amd(tmp_path_factory: pytest.TempPathFactory) -> tuple[NodeSpec, Path]:
    return rendered(tmp_path_factory, AMD_NODE)


@pytest.fixture
def intel(tmp_path_factory: pytest.TempPathFactory) -> tuple[NodeSpec, Path]:
    return rendered(tmp_path_factory, INTEL_NODE)


# -- caches and root ports ---------------------------------------------------------------
def test_lscpu_sees_zen4_caches_l3_per_ccx(amd: tuple[NodeSpec, Path]) -> None:
    _, root = amd
    info = lscpu(root)
    assert info["L1d cache"] == "1.5 MiB (48 instances)"  # 32K x 24 cores x 2 sockets
    assert info["L1i cache"] == "1.5 MiB (48 instances)"
    assert info["L2 cache"] == "48 MiB (48 instances)"  # 1M per core
    assert info["L3 cache"] == "192 MiB (6 instances)"  # 32M per CCX of 8 cores, 3 per socket
    l3 = root / "sys/devices/system/cpu/cpu0/cache/index3"
    assert (l3 / "shared_cpu_list").read_text() == "0-7,48-55\n"
    assert (l3 / "size").read_text() == "32768K\n"
    ids = {(root / f"sys/devices/system/cpu/cpu{c}/cache/index3/id").read_text()
           for c in (0, 8, 16, 24, 40)}
    assert ids == {"0\n", "1\n", "2\n", "3\n", "5\n"}
    assert "cache size\t: 1024 KB\n" in (root / "proc/cpuinfo").read_text()  # AMD: the L2


def test_lscpu_sees_sapphire_rapids_caches_l3_per_socket(intel: tuple[NodeSpec, Path]) -> None:
    _, root = intel
    info = lscpu(root)
    assert info["L1d cache"] == "1.5 MiB (32 instances)"  # 48K per core
    assert info["L2 cache"] == "64 MiB (32 instances)"  # 2M per core
    assert info["L3 cache"] == "60 MiB (2 instances)"  # 1920K x 16 cores per socket
    assert "cache size\t: 30720 KB\n" in (root / "proc/cpuinfo").read_text()


@pytest.mark.parametrize(("which", "vendor", "device"), [("amd", "1022", "14ab"),
                                                    ("intel", "8086", "352a")])
def test_root_ports_have_the_cpu_vendors_ids(which: str, vendor: str, device: str,
                                             request: pytest.FixtureRequest) -> None:
    node, root = request.getfixturevalue(which)
    records = lspci_records(root)
    ports = [f.address for f in node.bridges if f.port_type == 4]
    assert ports
    for addr in ports:
        assert records[addr]["Vendor"].endswith(f"[{vendor}]")
        assert records[addr]["Device"].endswith(f"[{device}]")


def test_unknown_vendor_falls_back_to_intel_layout() -> None:
    node = node_of("cpu: {sockets: 1, coresPerSocket: 4, vendor: HygonGenuine}\nmemory: 8Gi")
    tree = build_tree(node)
    entry = tree.get("sys/devices/system/cpu/cpu0/cache/index0/size")
    assert entry is not None
    assert getattr(entry, "data", b"") == b"48K\n"

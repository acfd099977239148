"""The fake roots fool the real readers: hwloc, lscpu, numactl and lspci see exactly the
hardware each profile describes. Parametrized over every node of every profile in
profiles/ and tests/data/tree-*.yaml; every expected count comes from the profile."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from sandbox.fakehw.builder._gpu import drm_minors
from sandbox.profile import load_profile
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.spec import NodeSpec
from tests.support.paths import REPO
from tests.support.readers import (
    bracket_id,
    hwloc_mask,
    lscpu,
    lspci_args,
    lspci_records,
    lstopo,
    numactl_hardware,
    parents,
    run,
)

pytestmark = [pytest.mark.root]

PROFILES = sorted(REPO.glob("profiles/*.yaml")) + sorted(REPO.glob("tests/data/tree-*.yaml"))
CASES = [
    pytest.param((path, node.name), id=f"{path.stem}/{node.name}")
    for path in PROFILES
    for node in load_profile(path).cluster.nodes
]



@dataclass(frozen=True)
class Fn:
    vendor: int
    device: int
    class_code: int
    numa_node: int
    driver: str | None
    iommu_group: int
    bridge: bool = False


def expected_functions(node: NodeSpec) -> dict[str, Fn]:
    """Every PCI function the profile says is present at start, VFs included."""
    out = {b.address: Fn(b.vendor_id, b.device_id, b.class_code, b.numa_node, b.driver,
                         b.iommu_group, b in node.bridges)
           for b in node.pci if b.owner is None}  # the bridges and the root complex's 00.0
    for d in node.devices:
        if d.health == "unhealthy" and d.health_reason == "removed":
            continue
        for p, f in enumerate(d.functions):
            out[f.address] = Fn(f.vendor_id, f.device_id, f.class_code, f.numa_node, f.driver,
                                f.iommu_group)
            if d.nic is not None:
                n = d.nic
                for v in range(n.num_vfs):
                    out[n.vf_addresses[p][v]] = Fn(f.vendor_id, n.vf_device_id, f.class_code,
                                                   f.numa_node, n.vf_driver,
                                                   n.vf_iommu_groups[p][v])
            if d.gpu is not None:
                g = d.gpu
                for v in range(g.num_vfs):
                    out[g.vf_addresses[v]] = Fn(f.vendor_id, f.device_id, f.class_code,
                                                f.numa_node, f.driver, g.vf_iommu_groups[v])
    return out


with_cases = pytest.mark.parametrize("rendered", CASES, indirect=True)


@with_cases
def test_hwloc_sees_packages_numa_cores_and_pci(rendered: tuple[NodeSpec, Path]) -> None:
    node, root = rendered
    xml = lstopo(root, "--filter", "io:all", "--filter", "osdev:all")
    objs = list(xml.iter("object"))
    of = {t: [o for o in objs if o.get("type") == t] for t in
          ("Package", "NUMANode", "Core", "PU", "PCIDev", "Bridge", "OSDev")}
    assert len(of["Package"]) == node.cpu.sockets
    assert len(of["Core"]) == node.cpu.sockets * node.cpu.cores_per_socket
    assert {int(o.get("os_index", "-1")) for o in of["PU"]} == {c.id for c in node.cpus}
    numa = {int(o.get("os_index", "-1")): o for o in of["NUMANode"]}
    assert sorted(numa) == [n.id for n in node.numa]
    for n in node.numa:
        assert int(numa[n.id].get("local_memory", "0")) == n.memory
        assert hwloc_mask(numa[n.id].get("cpuset", "0x0")) == set(n.cpus)
    # Every PCI function, with its ids and class, below the object of its NUMA node.
    up = parents(xml)
    pcidevs = {o.get("pci_busid"): o for o in of["PCIDev"]}
    bridges = {o.get("pci_busid") for o in of["Bridge"] if o.get("pci_busid")}
    expected = expected_functions(node)
    assert bridges == {a for a, f in expected.items() if f.bridge}
    assert set(pcidevs) == {a for a, f in expected.items() if not f.bridge}
    for addr, obj in pcidevs.items():
        f = expected[str(addr)]
        assert f"{f.class_code >> 8:04x} [{f.vendor:04x}:{f.device:04x}]" in obj.get("pci_type", "")
        anc = up[obj]
        while anc.get("type") in ("Bridge", "PCIDev"):
            anc = up[anc]
        assert hwloc_mask(anc.get("nodeset", "0x0")) == {f.numa_node}, addr
    # OS devices: DRM cards of AMD/Intel GPUs, NIC interfaces and RDMA devices.
    osdevs = {o.get("name"): up[o].get("pci_busid") for o in of["OSDev"]}
    for d in node.devices:
        if d.health_reason == "removed" and d.health == "unhealthy":
            continue
        if d.gpu is not None and d.vendor != "nvidia":
            card, render_minor = drm_minors(d.gpu.minor)
            assert osdevs.get(f"card{card}") == d.address
            assert osdevs.get(f"renderD{render_minor}") == d.address
        if d.nic is not None:
            for p, pf in enumerate(d.functions):
                assert osdevs.get(d.nic.netdevs[p]) == pf.address
                if d.nic.rdma_devs:
                    assert osdevs.get(d.nic.rdma_devs[p]) == pf.address


@with_cases
def test_lscpu_sees_sockets_cores_threads_and_numa(rendered: tuple[NodeSpec, Path]) -> None:
    node, root = rendered
    info = lscpu(root)
    assert info["CPU(s)"] == str(len(node.cpus))
    assert info["Socket(s)"] == str(node.cpu.sockets)
    assert info["Core(s) per socket"] == str(node.cpu.cores_per_socket)
    assert info["Thread(s) per core"] == str(node.cpu.threads_per_core)
    assert info["Vendor ID"] == node.cpu.vendor
    assert info["Model name"] == node.cpu.model
    assert info["NUMA node(s)"] == str(len(node.numa))
    for n in node.numa:
        assert info[f"NUMA node{n.id} CPU(s)"] == format_cpulist(n.cpus)


@with_cases
def test_numactl_sees_nodes_sizes_and_distances(rendered: tuple[NodeSpec, Path]) -> None:
    node, root = rendered
    hw = numactl_hardware(root)
    assert hw.nodes == [n.id for n in node.numa]
    for n in node.numa:
        assert hw.cpus[n.id] == sorted(n.cpus)
        assert hw.size_mb[n.id] == n.memory // 2**20
    assert hw.distances == [list(n.distances) for n in node.numa]


@with_cases
def test_lspci_lists_every_function(rendered: tuple[NodeSpec, Path]) -> None:
    node, root = rendered
    records = lspci_records(root)
    expected = expected_functions(node)
    assert set(records) == set(expected)
    for addr, f in expected.items():
        rec = records[addr]
        assert bracket_id(rec["Vendor"]) == f"{f.vendor:04x}"
        assert bracket_id(rec["Device"]) == f"{f.device:04x}"
        assert bracket_id(rec["Class"]) == f"{f.class_code >> 8:04x}"
        assert rec.get("ProgIf", "00") == f"{f.class_code & 0xFF:02x}"
        assert rec["NUMANode"] == str(f.numa_node)
        assert rec["IOMMUGroup"] == str(f.iommu_group)
        assert rec.get("Driver") == f.driver
    # The human form (-vnn) decodes config space too: every function, its NUMA node.
    text = run([*lspci_args(root), "-vnnD"])
    blocks = [b for b in text.strip().split("\n\n") if b]
    assert len(blocks) == len(expected)
    for block in blocks:
        addr = block.split()[0]
        assert f"NUMA node {expected[addr].numa_node}" in block
        assert "Capabilities: [40] Express" in block

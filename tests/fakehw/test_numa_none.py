"""Devices without NUMA affinity (``numaNode: none``) and the root complex's host bridge
function 0000:00:00.0, through the layers: profile, resolved spec, tree, show, picture,
capture (issue 24 item 2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from sandbox.capture import capture
from sandbox.draw import topology_svg
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import NodeSpec, load_profile_text, spec
from sandbox.profile.defaults import defaulted_profile
from sandbox.profile.show import node_text
from tests.capture.test_capture import tree_differences

PCI = "sys/bus/pci/devices"
# A 2-socket box whose GPU and NIC (VFs enabled) say "no affinity", one NVMe on node 1.
MIXED = """\
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: noaff}
nodes:
  - name: box
    cpu: {sockets: 2, coresPerSocket: 4}
    devices:
      - {type: gpu, vendor: nvidia, model: l40s, numaNode: none}
      - {type: nic, vendor: mellanox, model: connectx-7, numaNode: none,
         sriov: {totalVFs: 2, numVFs: 2}}
      - {type: nvme, vendor: samsung, model: pm9a3, numaNode: 1}
"""
# A VM: one NUMA node, its host bridge and every device without affinity, its own
# root complex ids, devices directly on bus 00.
VM = """\
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: vm}
nodes:
  - name: vm
    cpu: {sockets: 1, coresPerSocket: 2, vendor: AuthenticAMD}
    pci:
      hostBridges:
        - {bus: 0x00, numaNode: none}
      rootComplex: {vendorId: 0x8086, deviceId: 0x0d57}
    devices:
      - {type: generic, vendorId: 0x1af4, deviceId: 0x1041, classCode: 0x020000,
         numaNode: none, driver: virtio-pci, pciAddresses: ["0000:00:03.0"]}
"""


def _node(text: str) -> NodeSpec:
    return load_profile_text(text, "t.yaml").cluster.nodes[0]


def _read(root: Path, rel: str) -> str:
    return (root / rel).read_text().strip()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[NodeSpec, Path]:
    node = _node(MIXED)
    root = tmp_path_factory.mktemp("mixed")
    render(build_tree(node), root)
    return node, root


def test_spec_carries_minus_one_for_every_function_of_the_device() -> None:
    node = _node(MIXED)
    by_id = {d.id: d for d in node.devices}
    assert (by_id["gpu0"].numa_node, by_id["nic0"].numa_node, by_id["nvme0"].numa_node) == (
        -1, -1, 1)
    nic_fns = [f for f in node.pci if f.owner == "nic0"]
    assert len(nic_fns) == 3  # the PF and its 2 possible VFs
    assert {f.numa_node for f in nic_fns} == {-1}
    assert spec.load(spec.dump(node)) == node  # the spec file keeps -1


def test_tree_has_numa_node_minus_one_and_every_cpu_local(
        mixed: tuple[NodeSpec, Path]) -> None:
    node, root = mixed
    owners = {f.address: f.owner for f in node.pci}
    seen = 0
    for f in node.pci:
        if f.owner not in ("gpu0", "nic0"):
            continue
        base = f"{PCI}/{f.address}"
        assert _read(root, f"{base}/numa_node") == "-1", f.address
        assert _read(root, f"{base}/local_cpulist") == "0-7", f.address
        assert _read(root, f"{base}/local_cpus") == "ff", f.address
        seen += 1
    assert seen == 4  # the GPU, the NIC's PF and both enabled VFs
    nvme = next(a for a, o in owners.items() if o == "nvme0")
    assert _read(root, f"{PCI}/{nvme}/numa_node") == "1"
    assert _read(root, f"{PCI}/{nvme}/local_cpulist") == "4-7"


@pytest.mark.parametrize(("vendor", "ids"), [("GenuineIntel", ("0x8086", "0x2020")),
                                             ("AuthenticAMD", ("0x1022", "0x1480"))])
def test_root_complex_host_bridge_has_the_cpu_vendors_ids(vendor: str, ids: tuple[str, str],
                                                          tmp_path: Path) -> None:
    node = _node(MIXED.replace("coresPerSocket: 4}", f"coresPerSocket: 4, vendor: {vendor}}}"))
    render(build_tree(node), tmp_path)
    base = tmp_path / PCI / "0000:00:00.0"
    assert base.resolve() == (tmp_path / "sys/devices/pci0000:00/0000:00:00.0").resolve()
    assert (_read(base, "vendor"), _read(base, "device")) == ids
    assert _read(base, "class") == "0x060000"
    assert _read(base, "numa_node") == "0"  # its host bridge's
    assert not (base / "driver").exists()


def test_root_complex_ids_from_the_profile_and_no_affinity_host_bridge(tmp_path: Path) -> None:
    node = _node(VM)
    render(build_tree(node), tmp_path)
    base = tmp_path / PCI / "0000:00:00.0"
    assert (_read(base, "vendor"), _read(base, "device")) == ("0x8086", "0x0d57")
    assert (_read(base, "numa_node"), _read(base, "local_cpulist")) == ("-1", "0-1")
    nic = tmp_path / PCI / "0000:00:03.0"
    assert (_read(nic, "numa_node"), _read(nic, "local_cpulist")) == ("-1", "0-1")


def test_a_device_at_the_root_complex_address_keeps_it() -> None:
    text = VM.replace('"0000:00:03.0"', '"0000:00:00.0"')
    node = _node(text)
    (fn,) = [f for f in node.pci if f.address == "0000:00:00.0"]
    assert fn.owner == "dev0"


def test_show_and_defaults_say_none() -> None:
    loaded = load_profile_text(MIXED, "t.yaml")
    node = loaded.cluster.nodes[0]
    text = node_text(node)
    assert "  no NUMA affinity (numa_node -1)  local CPUs: all (0-7)" in text
    tail = text.split("no NUMA affinity")[1]
    assert "gpu0" in tail
    assert "nic0" in tail
    assert "nvme0" not in tail
    doc = defaulted_profile(loaded.profile, loaded.cluster)
    devices = doc["nodes"][0]["devices"]
    assert [d["numaNode"] for d in devices] == ["none", "none", 1]
    assert doc["nodes"][0]["pci"]["rootComplex"] == {"vendorId": "0x8086", "deviceId": "0x2020"}
    again = load_profile_text(yaml.safe_dump(doc), "again.yaml")
    assert again.cluster.nodes[0] == node  # the defaulted profile resolves the same


def test_picture_groups_devices_without_affinity() -> None:
    svg = topology_svg([_node(MIXED)])
    assert "no NUMA affinity" in svg
    for dev in ("gpu0", "nic0"):
        assert re.search(rf'data-device="{dev}"[^>]*data-numa="-1"', svg), dev
    assert re.search(r'data-device="nvme0"[^>]*data-numa="1"', svg)


@pytest.mark.parametrize("text", [MIXED, VM], ids=["mixed", "vm"])
def test_capture_keeps_none_and_renders_back_identical(text: str, tmp_path: Path) -> None:
    node = _node(text)
    first, second = tmp_path / "first", tmp_path / "second"
    render(build_tree(node), first)
    result = capture(first, name="noaff" if text is MIXED else "vm", node_name=node.name)
    captured = result.profile["nodes"][0]
    assert "none" in [d["numaNode"] for d in captured["devices"]]
    assert "numa_node -1" not in " ".join(result.left_out)  # kept, not changed
    again = load_profile_text(result.text, "<captured>").cluster.nodes[0]
    render(build_tree(again), second)
    diffs = tree_differences(first, second)
    assert diffs == [], f"{len(diffs)} difference(s):\n" + "\n".join(diffs)

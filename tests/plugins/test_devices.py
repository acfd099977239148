"""The one device model (``hwplugins.devices``) under both consumers, on rendered trees.

Every profile's nodes are rendered (healthy, and with one device faulted or unplugged) and
scanned; the device plugin and the DRA driver must then agree on every device they both
offer: the same /dev nodes and the same verdict on health, because neither reads a file
of its own any more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hwplugins.deviceplugin import discover as dp_discover
from hwplugins.deviceplugin import group
from hwplugins.devices import Scanner, scan
from hwplugins.dra import discover as dra_discover
from hwplugins.dra import from_scan

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.fakehw.tree import DeviceState, Health, Reason
from sandbox.profile import load_profile
from tests.support.paths import REPO

PROFILES = sorted((REPO / "profiles").glob("*.yaml")) + [REPO / "tests/data/dra-nic-gpu.yaml"]
CASES = [(p, n.name) for p in PROFILES for n in load_profile(str(p)).cluster.nodes]
FAULTS = {
    "aer": DeviceState(Health.UNHEALTHY, Reason.AER_FATAL),
    "link": DeviceState(Health.UNHEALTHY, Reason.LINK_DOWN),
    "port": DeviceState(Health.UNHEALTHY, Reason.PORT_DOWN),
    "unplug": DeviceState(plugged=False),
}


def _key(pci_address: str, dev_nodes: tuple[str, ...]) -> tuple[str, str]:
    """One allocatable unit: its PCI function and, for FPGA ports, the port's node."""
    port = next((n for n in dev_nodes if n.startswith("/dev/dfl-port.")), "")
    return pci_address, port


@pytest.mark.parametrize(("profile", "node_name"), CASES,
                         ids=[f"{p.stem}-{n}" for p, n in CASES])  # fmt: skip
def test_plugin_and_driver_agree_on_nodes_and_health(tmp_path: Path, profile: Path,
                                                     node_name: str) -> None:  # fmt: skip
    node = load_profile(str(profile)).cluster.node(node_name)
    assert node is not None
    first = node.devices[0].id if node.devices else None
    variants: dict[str, dict[str, DeviceState]] = {"healthy": {}}
    if first is not None:
        variants.update({name: {first: state} for name, state in FAULTS.items()})
    compared = 0
    for name, states in variants.items():
        root = tmp_path / name
        render(build_tree(node, states), root, force=True)
        devices = scan(root)
        plugin = {_key(d.pci_address, d.dev_nodes): d for d in group(devices)}
        driver = {_key(d.pci_address, d.dev_nodes): d for d in from_scan(devices)}
        assert plugin == {_key(d.pci_address, d.dev_nodes): d for d in dp_discover(root)}
        assert driver == {_key(d.pci_address, d.dev_nodes): d for d in dra_discover(root)}
        for key in plugin.keys() & driver.keys():
            p, d = plugin[key], driver[key]
            assert p.dev_nodes == d.dev_nodes, (name, key)
            assert p.healthy == d.healthy, (name, key, p.reason, d.problems)
            assert p.numa_node == d.numa_node, (name, key)
            compared += 1
        if name == "unplug":
            gone = next(d.address for d in node.devices if d.id == first)
            assert all(d.address != gone for d in devices)
    if any(d.gpu is not None or d.fpga is not None for d in node.devices):
        assert compared, "no device offered by both: nothing was compared"


@pytest.mark.parametrize("profile", ["sriov-rdma.yaml", "fpga-dfl.yaml", "intel-flex-sriov.yaml",
                                     "workshop-mixed.yaml"])  # fmt: skip
def test_rescanning_only_the_changed_device_equals_a_full_scan(tmp_path: Path,
                                                               profile: str) -> None:  # fmt: skip
    """What ``--watch`` relies on: after a change to one device, re-reading that device's
    PCI function (its VFs and whatever appeared) gives exactly what a full scan gives."""
    node = load_profile(str(REPO / "profiles" / profile)).cluster.nodes[0]
    root = tmp_path / "root"
    render(build_tree(node), root, force=True)
    scanner = Scanner(root)
    assert scanner.scan() == scan(root)
    states: dict[str, DeviceState] = {}
    for dev in node.devices[:2]:
        changes = [FAULTS["aer"], FAULTS["unplug"], DeviceState()]
        if dev.nic is not None:
            changes[1:1] = [FAULTS["link"]]
        vfs = dev.nic.num_vfs if dev.nic else dev.gpu.num_vfs if dev.gpu else 0
        if vfs:
            changes[1:1] = [DeviceState(num_vfs=vfs - 1)]
        for state in changes:
            states[dev.id] = state
            render(build_tree(node, states), root, force=True)
            assert scanner.scan(frozenset({dev.address})) == scan(root), (dev.id, state)

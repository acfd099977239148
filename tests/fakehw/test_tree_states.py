"""``build_tree``'s device states (health, hot-unplug, VF counts) shown through the real kernel
interfaces; the tree's shape and formats are in test_tree.py, whose helpers these share."""

from __future__ import annotations

import pytest

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.tree import (
    DeviceState,
    Health,
    Reason,
    Symlink,
)
from tests.fakehw.test_tree import entries, first, node_of, resolve, text


# -- health through real interfaces -------------------------------------------------------
def test_aer_fatal_counts_a_fatal_error() -> None:
    node = node_of("profiles/8gpu-2numa.yaml")
    gpu = node.devices[0]
    tree = build_tree(node, {gpu.id: DeviceState(Health.UNHEALTHY, Reason.AER_FATAL)})
    fatal = text(tree, f"sys/bus/pci/devices/{gpu.address}/aer_dev_fatal")
    assert fatal.endswith("TOTAL_ERR_FATAL 1\n")
    assert "UncorrIntErr 1\n" in fatal
    other = text(tree, f"sys/bus/pci/devices/{node.devices[1].address}/aer_dev_fatal")
    assert other.endswith("TOTAL_ERR_FATAL 0\n")


def test_profile_health_is_the_default_state() -> None:
    node = node_of("profiles/workshop-mixed.yaml", "gpu-worker-0")
    sick = first(node, lambda d: d.health == "unhealthy")
    tree = build_tree(node)
    assert text(tree, f"sys/bus/pci/devices/{sick.address}/aer_dev_fatal").endswith(
        "TOTAL_ERR_FATAL 1\n")
    assert tree.devices[sick.id].state == DeviceState(Health.UNHEALTHY, Reason.AER_FATAL)


def test_link_down_takes_netdev_and_rdma_port_down() -> None:
    node = node_of("profiles/8gpu-2numa.yaml")
    nic = first(node, lambda d: d.nic is not None)
    assert nic.nic is not None
    tree = build_tree(node, {nic.id: DeviceState(Health.UNHEALTHY, Reason.LINK_DOWN)})
    net = f"sys/class/net/{nic.nic.netdevs[0]}"
    assert text(tree, f"{net}/operstate") == "down\n"
    assert text(tree, f"{net}/carrier") == "0\n"
    port = f"sys/class/infiniband/{nic.nic.rdma_devs[0]}/ports/1"
    assert text(tree, f"{port}/state") == "1: DOWN\n"


def test_link_down_on_a_gpu_is_a_surprise_down() -> None:
    node = node_of("profiles/8gpu-2numa.yaml")
    gpu = node.devices[0]
    tree = build_tree(node, {gpu.id: DeviceState(Health.UNHEALTHY, Reason.LINK_DOWN)})
    base = f"sys/bus/pci/devices/{gpu.address}"
    assert "SDES 1\n" in text(tree, f"{base}/aer_dev_fatal")
    assert text(tree, f"{base}/current_link_speed") == "Unknown\n"
    assert text(tree, f"{base}/current_link_width") == "0\n"


def test_port_down_disables_the_ib_port_only() -> None:
    node = node_of("profiles/8gpu-2numa.yaml")
    nic = first(node, lambda d: d.nic is not None)
    assert nic.nic is not None
    tree = build_tree(node, {nic.id: DeviceState(Health.UNHEALTHY, Reason.PORT_DOWN)})
    port = f"sys/class/infiniband/{nic.nic.rdma_devs[0]}/ports/1"
    assert text(tree, f"{port}/state") == "1: DOWN\n"
    assert text(tree, f"{port}/phys_state") == "3: Disabled\n"
    assert text(tree, f"sys/class/net/{nic.nic.netdevs[0]}/operstate") == "up\n"


@pytest.mark.parametrize("how", ["unplug", "removed"])
def test_removed_device_vanishes_everywhere(how: str) -> None:
    node = node_of("profiles/sriov-rdma.yaml")
    nic = first(node, lambda d: d.nic is not None and d.nic.num_vfs and d.nic.rdma)
    n = nic.nic
    assert n is not None
    state = (DeviceState(plugged=False) if how == "unplug"
             else DeviceState(Health.UNHEALTHY, Reason.REMOVED))
    before = build_tree(node)
    after = build_tree(node, {nic.id: state})
    addresses = [f.address for f in nic.functions]
    addresses += [a for vfs in n.vf_addresses for a in vfs[: n.num_vfs]]
    gone = set(addresses) | set(n.netdevs) | set(n.rdma_devs)
    old, new = entries(before), entries(after)
    removed = set(old) - set(new)
    assert not set(new) - set(old)
    for path, entry in new.items():
        assert not any(name in path.split("/") for name in gone), path
        if isinstance(entry, Symlink):
            assert resolve(after, path) is not None, f"{path} dangles after removal"
    for node_path in after.devices[nic.id].dev_nodes:
        assert node_path in removed
    assert any(p.startswith("sys/dev/char/231:") for p in removed)
    assert any(p.startswith("sys/kernel/iommu_groups/") for p in removed)
    assert any(p.startswith("sys/bus/pci/drivers/") for p in removed)
    assert after.devices[nic.id].state == state


def test_unplug_then_replug_is_identical() -> None:
    node = node_of("profiles/8gpu-2numa.yaml")
    original = build_tree(node).digest()
    for d in node.devices:
        assert build_tree(node, {d.id: DeviceState(plugged=False)}).digest() != original
        assert build_tree(node, {d.id: DeviceState(plugged=True)}).digest() == original


def test_num_vfs_state_overrides_the_profile() -> None:
    node = node_of("profiles/sriov-rdma.yaml")
    nic = first(node, lambda d: d.nic is not None and d.nic.total_vfs)
    n = nic.nic
    assert n is not None
    pf = f"sys/bus/pci/devices/{nic.functions[0].address}"
    for count in (0, n.total_vfs):
        tree = build_tree(node, {nic.id: DeviceState(num_vfs=count)})
        assert text(tree, f"{pf}/sriov_numvfs") == f"{count}\n"
        present = [a for a in n.vf_addresses[0] if tree.get(f"sys/bus/pci/devices/{a}")]
        assert present == list(n.vf_addresses[0][:count])
    # Past sriov_totalvfs the kernel refuses the write; so does the builder (not a clamp).
    with pytest.raises(ValueError, match=f"exceeds sriov_totalvfs {n.total_vfs}"):
        build_tree(node, {nic.id: DeviceState(num_vfs=n.total_vfs + 5)})
    assert build_tree(node, {nic.id: DeviceState(num_vfs=n.num_vfs)}).digest() == \
        build_tree(node).digest()

"""The node's plugin network namespace and the SR-IOV Network Device Plugin, unmodified, on
the native runtime (issue 24, items 3 and 4).

``up`` makes ``state_dir/plugins-netns`` with a real link per netdev of the tree
(sandbox.fakehw.netlinks); ``ip -j link`` there lists the profile's netdevs with their
addresses, and follows a link-down fault and ``set-vfs``. The plugin
(k8snetworkplumbingwg/sriov-network-device-plugin at the commit sriov-network-operator
pins; scripts/build-plugins sriov-network-device-plugin, static) runs in that namespace
(its pod annotated ``hwsandbox.dev/netns: plugins``; oci-cpumap puts it there), keeps the
VFs whose links it finds over netlink, and advertises the profile's VF pools on the real
kubelet; a pod asking for one VF gets its PCI address in ``PCIDEVICE_INTEL_COM_CX6DX_VF``.

Runs on ``sriov_cluster`` (sriov-rdma: a ConnectX-6 Dx with 2 ports x 4 VFs, a ConnectX-7
on InfiniBand, an E810 with 2 VFs), without our reference device plugin; the vfio pool on
``dpdk_cluster`` (sriov-dpdk: 4 E810 VFs on vfio-pci): a pod gets /dev/vfio/vfio and its VF's
/dev/vfio/<IOMMU group>.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cluster import (
    NativeCluster,
    kubectl,
    pod_log,
    pods_state,
    resource_counts,
    running_pod,
    wait_until,
)

from sandbox.fakehw.netlinks import tree_links
from tests.support.thirdparty import plugin_binary, static_image

IMAGE = "localhost/hw-sandbox/sriov-network-device-plugin:v3.5.1-13-ga5a7395"
LABEL = "app.kubernetes.io/name=sriov-device-plugin"
PCI_IDS = Path("/usr/share/misc/pci.ids")
CX6_VF = "intel.com/cx6dx_vf"  # the plugin's default resource prefix is intel.com
E810_VF = "intel.com/e810_vf"
VFIO_VF = "intel.com/vfio_vf"


def ns_links(cluster: NativeCluster) -> dict[str, dict[str, Any]]:
    out = subprocess.run(["nsenter", f"--net={cluster.layout.plugins_netns}", "ip", "-j",
                          "link", "show"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return {link["ifname"]: link for link in json.loads(out) if link["ifname"] != "lo"}


def agree(cluster: NativeCluster) -> bool:
    """Whether the plugin namespace's links are exactly the tree's netdevs."""
    want, have = tree_links(cluster.state_dir / "node-root"), ns_links(cluster)
    return set(want) == set(have) and all(
        (link.address is None or have[name]["address"] == link.address.hex(":"))
        and have[name]["operstate"] == ("UP" if link.carrier else "DOWN")
        and have[name]["mtu"] == link.mtu for name, link in want.items())


def vf_addresses(root: Path, device: str) -> set[str]:
    """PCI addresses of the tree's functions with that vendor:device id."""
    vendor, dev = device.split(":")
    return {f.name for f in (root / "sys/bus/pci/devices").iterdir()
            if (f / "vendor").read_text().strip() == f"0x{vendor}"
            and (f / "device").read_text().strip() == f"0x{dev}"}


def test_the_netdevs_are_links_in_the_plugin_namespace(sriov_cluster: NativeCluster) -> None:
    cluster = sriov_cluster
    assert os.path.ismount(cluster.layout.plugins_netns)
    host = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True,
                          check=True).stdout
    want = tree_links(cluster.state_dir / "node-root")
    assert len(want) > 10
    assert not set(want) & {link["ifname"] for link in json.loads(host)}, "links on the host"
    wait_until("the plugin namespace's links to match the tree", lambda: agree(cluster), 20,
               describe=lambda: str(sorted(ns_links(cluster))))
    nic0 = {n for n, link in want.items() if link.carrier}
    node = cluster.node.name
    try:
        cluster.sandbox_cli("fault", "health", node, "nic0", "unhealthy", "--reason", "link-down")
        wait_until("link-down in the links", lambda: agree(cluster), 20)
        down = {n for n, link in ns_links(cluster).items() if link["operstate"] == "DOWN"}
        assert down
        assert down < nic0
        cluster.sandbox_cli("fault", "health", node, "nic0", "healthy")
        wait_until("recovery in the links", lambda: agree(cluster), 20)
        before = set(ns_links(cluster))
        cluster.sandbox_cli("fault", "set-vfs", node, "nic0", "1")
        wait_until("set-vfs 1 in the links", lambda: agree(cluster), 20)
        assert set(ns_links(cluster)) < before
    finally:
        cluster.sandbox_cli("fault", "reset", node)
    wait_until("the links after reset", lambda: agree(cluster), 20)
    assert set(ns_links(cluster)) == before


def deploy_plugin(cluster: NativeCluster) -> None:
    if not PCI_IDS.is_file():
        pytest.fail(f"{PCI_IDS} is missing (the plugin's image carries it): apt-get install "
                    "pci.ids, or run scripts/install-system-deps", pytrace=False)
    binary = plugin_binary("sriov-network-device-plugin")
    cluster.ctr("images", "import", str(static_image(
        binary, IMAGE, "/usr/bin/sriovdp", {"/usr/share/misc/pci.ids": PCI_IDS})))
    cluster.sandbox_cli("plugins", "deploy", "sriov-network-device-plugin")


def remove_plugin(cluster: NativeCluster) -> None:
    kubectl(cluster, "-n", "kube-system", "delete", "daemonset", "sriov-device-plugin",
            "--ignore-not-found", "--wait=true")
    wait_until("the plugin's pod is gone", lambda: not cluster.core.list_namespaced_pod(
        "kube-system", label_selector=LABEL).items, 120,
        describe=lambda: pods_state(cluster, "kube-system", LABEL))


def wait_pools(cluster: NativeCluster, pools: dict[str, int]) -> None:
    for resource, n in pools.items():
        wait_until(f"{resource} {n}/{n} on the node",
                   lambda r=resource, n=n: resource_counts(cluster, r) == (n, n), 180,
                   describe=lambda: pods_state(cluster, "kube-system", LABEL))


def test_sriov_network_device_plugin_gives_a_pod_a_vf(sriov_cluster: NativeCluster) -> None:
    cluster = sriov_cluster
    root = cluster.state_dir / "node-root"
    cx6 = vf_addresses(root, "15b3:101e")
    assert (len(cx6), len(vf_addresses(root, "8086:1889"))) == (8, 2)
    deploy_plugin(cluster)
    try:
        wait_pools(cluster, {CX6_VF: 8, E810_VF: 2, VFIO_VF: 0})
        with running_pod(cluster, "sriov-vf", "echo VF=$PCIDEVICE_INTEL_COM_CX6DX_VF; sleep 600",
                         resources={"limits": {CX6_VF: "1"}}):
            wait_until("the pod's log", lambda: "VF=" in pod_log(cluster, "sriov-vf"))
            [line] = [x for x in pod_log(cluster, "sriov-vf").splitlines() if x.startswith("VF=")]
            assert line.removeprefix("VF=") in cx6, line
    finally:
        remove_plugin(cluster)


def test_a_vfio_vf_comes_with_its_iommu_group(dpdk_cluster: NativeCluster) -> None:
    cluster = dpdk_cluster
    root = cluster.state_dir / "node-root"
    vfio = vf_addresses(root, "8086:1889")
    groups = {a: (root / "sys/bus/pci/devices" / a / "iommu_group").resolve().name for a in vfio}
    assert len(vfio) == 4
    assert all((root / "sys/bus/pci/devices" / a / "driver").resolve().name == "vfio-pci"
               for a in vfio)
    deploy_plugin(cluster)
    try:
        wait_pools(cluster, {VFIO_VF: 4, CX6_VF: 2, E810_VF: 0})
        with running_pod(cluster, "vfio-vf",
                         "echo VF=$PCIDEVICE_INTEL_COM_VFIO_VF; echo DEV=$(ls /dev/vfio); "
                         "sleep 600", resources={"limits": {VFIO_VF: "1"}}):
            wait_until("the pod's log", lambda: "DEV=" in pod_log(cluster, "vfio-vf"))
            out = dict(x.split("=", 1) for x in pod_log(cluster, "vfio-vf").splitlines()
                       if "=" in x)
            assert out["VF"] in vfio, out
            assert sorted(out["DEV"].split()) == sorted([groups[out["VF"]], "vfio"]), out
    finally:
        remove_plugin(cluster)

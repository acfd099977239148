"""kubernetes-sigs' dra-driver-cpu v0.2.0 (dracpu), unmodified, on the native runtime
(issue 24, item 5): built from its Go module (scripts/build-plugins dra-driver-cpu,
static), put into a local image, deployed with `sandbox plugins deploy dra-driver-cpu`.

The driver discovers CPUs from sysfs only; the manifest mounts the node's fake /sys at
/sys, so its ResourceSlices (driver dra.cpu, one device per CPU in its individual mode)
list the profile's 64 CPUs with the NUMA node, socket and core each has in the tree: two
sockets and two NUMA nodes on a host that has neither. It meets the sandbox containerd's
NRI at the socket `deploy` moves into the state dir.

Runs on ``nvidia_cluster`` (8gpu-2numa: 2 sockets x 16 cores x 2 threads, 2 NUMA nodes).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from cluster import NativeCluster, custom_objects, kubectl, pods_state, wait_until

from tests.support.thirdparty import plugin_binary, static_image

DRIVER = "dra.cpu"
VERSION = "v0.2.0"
IMAGE = f"localhost/hw-sandbox/dra-driver-cpu:{VERSION}"
LABEL = "app.kubernetes.io/name=dra-driver-cpu"


def _devices(cluster: NativeCluster) -> dict[str, dict[str, Any]]:
    items = custom_objects(cluster).list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices",
        field_selector=f"spec.nodeName={cluster.node.name},spec.driver={DRIVER}")["items"]
    return {d["name"]: d for s in items for d in s["spec"].get("devices", [])}


def _attrs(device: dict[str, Any]) -> dict[str, Any]:
    """Attribute name (without the driver's domain) -> value."""
    return {k.rsplit("/", 1)[-1]: next(iter(v.values()))
            for k, v in device.get("attributes", {}).items()}


def _tree_cpus(root: Path) -> dict[int, tuple[int, int, int]]:
    """cpu id -> (NUMA node, socket, core id), from the node's fake sysfs."""
    out = {}
    for cpu in (root / "sys/devices/system/cpu").glob("cpu[0-9]*"):
        topo = cpu / "topology"
        [node] = [int(p.name[4:]) for p in cpu.iterdir() if re.fullmatch(r"node\d+", p.name)]
        out[int(cpu.name[3:])] = (node, int((topo / "physical_package_id").read_text()),
                                  int((topo / "core_id").read_text()))
    return out


def test_dra_driver_cpu_publishes_the_profiles_cpus(nvidia_cluster: NativeCluster) -> None:
    cluster = nvidia_cluster
    cluster.ctr("images", "import",
                str(static_image(plugin_binary("dra-driver-cpu"), IMAGE, "/dracpu")))
    assert IMAGE in cluster.ctr("images", "ls", "-q").split()
    out = cluster.sandbox_cli("plugins", "deploy", "dra-driver-cpu")
    assert f"node path /var/run/nri is {cluster.state_dir / 'nri'} on native" in out, out
    want = _tree_cpus(cluster.state_dir / "node-root")
    assert len(want) == 64
    assert {n for n, _, _ in want.values()} == {0, 1}
    try:
        wait_until(f"{DRIVER}'s ResourceSlices with 64 CPUs",
                   lambda: len(_devices(cluster)) == 64, 180,
                   describe=lambda: f"{sorted(_devices(cluster))}\n"
                                    f"{pods_state(cluster, 'kube-system', LABEL)}")
        seen = {}
        for name, device in _devices(cluster).items():
            a = _attrs(device)
            seen[a["cpuID"]] = (a["numaNodeID"], a["socketID"], a["coreID"])
            assert a["smtEnabled"] is True, (name, a)
        assert seen == want
    finally:
        kubectl(cluster, "-n", "kube-system", "delete", "daemonset", "dra-driver-cpu",
                "--ignore-not-found", "--wait=true")
        wait_until("the driver's pod is gone", lambda: not cluster.core.list_namespaced_pod(
            "kube-system", label_selector=LABEL).items, 120,
            describe=lambda: pods_state(cluster, "kube-system", LABEL))

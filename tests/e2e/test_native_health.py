"""Faults reach the pods (issue 29): device health in ``status.containerStatuses[].
allocatedResourcesStatus``, fed by a real kubelet (feature ResourceHealthStatus, beta and on
since 1.36) from a device plugin's ListAndWatch and from a DRA driver's DRAResourceHealth
stream.

1. Our device plugin, 8gpu-2numa: a pod holding 2 GPUs; one of them faulted (aer-fatal)
   shows ``Unhealthy`` within 5 s while the other stays ``Healthy``; healthy again after
   ``fault health … healthy``. An unplugged GPU is reported as the kubelet reports a device
   its plugin no longer lists (docs/health.md): the pod keeps the entry it had.
2. NVIDIA's device plugin instead of ours (its Xid path: NVML events from our library).
3. Our DRA driver: a partition claim on mig-partitions (its parent GPU faulted), and a NIC
   share on sriov-rdma (the NIC's ports down): ``Unhealthy`` with the driver's message in
   those pods only, ``Healthy`` again within 5 s of the recovery; the partition's GPU
   unplugged: ``Unknown`` once the driver's last report of it times out (30 s).
4. examples/health: the workshop pod and its scenario, whose pod-health expectations pass,
   and fail naming the pod and the device once the faults are taken out.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cluster import (
    DRIVER,
    GROUP,
    NS,
    REPO,
    VERSION,
    WITHIN,
    NativeCluster,
    component_log,
    custom_objects,
    default_service_account,
    delete_object,
    ensure_device_classes,
    events,
    phase,
    pod_manifest,
    read_claim,
    resource_health,
    slice_devices,
    wait_health,
    wait_until,
)
from hwplugins.dra.kubeletplugin import HEALTH_TIMEOUT

from sandbox.runtimes.native import BUSYBOX_REF

GPU = "nvidia.com/gpu"
TAINT_KEY = "hwsandbox.dev/unhealthy"


def _gpu_ids(cluster: NativeCluster) -> dict[str, str]:
    """A plugin's id of a GPU (its UUID) -> the profile's device id."""
    return {d.uuid: d.id for d in cluster.node.devices if d.gpu is not None and d.uuid}


def _two_gpu_pod(cluster: NativeCluster, name: str) -> list[str]:
    """Start ``name`` holding 2 GPUs; the UUIDs the kubelet reports healthy for it."""
    wait_until("the default service account", lambda: default_service_account(cluster))
    cluster.core.create_namespaced_pod(NS, pod_manifest(
        name, "sleep 3600", resources={"limits": {GPU: "2"}}))
    wait_until(f"pod {name} to run", lambda: phase(cluster, name) == "Running", 120,
               describe=lambda: events(cluster, name))
    wait_until(f"{name}'s two GPUs in allocatedResourcesStatus",
               lambda: len(resource_health(cluster, name).get(GPU, {})) == 2, 30,
               describe=lambda: f"have {resource_health(cluster, name)}")
    held = resource_health(cluster, name)[GPU]
    assert {h for h, _m in held.values()} == {"Healthy"}, held
    return sorted(held)


def check_device_plugin_chain(cluster: NativeCluster, pod: str) -> None:
    """Fault one of a 2-GPU pod's GPUs, then heal it: each step in the pod within 5 s.
    Then unplug the other: the kubelet keeps it ``Healthy`` in the pod (a device its
    plugin no longer lists reads as healthy: devicemanager's UpdateAllocatedResourcesStatus
    has no Unknown), and plugging it back changes nothing in the pod either."""
    node = cluster.node.name
    ids = _gpu_ids(cluster)
    sick = unplugged = ""
    try:
        sick_uuid, well_uuid = _two_gpu_pod(cluster, pod)
        sick = ids[sick_uuid]
        start = time.monotonic()
        cluster.sandbox_cli("fault", "health", node, sick, "unhealthy", "--reason", "aer-fatal")
        took = wait_health(cluster, pod, {sick_uuid: "Unhealthy", well_uuid: "Healthy"}, GPU,
                           since=start)
        print(f"{pod}: fault -> Unhealthy in the pod: {took:.2f}s")
        # `sandbox status` says which pod's status has it (table, json)
        table = cluster.sandbox_cli("status").split("pods with unhealthy devices", 1)
        assert len(table) == 2, table[0]
        assert re.search(rf"default/{pod}\s+main\s+{GPU}\s+{sick}\s+Unhealthy", table[1]), table
        (data,) = json.loads(cluster.sandbox_cli("status", "-o", "json"))["nodes"]
        assert {(h["pod"], h["device"], h["health"]) for h in data["pod_health"]} == {
            (pod, sick, "Unhealthy"), (pod, ids[well_uuid], "Healthy")}, data["pod_health"]
        start = time.monotonic()
        cluster.sandbox_cli("fault", "health", node, sick, "healthy")
        sick = ""
        took = wait_health(cluster, pod, {sick_uuid: "Healthy", well_uuid: "Healthy"}, GPU,
                           since=start)
        print(f"{pod}: recovery -> Healthy in the pod: {took:.2f}s")

        # the node status lags the recovery (the kubelet writes it every few seconds):
        # every GPU allocatable again first, or the count below starts from a stale one
        wait_until("every GPU allocatable again",
                   lambda: _allocatable(cluster) == _capacity(cluster), 60,
                   describe=lambda: str(cluster.core.read_node(node).status.allocatable))
        unplugged, gpus = ids[well_uuid], _allocatable(cluster)
        cluster.sandbox_cli("fault", "unplug", node, unplugged)
        wait_until(f"{unplugged} gone from the node's allocatable",
                   lambda: _allocatable(cluster) == gpus - 1, 60,
                   describe=lambda: str(cluster.core.read_node(node).status.allocatable))
        time.sleep(WITHIN)
        assert resource_health(cluster, pod)[GPU] == {sick_uuid: ("Healthy", ""),
                                                      well_uuid: ("Healthy", "")}
        cluster.sandbox_cli("fault", "plug", node, unplugged)
        unplugged = ""
        wait_until("the GPU back in the node's allocatable",
                   lambda: _allocatable(cluster) == gpus, 60)
        assert resource_health(cluster, pod)[GPU] == {sick_uuid: ("Healthy", ""),
                                                      well_uuid: ("Healthy", "")}
    finally:
        if sick:
            cluster.sandbox_cli("fault", "health", node, sick, "healthy")
        if unplugged:
            cluster.sandbox_cli("fault", "plug", node, unplugged)
        delete_object(cluster, "pod", pod)
        wait_until(f"pod {pod} gone", lambda: not _exists(cluster, pod), 60)


def _allocatable(cluster: NativeCluster) -> int:
    status = cluster.core.read_node(cluster.node.name).status
    return int((status.allocatable or {}).get(GPU, "0"))


def _capacity(cluster: NativeCluster) -> int:
    status = cluster.core.read_node(cluster.node.name).status
    return int((status.capacity or {}).get(GPU, "0"))


def _exists(cluster: NativeCluster, pod: str) -> bool:
    return any(p.metadata.name == pod for p in cluster.core.list_namespaced_pod(NS).items)


# -- DRA ----------------------------------------------------------------------------------

def _create(cluster: NativeCluster, plural: str, doc: dict[str, Any]) -> None:
    custom_objects(cluster).create_namespaced_custom_object(GROUP, VERSION, NS, plural, doc)


def _claim(cluster: NativeCluster, name: str, exactly: dict[str, Any]) -> None:
    """A claim whose one request ``dev`` tolerates our NoExecute taint: the pod stays to be
    looked at (without it the taint evicts the pod, test_native_dra_cdi.py). The effect
    must be named: the eviction controller ignores a toleration without one."""
    exactly = dict(exactly, tolerations=[{"key": TAINT_KEY, "operator": "Exists",
                                          "effect": "NoExecute"}])
    _create(cluster, "resourceclaims", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "dev", "exactly": exactly}]}},
    })  # fmt: skip


def _claim_pod(cluster: NativeCluster, name: str, claim: str) -> tuple[str, str]:
    """Run ``name`` holding ``claim``: (the allocated device's name, its resource id in the
    pod's status: the first CDI device id the driver gave for it, as the kubelet says)."""
    manifest = pod_manifest(name, "sleep 3600", resources={"claims": [{"name": "dev"}]})
    manifest["spec"]["resourceClaims"] = [{"name": "dev", "resourceClaimName": claim}]
    cluster.core.create_namespaced_pod(NS, manifest)
    wait_until(f"pod {name} to run", lambda: phase(cluster, name) == "Running", 120,
               describe=lambda: events(cluster, name) + component_log(cluster, "dra-driver"))
    (result,) = read_claim(cluster, claim)["status"]["allocation"]["devices"]["results"]
    wait_until(f"{name}'s device in allocatedResourcesStatus",
               lambda: len(resource_health(cluster, name).get("claim:dev", {})) == 1, 30,
               describe=lambda: f"have {resource_health(cluster, name)}")
    (rid,) = resource_health(cluster, name)["claim:dev"]
    assert f"-{result['device']}" in rid, (rid, result)  # a share: its id follows
    return str(result["device"]), rid


def _pci_of(device: dict[str, Any]) -> str:
    return str(device["attributes"]["resource.kubernetes.io/pciBusID"]["string"])


def check_dra_chain(cluster: NativeCluster, exactly: dict[str, Any], reason: str,
                    bystander: dict[str, Any], unplug: bool = False) -> None:
    """A pod holding a claim for ``exactly``; the profile device under it faulted with
    ``reason`` -> Unhealthy with the driver's message in that pod (and not in a
    ``bystander`` claim's pod on another device); healed -> Healthy within 5 s."""
    node = cluster.node.name
    wait_until("the DRA driver's slices", lambda: bool(slice_devices(cluster)), 60,
               describe=lambda: component_log(cluster, "dra-driver"))
    ensure_device_classes(cluster)
    wait_until("the default service account", lambda: default_service_account(cluster))
    pods = {"health-claim": exactly, "health-other": bystander}  # made in this order
    made: list[str] = []
    sick = ""
    try:
        rids, names = {}, {}
        for pod, request in pods.items():
            _claim(cluster, pod, request)
            made.append(pod)
            names[pod], rids[pod] = _claim_pod(cluster, pod, pod)
        resource = "claim:dev"
        for pod, rid in rids.items():
            wait_health(cluster, pod, {rid: "Healthy"}, resource, timeout=30)
        device = names["health-claim"]
        pci = _pci_of(slice_devices(cluster)[device])
        target = sick = next(d.id for d in cluster.node.devices if d.address == pci)
        start = time.monotonic()
        cluster.sandbox_cli("fault", "health", node, sick, "unhealthy", "--reason", reason)
        took = wait_health(cluster, "health-claim", {rids["health-claim"]: "Unhealthy"}, resource,
                           since=start)
        print(f"{device}: fault ({reason}) -> Unhealthy in the pod: {took:.2f}s")
        _health, message = resource_health(cluster, "health-claim")[resource][rids["health-claim"]]
        assert message.startswith(f"{reason}: "), message  # the driver's, through the kubelet
        assert resource_health(cluster, "health-other")[resource] == {
            rids["health-other"]: ("Healthy", "")}, resource_health(cluster, "health-other")
        start = time.monotonic()
        cluster.sandbox_cli("fault", "health", node, sick, "healthy")
        sick = ""
        took = wait_health(cluster, "health-claim", {rids["health-claim"]: "Healthy"}, resource,
                           since=start)
        print(f"{device}: recovery -> Healthy in the pod: {took:.2f}s")
        time.sleep(2 * WITHIN)  # and it stays so: no stale report brings Unhealthy back
        assert _exists(cluster, "health-claim"), events(cluster, "health-claim")
        assert resource_health(cluster, "health-claim")[resource][rids["health-claim"]] == (
            "Healthy", ""), resource_health(cluster, "health-claim")
        if unplug:  # the device leaves the driver's reports: Unknown once the last times out
            cluster.sandbox_cli("fault", "unplug", node, target)
            sick = f"plug:{target}"
            start = time.monotonic()
            took = wait_health(cluster, "health-claim", {rids["health-claim"]: "Unknown"},
                               resource, timeout=HEALTH_TIMEOUT + 15, since=start)
            print(f"{device}: unplugged -> Unknown in the pod: {took:.2f}s")
            assert took >= HEALTH_TIMEOUT - 1, took
    finally:
        if sick.startswith("plug:"):
            cluster.sandbox_cli("fault", "plug", node, sick.removeprefix("plug:"))
        elif sick:
            cluster.sandbox_cli("fault", "health", node, sick, "healthy")
        for pod in made:
            delete_object(cluster, "pod", pod)
        for pod in made:
            wait_until(f"pod {pod} gone", lambda p=pod: not _exists(cluster, p), 60)
            delete_object(cluster, "resourceclaims", pod)


def test_dra_nic_share_shows_its_nics_health(optional_cluster: NativeCluster) -> None:
    """A bandwidth share of the ConnectX-6 Dx, its RoCE ports down (a NoSchedule taint: the
    pod stays); a share of the E810 next to it stays Healthy."""
    nics = {d.model: d.address for d in optional_cluster.node.devices if d.nic is not None}

    def share(pci: str) -> dict[str, Any]:
        return {"deviceClassName": "nic.hwsandbox.dev",
                "selectors": [{"cel": {"expression":
                    f'device.attributes["resource.kubernetes.io"].pciBusID == "{pci}"'}}],
                "capacity": {"requests": {"bandwidth": "1G"}}}  # fmt: skip

    check_dra_chain(optional_cluster, share(nics["connectx-6dx"]), "port-down",
                    share(nics["e810-c"]))


def test_dra_partition_claim_shows_its_parent_gpus_health(mig_cluster: NativeCluster) -> None:
    """A 1g.10gb partition, its GPU faulted (a NoExecute taint, tolerated by the claim);
    a whole GPU claimed after it (necessarily another GPU) stays Healthy."""
    partition = {"deviceClassName": "gpu-partition.hwsandbox.dev", "selectors": [{"cel": {
        "expression": f'device.attributes["{DRIVER}"].profile == "1g.10gb"'}}]}
    check_dra_chain(mig_cluster, partition, "aer-fatal",
                    {"deviceClassName": "gpu.hwsandbox.dev"}, unplug=True)


def test_our_device_plugin_reports_a_faulted_gpu_in_the_pod(native_cluster: NativeCluster) -> None:
    check_device_plugin_chain(native_cluster, "health-dp")


# -- the workshop example and its scenario (examples/health) ---------------------------------

EXAMPLE = REPO / "examples" / "health"


def _fault_run(cluster: NativeCluster, scenario: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HWSANDBOX_STATE_DIR=str(cluster.state_dir.parent))
    return subprocess.run([sys.executable, "-m", "sandbox", "fault", "run", str(scenario),
                           "--progress", "0"],
                          capture_output=True, text=True, timeout=120, check=False, env=env)


def test_the_example_scenario_asserts_the_pods_device_health(native_cluster: NativeCluster,
                                                              tmp_path: Path) -> None:
    """examples/health: train.yaml holds gpu0..gpu3 (NUMA 0 of the idle node); the
    scenario's pod expectations hold (exit 0), and with its faults taken out they fail,
    naming the pod and the device (exit 1)."""
    import yaml

    cluster = native_cluster
    wait_until("the default service account", lambda: default_service_account(cluster))
    manifest = yaml.safe_load((EXAMPLE / "train.yaml").read_text())
    container = manifest["spec"]["containers"][0]
    container["image"] = BUSYBOX_REF
    container["resources"]["limits"] = {k: str(v) for k, v in
                                        container["resources"]["limits"].items()}
    cluster.core.create_namespaced_pod(NS, manifest)
    try:
        wait_until("pod train to run", lambda: phase(cluster, "train") == "Running", 120,
                   describe=lambda: events(cluster, "train"))
        wait_until("train's GPUs in its status",
                   lambda: len(resource_health(cluster, "train").get(GPU, {})) == 4, 30)
        held = {_gpu_ids(cluster)[u] for u in resource_health(cluster, "train")[GPU]}
        assert held == {"gpu0", "gpu1", "gpu2", "gpu3"}, held

        proc = _fault_run(cluster, EXAMPLE / "scenario.yaml")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "3 of 3 expectation(s) met" in proc.stdout, proc.stdout

        doc = yaml.safe_load((EXAMPLE / "scenario.yaml").read_text())
        doc["steps"] = [s for s in doc["steps"] if "do" not in s]
        no_fault = tmp_path / "no-fault.yaml"
        no_fault.write_text(yaml.safe_dump(doc))
        proc = _fault_run(cluster, no_fault)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        failed = [line for line in proc.stdout.splitlines() if "FAILED" in line]
        assert len(failed) == 1, proc.stdout
        assert "default/train" in failed[0], failed
        assert "gpu3" in failed[0], failed
    finally:
        cluster.sandbox_cli("fault", "health", cluster.node.name, "gpu3", "healthy")
        delete_object(cluster, "pod", "train")
        wait_until("pod train gone", lambda: not _exists(cluster, "train"), 60)

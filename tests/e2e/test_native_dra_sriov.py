"""The reference DRA driver on an SR-IOV node with the real kubelet (issue 15, items 4 and
the faults): control-plane-only VFs, and a NIC's NoSchedule taint.

``optional_cluster``: profiles/sriov-rdma.yaml (node net-worker: a dual-port ConnectX-6
Dx with RoCE and 4 VFs per port, an InfiniBand ConnectX-7, an E810 with 2 VFs), the DRA
driver with ``--skip-node-operations vf`` (what ``sandbox up --dra-skip-node-operations
vf`` passes) and ``DRAOptionalNodeOperations`` on in every component, no device plugin.

1. Optional node operations, the kubelet half (the scheduler half, and a kubelet with the
   gate off, are in tests/plugins/dra/test_scheduler_alpha.py: the Node's declared features
   patched by hand there). The kubelet declares the feature in ``status.declaredFeatures``
   (component-helpers' nodedeclaredfeatures, GA in 1.37); examples/dra/optional-node-
   operations.yaml applied as a workshop does: the claim gets a VF, the allocation result
   carries ``skipNodeOperations: ["*"]``, and the pod runs although the driver was never
   asked to prepare the claim: no CDI spec, no checkpoint entry, no ``status.devices``
   (the driver writes them on NodePrepareResources), not a word of it in the driver's
   log. Its deletion does not call NodeUnprepareResources either.
2. A NoSchedule taint leaves a running pod running: a pod holds a bandwidth share of the
   ConnectX-6 Dx (an ordinary claim: the kubelet prepares it, CDI spec written);
   ``sandbox fault health … unhealthy --reason port-down`` (its RoCE ports go down) puts
   a ``hwsandbox.dev/unhealthy=port-down:NoSchedule`` taint on its PFs. A new claim for
   that NIC is not allocated (the pod stays Pending, the scheduler says why), the running
   pod keeps running (no eviction: that is NoExecute's, test_native_dra_cdi.py); once the
   NIC is healthy again the pending pod is scheduled.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from cluster import (
    DEVICE_CLASSES,
    DRIVER,
    GROUP,
    NS,
    OPTIONAL_FEATURE_GATES,
    REPO,
    VERSION,
    NativeCluster,
    component_log,
    custom_objects,
    default_service_account,
    delete_object,
    driver_slices,
    events,
    phase,
    pod_manifest,
    read_claim,
    slice_devices,
    wait_until,
)

from sandbox.profile.spec import DeviceSpec
from sandbox.runtimes.native import running
from sandbox.runtimes.record import read_record

EXAMPLE = REPO / "examples" / "dra" / "optional-node-operations.yaml"
FEATURE = "DRAOptionalNodeOperations"  # the kubelet's declared feature: the gate's name
PLURALS = {"DeviceClass": "deviceclasses", "ResourceClaim": "resourceclaims"}
TAINT_KEY = "hwsandbox.dev/unhealthy"


def _create(cluster: NativeCluster, doc: dict[str, Any]) -> None:
    """One object of a manifest, as ``kubectl create`` would; an existing DeviceClass (the
    examples share some) is fine."""
    from kubernetes.client.exceptions import ApiException

    if doc["kind"] == "Pod":
        cluster.core.create_namespaced_pod(NS, doc)
        return
    group, version = doc["apiVersion"].split("/")
    try:
        if doc["kind"] == "DeviceClass":
            custom_objects(cluster).create_cluster_custom_object(group, version,
                                                                 PLURALS[doc["kind"]], doc)
        else:
            custom_objects(cluster).create_namespaced_custom_object(group, version, NS,
                                                                    PLURALS[doc["kind"]], doc)
    except ApiException as exc:
        if not (exc.status == 409 and doc["kind"] == "DeviceClass"):
            raise


def _gone(cluster: NativeCluster, pod: str) -> bool:
    return not any(p.metadata.name == pod for p in cluster.core.list_namespaced_pod(NS).items)


def _prepared(cluster: NativeCluster, uid: str) -> list[str]:
    """What the driver's NodePrepareResources leaves for claim ``uid``: CDI spec files,
    a checkpoint entry."""
    found = [str(p) for p in cluster.layout.cdi.glob(f"*_{uid}.json")]
    checkpoint = cluster.layout.dra / "checkpoint.json"
    if checkpoint.exists() and uid in json.loads(checkpoint.read_text()).get("claims", {}):
        found.append(f"{checkpoint} entry")
    return found


@pytest.fixture
def cluster(optional_cluster: NativeCluster) -> NativeCluster:
    wait_until("the DRA driver's ResourceSlices for the node",
               lambda: bool(slice_devices(optional_cluster)), 60,
               describe=lambda: component_log(optional_cluster, "dra-driver"))
    for doc in yaml.safe_load_all(DEVICE_CLASSES.read_text()):
        _create(optional_cluster, doc)
    wait_until("the default service account", lambda: default_service_account(optional_cluster))
    return optional_cluster


def test_a_control_plane_only_vf_runs_its_pod_without_node_prepare(
        cluster: NativeCluster) -> None:
    record = read_record(cluster.state_dir)
    assert record is not None
    assert record.feature_gates == OPTIONAL_FEATURE_GATES
    assert record.dra_options == ("--skip-node-operations", "vf")
    # The kubelet (gate on) declares the feature; the scheduler checks exactly this list.
    # Read raw: the official client may predate status.declaredFeatures.
    node = json.loads(cluster.core.read_node(cluster.node.name, _preload_content=False).data)
    assert FEATURE in node["status"].get("declaredFeatures", []), node["status"]
    # The VFs, and only they, sit in slices that skip node operations.
    slices = driver_slices(cluster)
    skipping = {d["name"] for s in slices if s["spec"].get("skipNodeOperations") == ["*"]
                for d in s["spec"]["devices"]}  # fmt: skip
    vfs = {n for n, d in slice_devices(cluster).items()
           if d["attributes"]["type"] == {"string": "vf"}}
    assert skipping == vfs, (skipping, vfs)
    assert len(vfs) == 10, vfs  # 2 ports x 4 of the ConnectX-6 Dx, 2 of the E810

    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    [claim_name] = [d["metadata"]["name"] for d in docs if d["kind"] == "ResourceClaim"]
    [pod] = [d["metadata"]["name"] for d in docs if d["kind"] == "Pod"]
    driver_log = cluster.layout.logs / "dra-driver.log"
    log_before = len(driver_log.read_bytes())
    try:
        for doc in docs:
            _create(cluster, doc)
        wait_until(f"pod {pod} to run", lambda: phase(cluster, pod) != "Pending", 120,
                   describe=lambda: events(cluster, pod) + component_log(cluster, "dra-driver")
                   + component_log(cluster, "kubelet", 20))
        assert phase(cluster, pod) == "Running", (events(cluster, pod)
                                                  + component_log(cluster, "kubelet"))
        claim = read_claim(cluster, claim_name)
        uid = claim["metadata"]["uid"]
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (DRIVER, cluster.node.name)
        assert result["device"] in vfs, result
        assert result["skipNodeOperations"] == ["*"], result
        assert [r["name"] for r in claim["status"]["reservedFor"]] == [pod]
        # The kubelet ran the pod without asking the driver: nothing of NodePrepareResources.
        assert _prepared(cluster, uid) == []
        assert "devices" not in claim["status"], claim["status"]  # the driver's report
        new_log = driver_log.read_bytes()[log_before:].decode(errors="replace")
        assert uid not in new_log, new_log
        assert claim_name not in new_log, new_log

        delete_object(cluster, "pod", pod)
        wait_until(f"pod {pod} gone", lambda: _gone(cluster, pod), 60)
        wait_until(f"{claim_name} to be deallocated",
                   lambda: not read_claim(cluster, claim_name).get("status"), 60)
        assert _prepared(cluster, uid) == []
        new_log = driver_log.read_bytes()[log_before:].decode(errors="replace")
        assert uid not in new_log, new_log  # no NodeUnprepareResources either
    finally:
        delete_object(cluster, "pod", pod)
        delete_object(cluster, "resourceclaims", claim_name)
    assert running(cluster.layout, "dra-driver") is not None, "the DRA driver died"


def _roce_nic(cluster: NativeCluster) -> DeviceSpec:
    """The ConnectX-6 Dx: RDMA over Ethernet, so a port-down leaves its netdevs (and the
    bandwidth they report) up."""
    return next(d for d in cluster.node.devices
                if d.nic is not None and d.nic.rdma and d.nic.link_layer == "ethernet")


def _nic_claim(cluster: NativeCluster, name: str, pci: str) -> None:
    _create(cluster, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "nic", "exactly": {
            "deviceClassName": "nic.hwsandbox.dev",
            "selectors": [{"cel": {"expression":
                f'device.attributes["resource.kubernetes.io"].pciBusID == "{pci}"'}}],
            "capacity": {"requests": {"bandwidth": "1G"}},
        }}]}},
    })  # fmt: skip


def _nic_pod(name: str, claim: str) -> dict[str, Any]:
    manifest = pod_manifest(name, "sleep 3600", resources={"claims": [{"name": "nic"}]})
    manifest["spec"]["resourceClaims"] = [{"name": "nic", "resourceClaimName": claim}]
    return manifest


def test_a_no_schedule_taint_keeps_the_running_pod_and_blocks_new_claims(
        cluster: NativeCluster) -> None:
    node, nic = cluster.node.name, _roce_nic(cluster)
    pci = nic.address
    device = f"nic-{pci.replace(':', '-').replace('.', '-')}"
    assert device in slice_devices(cluster), sorted(slice_devices(cluster))
    holder, late = "share-holder", "share-late"

    def taints() -> list[tuple[str, str, str]]:  # (key, value, effect); timeAdded is set too
        return [(t["key"], t.get("value", ""), t["effect"])
                for t in slice_devices(cluster).get(device, {}).get("taints", [])]

    sick = False
    try:
        _nic_claim(cluster, holder, pci)
        cluster.core.create_namespaced_pod(NS, _nic_pod(holder, holder))
        wait_until(f"pod {holder} to run", lambda: phase(cluster, holder) == "Running", 120,
                   describe=lambda: events(cluster, holder) + component_log(cluster, "dra-driver"))
        claim = read_claim(cluster, holder)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["device"] == device, result
        assert "skipNodeOperations" not in result, result
        assert _prepared(cluster, claim["metadata"]["uid"]), "a NIC claim is prepared (CDI)"
        assert taints() == []

        cluster.sandbox_cli("fault", "health", node, nic.id, "unhealthy", "--reason", "port-down")
        sick = True
        wait_until(f"a NoSchedule taint on {device}",
                   lambda: taints() == [(TAINT_KEY, "port-down", "NoSchedule")], 60,
                   describe=lambda: str(taints()) + component_log(cluster, "dra-driver"))
        # The scheduler honours it: a new claim for that NIC is not allocated ...
        _nic_claim(cluster, late, pci)
        cluster.core.create_namespaced_pod(NS, _nic_pod(late, late))
        wait_until(f"the scheduler to refuse {late}",
                   lambda: "FailedScheduling" in events(cluster, late), 60,
                   describe=lambda: events(cluster, late))
        assert "cannot allocate all claims" in events(cluster, late), events(cluster, late)
        assert phase(cluster, late) == "Pending"
        assert not read_claim(cluster, late).get("status", {}).get("allocation")
        # ... while the pod already there keeps running: NoSchedule evicts nothing (the
        # device-taint-eviction controller acts on NoExecute at once, see
        # test_native_dra_cdi.py, and has seen this taint by now: the scheduler has).
        running_pod = cluster.core.read_namespaced_pod(holder, NS)
        assert running_pod.status.phase == "Running"
        assert running_pod.metadata.deletion_timestamp is None
        assert "DeviceTaintManagerEviction" not in events(cluster, holder), events(cluster, holder)
        assert all(c.ready for c in running_pod.status.container_statuses)
        assert read_claim(cluster, holder)["status"]["allocation"]["devices"]["results"][0][
            "device"] == device

        cluster.sandbox_cli("fault", "health", node, nic.id, "healthy")
        sick = False
        wait_until(f"{device}'s taint to go", lambda: taints() == [], 60)
        wait_until(f"pod {late} to be scheduled once {device} is healthy",
                   lambda: phase(cluster, late) == "Running", 120,
                   describe=lambda: events(cluster, late))
        assert phase(cluster, holder) == "Running"
    finally:
        if sick:
            cluster.sandbox_cli("fault", "health", node, nic.id, "healthy")
        for name in (late, holder):
            delete_object(cluster, "pod", name)
        for name in (late, holder):
            wait_until(f"pod {name} gone", lambda n=name: _gone(cluster, n), 60)
            delete_object(cluster, "resourceclaims", name)


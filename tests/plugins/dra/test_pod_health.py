"""Per-pod device health against a REAL kube-apiserver: a pod bound to a node gets the
status a 1.37 kubelet writes (``allocatedResourcesStatus``: a device plugin's GPU
UUID and PCI address, a DRA claim's CDI id with a message), the apiserver validates and
stores it, and ``sandbox.podhealth`` reads it back, mapped onto the profile's device ids,
as ``sandbox status`` and ``sandbox fault run`` use it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from sandbox.cli.status import pod_health_lines, to_json
from sandbox.errors import SandboxError
from sandbox.podhealth import (
    PodHealthLookup,
    read_pod_health,
    read_pods,
    read_sandbox_pod_health,
)
from sandbox.profile import load_profile
from sandbox.profile.spec import Cluster
from sandbox.runtimes.base import NodeStatus, SandboxStatus
from tests.plugins.dra.controlplane import ControlPlane, add_node, control_plane
from tests.support.paths import REPO

pytestmark = [pytest.mark.root, pytest.mark.network]

NODE = "gpu-worker-0"
CDI = "hwsandbox.dev/gpu=88af387d-5d0e-4c1b-9a53-0c9e3c1f2a10-gpu-0000-81-00-0-1g-10gb-0"


@pytest.fixture(scope="module")
def cp() -> Iterator[ControlPlane]:
    with control_plane() as c:
        add_node(c.api(), NODE)
        add_node(c.api(), "gpu-worker-1")
        yield c


@pytest.fixture(scope="module")
def profile() -> Cluster:
    return load_profile(REPO / "profiles" / "workshop-mixed.yaml").cluster


def _train(api: client.ApiClient, cluster: Cluster) -> str:
    """A pod on NODE holding two GPUs by the device plugin and one by a DRA claim, with
    the status a kubelet writes once gpu3 went bad; returns gpu3's UUID."""
    spec = cluster.node(NODE)
    assert spec is not None
    gpu3 = next(d for d in spec.devices if d.id == "gpu3")
    core = client.CoreV1Api(api)
    core.create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train"},
        "spec": {"nodeName": NODE, "resourceClaims": [{"name": "gpu",
                                                       "resourceClaimName": "train-gpu"}],
                 "containers": [{"name": "main", "image": "busybox",
                                 "resources": {"limits": {"nvidia.com/gpu": "2"},
                                               "claims": [{"name": "gpu"}]}},
                                {"name": "side", "image": "busybox"}]}})  # fmt: skip
    core.patch_namespaced_pod_status("train", "default", {"status": {
        "phase": "Running",
        "containerStatuses": [
            {"name": "main", "image": "busybox", "imageID": "", "ready": True,
             "restartCount": 0, "state": {"running": {}},
             "allocatedResourcesStatus": [
                 {"name": "nvidia.com/gpu", "resources": [
                     {"resourceID": gpu3.uuid, "health": "Unhealthy"},
                     {"resourceID": "0000:01:00.0", "health": "Healthy"}]},
                 {"name": "claim:gpu", "resources": [
                     {"resourceID": CDI, "health": "Unknown",
                      "message": "aer-fatal: TOTAL_ERR_FATAL 1"}]}]},
            {"name": "side", "image": "busybox", "imageID": "", "ready": True,
             "restartCount": 0, "state": {"running": {}}}]}})  # fmt: skip
    core.create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "other"},
        "spec": {"nodeName": "gpu-worker-1", "containers": [{"name": "main", "image": "x"}]}})
    return gpu3.uuid


def test_pod_health_read_from_the_api_server(cp: ControlPlane, profile: Cluster) -> None:
    api = cp.api()
    uuid = _train(api, profile)
    # the apiserver refuses an entry naming a resource the container does not request
    with pytest.raises(client.ApiException, match="must match one of the container"):
        client.CoreV1Api(api).patch_namespaced_pod_status("train", "default", {"status": {
            "containerStatuses": [{"name": "side", "image": "busybox", "imageID": "",
                                   "ready": True, "restartCount": 0, "state": {"running": {}},
                                   "allocatedResourcesStatus": [{
                                       "name": "nvidia.com/gpu", "resources": [
                                           {"resourceID": "x", "health": "Healthy"}]}]}]}})
    kubeconfig = str(cp.kubeconfig)
    assert {p["metadata"]["name"] for p in read_pods(kubeconfig)} == {"train", "other"}
    got = read_pod_health(kubeconfig, NODE, profile.node(NODE))
    assert [(h.container, h.resource, h.resource_id, h.health, h.message, h.device)
            for h in got] == [
        ("main", "claim:gpu", CDI, "Unknown", "aer-fatal: TOTAL_ERR_FATAL 1", "gpu2"),
        ("main", "nvidia.com/gpu", "0000:01:00.0", "Healthy", "", "gpu0"),
        ("main", "nvidia.com/gpu", uuid, "Unhealthy", "", "gpu3"),
    ]
    assert {(h.namespace, h.pod, h.node) for h in got} == {("default", "train", NODE)}
    assert read_pod_health(kubeconfig, "gpu-worker-1") == []
    # unmapped without the profile
    assert {h.device for h in read_pod_health(kubeconfig, NODE)} == {""}

    # per sandbox node, as `sandbox status` asks
    by_node = read_sandbox_pod_health(kubeconfig, profile)
    assert by_node[NODE] == got
    assert by_node["gpu-worker-1"] == []  # a pod, no devices
    status = SandboxStatus("s", "native", "workshop-mixed",
                           [NodeStatus(NODE, True), NodeStatus("gpu-worker-1", True)])
    health = {n.name: by_node.get(n.name, []) for n in status.nodes}
    data = to_json(status, health)
    assert [e["device"] for e in data["nodes"][0]["pod_health"]] == ["gpu2", "gpu0", "gpu3"]
    assert data["nodes"][1]["pod_health"] == []
    lines = "\n".join(pod_health_lines(health[NODE]))
    assert "default/train  main       nvidia.com/gpu  gpu3" in lines, lines
    assert "0000:01:00.0" not in lines
    assert "gpu0" not in lines

    # as a fault scenario's pod expectation asks it
    lookup = PodHealthLookup(kubeconfig, profile)
    assert lookup("default", "train", "gpu3") == [(uuid, "Unhealthy")]
    assert lookup("default", "train", "gpu2", "main") == [(CDI, "Unknown")]
    assert lookup("default", "train", "gpu2", "side") == []
    assert lookup("default", "train", uuid) == [(uuid, "Unhealthy")]
    assert lookup("default", "nope", "gpu3") == []


def test_an_unreachable_api_server_is_one_line(tmp_path: Path, cp: ControlPlane) -> None:
    bad = tmp_path / "kubeconfig"
    # the same port on another loopback address: nothing listens there
    bad.write_text(cp.kubeconfig.read_text().replace("https://127.0.0.1:", "https://127.0.0.2:"))
    with pytest.raises(SandboxError) as exc:
        read_pod_health(str(bad), NODE)
    assert str(exc.value).startswith("cannot read pods: ")
    assert "\n" not in str(exc.value)
    with pytest.raises(SandboxError, match="cannot read pods: kubeconfig .*missing"):
        read_pod_health(str(tmp_path / "missing"))

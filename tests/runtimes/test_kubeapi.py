"""``sandbox.kubeapi`` against a REAL kube-apiserver (etcd and kube-apiserver built by
scripts/build-k8s, the native runtime's certificates): what the kind and native runtimes
create and read, as plain JSON, with the errors they act on."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml

from sandbox.errors import RuntimeBackendError, SandboxError
from sandbox.kubeapi import ApiError, Kube, is_ready, labels, name
from sandbox.manifests import find_plugin
from sandbox.runtimes.kind.api import (
    AGENT_NAMESPACE,
    agent_namespace,
    create,
    fail_on_broken_pods,
    kind_nodes,
    scale_coredns_to_zero,
    starting_pods,
)
from sandbox.runtimes.kind.config import NODE_LABEL
from tests.plugins.dra.controlplane import ControlPlane, add_node, control_plane
from tests.support.paths import REPO

pytestmark = [pytest.mark.root, pytest.mark.network]


@pytest.fixture(scope="module")
def cp() -> Iterator[ControlPlane]:
    with control_plane() as c:
        add_node(c.api(), "dra-worker")
        yield c


@pytest.fixture
def api(cp: ControlPlane) -> Iterator[Kube]:
    with Kube.from_kubeconfig(cp.kubeconfig) as kube:
        yield kube


def test_creates_what_the_kind_runtime_deploys(api: Kube) -> None:
    """The agents' namespace (the agents themselves are static pods, written into their
    nodes) and our device plugin's manifest (its ServiceAccount, RBAC and DaemonSet), each
    where discovery says its kind lives."""
    create(api, [agent_namespace()], "agent")
    plugin = [d for d in yaml.safe_load_all(find_plugin("hw-sandbox-device-plugin").text()) if d]
    create(api, plugin, "plugins")
    assert name(api.get(f"/api/v1/namespaces/{AGENT_NAMESPACE}")) == AGENT_NAMESPACE
    for doc in plugin:
        listed = api.get(_path(doc))
        assert listed["kind"] == doc["kind"], listed
        assert name(listed) == doc["metadata"]["name"], listed

    # again: 409, named in the step's one-line error
    with pytest.raises(RuntimeBackendError) as err:
        create(api, [agent_namespace()], "agent")
    assert "creating the agent objects failed" in str(err.value), err.value
    assert "409" in str(err.value), err.value
    assert "already exists" in str(err.value), err.value


def _path(doc: dict[str, object]) -> str:
    version = str(doc["apiVersion"])
    base = f"/api/{version}" if "/" not in version else f"/apis/{version}"
    plural = {"ServiceAccount": "serviceaccounts", "DaemonSet": "daemonsets",
              "ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings",
              "Role": "roles", "RoleBinding": "rolebindings", "ConfigMap": "configmaps",
              "Namespace": "namespaces"}[str(doc["kind"])]
    meta = doc["metadata"]
    assert isinstance(meta, dict)
    if doc["kind"] in ("ClusterRole", "ClusterRoleBinding", "Namespace"):
        return f"{base}/{plural}/{meta['name']}"
    return f"{base}/namespaces/{meta.get('namespace', 'default')}/{plural}/{meta['name']}"


def test_reads_nodes_with_selectors_and_says_ready(api: Kube) -> None:
    nodes = api.items("/api/v1/nodes", labelSelector="kubernetes.io/hostname=dra-worker")
    assert [name(n) for n in nodes] == ["dra-worker"]
    assert labels(nodes[0])["kubernetes.io/hostname"] == "dra-worker"
    assert is_ready(nodes[0])
    assert api.items("/api/v1/nodes", labelSelector="kubernetes.io/hostname=nobody") == []
    assert not is_ready({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert not is_ready({"metadata": {}, "status": {}})


def test_finds_each_replicas_kind_node_in_one_list(api: Kube) -> None:
    """``kind_nodes``: replica -> kind node container, from the nodes carrying the
    sandbox's node label (the kind config sets it on each node's kubelet)."""
    for container, replica in (("sbx-worker", "gpu-a"), ("sbx-worker2", "gpu-b")):
        api.create([{"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": container, "labels": {NODE_LABEL: replica}}}])  # fmt: skip
    assert kind_nodes(api, ["gpu-a", "gpu-b"]) == {"gpu-a": "sbx-worker", "gpu-b": "sbx-worker2"}
    assert kind_nodes(api, ["gpu-b"]) == {"gpu-b": "sbx-worker2"}
    missing = f"^{re.escape(f'no kind node carries {NODE_LABEL}=nobody')}$"
    with pytest.raises(SandboxError, match=missing):
        kind_nodes(api, ["gpu-a", "nobody"])
    with pytest.raises(SandboxError, match=missing):
        kind_nodes(api, ["nobody"])


def test_errors_carry_the_status_and_the_servers_message(api: Kube) -> None:
    with pytest.raises(ApiError) as err:
        api.get("/api/v1/nodes/no-such-node")
    assert err.value.status == 404
    assert str(err.value) == 'GET /api/v1/nodes/no-such-node: 404 nodes "no-such-node" not found'
    with pytest.raises(ApiError) as err:
        api.create([{"apiVersion": "v1", "kind": "NoSuchKind", "metadata": {"name": "x"}}])
    assert "no NoSuchKind in v1" in str(err.value)


def test_scales_coredns_to_zero_by_a_merge_patch(api: Kube) -> None:
    labels_ = {"k8s-app": "kube-dns"}
    api.post("/apis/apps/v1/namespaces/kube-system/deployments", {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "coredns", "namespace": "kube-system"},
        "spec": {"replicas": 2, "selector": {"matchLabels": labels_},
                 "template": {"metadata": {"labels": labels_},
                              "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}})
    scale_coredns_to_zero(api)
    got = api.get("/apis/apps/v1/namespaces/kube-system/deployments/coredns")
    assert got["spec"]["replicas"] == 0


def test_a_crash_looping_pod_fails_its_step_at_once(api: Kube) -> None:
    """As a kubelet reports it (status written through the status subresource); its
    previous log cannot be read here (no kubelet), which leaves the log out."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "broken", "namespace": "default", "labels": {"app": "broken"}},
           "spec": {"nodeName": "dra-worker",
                    "containers": [{"name": "main", "image": "busybox"}]}}
    api.post("/api/v1/namespaces/default/pods", pod)
    fail_on_broken_pods(api, "default", "app=broken", "agent")  # no status yet: not broken
    api.request("PATCH", "/api/v1/namespaces/default/pods/broken/status", {"status": {
        "phase": "Running",
        "containerStatuses": [{"name": "main", "image": "busybox", "imageID": "", "ready": False,
                               "restartCount": 3, "state": {"waiting": {
                                   "reason": "CrashLoopBackOff",
                                   "message": "back-off 40s restarting failed container"}}}]}},
                content_type="application/merge-patch+json")
    with pytest.raises(RuntimeBackendError) as err:
        fail_on_broken_pods(api, "default", "app=broken", "agent")
    assert str(err.value).endswith("pod default/broken on dra-worker: CrashLoopBackOff: "
                                   "back-off 40s restarting failed container"), err.value


def _pod_on(api: Kube, pod: str, node: str, state: dict[str, object] | None,
            finalizers: tuple[str, ...] = ()) -> None:
    api.post("/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod, "namespace": "default", "finalizers": list(finalizers)},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "busybox"}]}})
    if state is not None:  # as the kubelet reports it
        api.request("PATCH", f"/api/v1/namespaces/default/pods/{pod}/status", {"status": {
            "phase": "Running" if "running" in state else "Pending",
            "containerStatuses": [{"name": "main", "image": "busybox", "imageID": "",
                                   "ready": False, "restartCount": 0, "state": state}]}},
            content_type="application/merge-patch+json")


def test_starting_pods_are_those_whose_containers_are_being_made(api: Kube) -> None:
    """What the topology step waits for before it restarts a node's kubelet: pods with no
    container status yet or a container being created; not those running, backing off or
    being deleted, nor another node's."""
    node = "settle-worker"
    _pod_on(api, "running", node, {"running": {"startedAt": "2026-12-08T00:00:00Z"}})
    _pod_on(api, "backoff", node, {"waiting": {"reason": "CrashLoopBackOff"}})
    assert starting_pods(api, node) == []
    _pod_on(api, "creating", node, {"waiting": {"reason": "ContainerCreating"}})
    _pod_on(api, "bound", node, None)
    _pod_on(api, "elsewhere", "other-worker", None)
    _pod_on(api, "leaving", node, None, finalizers=("hw-sandbox.dev/test",))
    api.request("DELETE", "/api/v1/namespaces/default/pods/leaving")
    assert sorted(starting_pods(api, node)) == ["bound", "creating"]
    api.request("PATCH", "/api/v1/namespaces/default/pods/leaving",
                {"metadata": {"finalizers": None}},
                content_type="application/merge-patch+json")


def test_no_typed_client_is_imported(cp: ControlPlane) -> None:
    """The point of the module: reading nodes loads no API class (their models cost
    ~0.5 s of CPU each group)."""
    code = ("import sys; from sandbox.kubeapi import Kube; "
            f"Kube.from_kubeconfig({str(cp.kubeconfig)!r}).items('/api/v1/nodes'); "
            "print(sorted(m for m in sys.modules if m.startswith(('kubernetes.client.api.',"
            " 'kubernetes.client.models.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.strip()
    assert out == "[]", out

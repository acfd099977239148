"""Granular status authorization (issue 15 item 9): the driver with ONLY the permissions
of plugins/manifests/hw-sandbox-dra-driver.yaml, on a real kube-apiserver with RBAC (and
DRAResourceClaimGranularStatusAuthorization, beta and on in 1.37).

Two node-bound service account tokens of the manifest's ServiceAccount (TokenRequest
bound to a Node: the token carries the node's name, as a DaemonSet pod's token does):
the driver of ``dra-worker`` runs as its own process with the first one, publishes its
pool and, through its kubelet plugin (the harness's ``PluginWatcher`` as the kubelet),
prepares a claim allocated on its node and records ``status.devices``. The same identity
bound to ``other-worker`` is refused: writing dra-worker's slices (the manifest's
ValidatingAdmissionPolicy) and its claim's ``status.devices`` (``resourceclaims/driver``
needs ``arbitrary-node:update`` for a claim of another node). Neither may change
``status.allocation`` (``resourceclaims/binding``, the scheduler's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from sandbox.draconfig import driver_config
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.kubelet import Claim, PluginWatcher
from sandbox.profile import load_profile
from sandbox.runtimes.native.configs import SERVICE_ACCOUNT_ISSUER
from tests.plugins.dra.controlplane import ControlPlane, add_node, control_plane
from tests.support.paths import REPO
from tests.support.thirdparty import short_dir

pytestmark = [pytest.mark.root, pytest.mark.network]

MANIFEST = REPO / "plugins/manifests/hw-sandbox-dra-driver.yaml"
DRIVER = "dra.hwsandbox.dev"
GROUP, VERSION, NS = "resource.k8s.io", "v1", "default"
NODE, OTHER = "dra-worker", "other-worker"
NIC = "nic-0000-01-00-0"


@dataclass
class Setup:
    cp: ControlPlane
    admin: client.CustomObjectsApi
    as_me: client.CustomObjectsApi  # the driver's identity, bound to NODE
    as_other: client.CustomObjectsApi  # the same, bound to OTHER
    watcher: PluginWatcher
    proc: subprocess.Popen[bytes]
    log: Path

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            value = check()
            if value:
                return value
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}\n{self.log.read_text()[-3000:]}",
                    pytrace=False)  # fmt: skip


def _apply_rbac(api: client.ApiClient) -> None:
    """The manifest's ServiceAccount, RBAC and admission policy (not the DaemonSet)."""
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    adm = client.AdmissionregistrationV1Api(api)
    create = {"ServiceAccount": lambda d: core.create_namespaced_service_account(
                  d["metadata"]["namespace"], d),
              "ClusterRole": rbac.create_cluster_role,
              "ClusterRoleBinding": rbac.create_cluster_role_binding,
              "ValidatingAdmissionPolicy": adm.create_validating_admission_policy,
              "ValidatingAdmissionPolicyBinding":
                  adm.create_validating_admission_policy_binding}  # fmt: skip
    kinds = [d["kind"] for d in docs if d["kind"] in create]
    assert sorted(kinds) == sorted(create), kinds
    for doc in docs:
        if doc["kind"] in create:
            create[doc["kind"]](doc)


def _kubeconfig(cp: ControlPlane, node: str, path: Path) -> Path:
    """A kubeconfig with a token of the driver's ServiceAccount bound to ``node``."""
    api = cp.api()
    core = client.CoreV1Api(api)
    uid = core.read_node(node).metadata.uid
    meta = next(d for d in yaml.safe_load_all(MANIFEST.read_text())
                if d and d["kind"] == "ServiceAccount")["metadata"]  # fmt: skip
    token = core.create_namespaced_service_account_token(meta["name"], meta["namespace"], {
        "spec": {"expirationSeconds": 3600, "audiences": [SERVICE_ACCOUNT_ISSUER],
                 "boundObjectRef": {"kind": "Node", "apiVersion": "v1", "name": node,
                                    "uid": uid}}}).status.token  # fmt: skip
    kc = yaml.safe_load(cp.kubeconfig.read_text())
    # the admin's kubeconfig with the token for the user its context names, and no
    # client certificate (it would authenticate first, as system:masters)
    context = next(c["context"] for c in kc["contexts"] if c["name"] == kc["current-context"])
    kc["users"] = [{"name": context["user"], "user": {"token": token}}]
    path.write_text(yaml.safe_dump(kc))
    return path


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    spec = load_profile(str(REPO / "tests/data/dra-nic-gpu.yaml")).cluster.node(NODE)
    assert spec is not None
    with control_plane() as cp, short_dir("dra-rbac-") as dirs, \
            tempfile.TemporaryDirectory(prefix="hwsb-rbac-") as tmp:  # fmt: skip
        api = cp.api()
        _apply_rbac(api)
        add_node(api, NODE)
        add_node(api, OTHER)
        render(build_tree(spec), Path(tmp) / "root")
        (Path(tmp) / "config.json").write_text(json.dumps(driver_config(spec)))
        mine = _kubeconfig(cp, NODE, Path(tmp) / "mine.kubeconfig")
        other = _kubeconfig(cp, OTHER, Path(tmp) / "other.kubeconfig")
        for d in ("plugins", "registry", "cdi"):
            (dirs / d).mkdir()
        log = Path(tmp) / "driver.log"
        with PluginWatcher(dirs / "registry") as watcher, log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hwplugins.dra", "--root", str(Path(tmp) / "root"),
                 "--node-name", NODE, "--kubeconfig", str(mine),
                 "--config", str(Path(tmp) / "config.json"),
                 "--plugins-dir", str(dirs / "plugins"), "--registry-dir", str(dirs / "registry"),
                 "--cdi-dir", str(dirs / "cdi"), "--interval", "0.5"],
                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
            s = Setup(cp, client.CustomObjectsApi(api), client.CustomObjectsApi(client_for(mine)),
                      client.CustomObjectsApi(client_for(other)), watcher, proc, log)
            try:
                _wait_policy_enforced(s)
                yield s
            finally:
                proc.terminate()
                proc.wait(15)


def _wait_policy_enforced(setup: Setup, timeout: float = 60) -> None:
    """A ValidatingAdmissionPolicy is enforced only once the apiserver's informers have
    seen it and its binding (seconds after they are created): until then a probe slice of
    another node's driver is admitted. Probe (and delete the probe) until it is refused."""
    probe = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceSlice",
             "metadata": {"name": "policy-probe"},
             "spec": {"driver": DRIVER, "nodeName": NODE, "devices": [],
                      "pool": {"name": "policy-probe", "generation": 1,
                               "resourceSliceCount": 1}}}  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            setup.as_other.create_cluster_custom_object(GROUP, VERSION, "resourceslices", probe)
        except ApiException as exc:
            if "may only write ResourceSlices" in (exc.body or ""):
                return
            raise
        setup.admin.delete_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                                 "policy-probe")
        time.sleep(0.5)
    pytest.fail(f"the admission policy was not enforced within {timeout:.0f}s")


def client_for(kubeconfig: Path) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(kubeconfig))


def _slices(api: client.CustomObjectsApi) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = api.list_cluster_custom_object(
        GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={NODE}")["items"]
    return items


def _published(setup: Setup) -> list[dict[str, Any]]:
    """The driver's slices of NODE once one of them lists the NIC (it writes its slices
    one by one: the first may be listed before the NIC's is)."""
    def nic_listed() -> list[dict[str, Any]]:
        slices = _slices(setup.admin)
        found = any(d["name"] == NIC for s in slices for d in s["spec"].get("devices", []))
        return slices if found else []

    slices: list[dict[str, Any]] = setup.wait(f"the driver's slices listing {NIC}", nic_listed)
    return slices


def test_the_driver_publishes_its_own_nodes_slices_only(setup: Setup) -> None:
    slices = _published(setup)
    forged = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceSlice",
              "metadata": {"name": "forged"},
              "spec": {"driver": DRIVER, "nodeName": NODE, "devices": [],
                       "pool": {"name": NODE, "generation": 99,
                                "resourceSliceCount": 1}}}  # fmt: skip
    with pytest.raises(ApiException) as refused:
        setup.as_other.create_cluster_custom_object(GROUP, VERSION, "resourceslices", forged)
    assert refused.value.status in (403, 422)
    message = json.loads(refused.value.body)["message"]
    assert f"the DRA driver of node '{OTHER}' may only write ResourceSlices" in message
    victim = slices[0]["metadata"]["name"]
    with pytest.raises(ApiException) as refused:
        setup.as_other.delete_cluster_custom_object(GROUP, VERSION, "resourceslices", victim)
    assert "may only write ResourceSlices of that node" in json.loads(refused.value.body)[
        "message"]


def test_status_devices_only_from_the_claims_node(setup: Setup) -> None:
    _published(setup)
    claim = setup.admin.create_namespaced_custom_object(GROUP, VERSION, NS, "resourceclaims", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
        "metadata": {"name": "nic"},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {
            "deviceClassName": "nic.hwsandbox.dev"}}]}}})  # fmt: skip
    claim["status"] = {"allocation": {  # as the scheduler would write it (admin here)
        "devices": {"results": [{"request": "r", "driver": DRIVER, "pool": NODE,
                                 "device": NIC}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}}  # fmt: skip
    setup.admin.replace_namespaced_custom_object_status(GROUP, VERSION, NS, "resourceclaims",
                                                        "nic", claim)  # fmt: skip
    uid = claim["metadata"]["uid"]
    setup.watcher.wait_registered(DRIVER, 15)
    prepared = setup.watcher.prepare(DRIVER, [Claim(NS, uid, "nic")])[uid]
    assert prepared.error == ""

    def get() -> dict[str, Any]:
        got: dict[str, Any] = setup.admin.get_namespaced_custom_object(
            GROUP, VERSION, NS, "resourceclaims", "nic")
        return got

    [status] = setup.wait("status.devices", lambda: get()["status"].get("devices"))
    assert (status["driver"], status["pool"], status["device"]) == (DRIVER, NODE, NIC)
    assert [(c["type"], c["status"]) for c in status["conditions"]] == [("Ready", "True")]
    assert status["networkData"]["interfaceName"]
    assert "writing status.devices failed" not in setup.log.read_text()

    current = get()
    current["status"]["devices"][0]["conditions"][0]["message"] = "forged by another node"
    with pytest.raises(ApiException) as refused:
        setup.as_other.replace_namespaced_custom_object_status(
            GROUP, VERSION, NS, "resourceclaims", "nic", current)
    message = json.loads(refused.value.body)["message"]
    assert refused.value.status == 422
    assert 'changing status.devices requires resource="resourceclaims/driver"' in message
    assert "[arbitrary-node:update]" in message, message
    current = get()
    current["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-0000-02-00-0"
    with pytest.raises(ApiException) as refused:
        setup.as_me.replace_namespaced_custom_object_status(GROUP, VERSION, NS, "resourceclaims",
                                                     "nic", current)  # fmt: skip
    message = json.loads(refused.value.body)["message"]
    assert 'status.allocation or status.reservedFor requires resource="resourceclaims/binding"' \
        in message, message

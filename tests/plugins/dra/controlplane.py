"""A real Kubernetes control plane for the DRA tests: etcd, kube-apiserver and, on request,
kube-scheduler and kube-controller-manager (only its resourceclaim controller: it turns
ResourceClaimTemplates into claims; node lifecycle would taint our kubelet-less Node).

``sandbox.runtimes.native`` starts a whole node (containerd, kubelet) in one go and needs
root-wide state; these tests need only the API side, several times with different feature
gates, so this fixture starts the processes itself, with the native runtime's certificates
(``pki.make_pki``; clients use the admin kubeconfig, system:masters) and its command lines
(``configs``). Binaries come from ``scripts/build-k8s``; a missing one FAILS the test with
that hint. Every process is stopped and every file removed on exit.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from sandbox.runtimes.native.common import bin_dir, free_ports
from sandbox.runtimes.native.configs import (
    apiserver_argv,
    etcd_argv,
    gate_flags,
    scheduler_argv,
)
from sandbox.runtimes.native.pki import make_pki, write_kubeconfig

HINT = "run scripts/build-k8s (builds kube-apiserver, kube-scheduler, ... and etcd)"
# make_pki's kubelet certificate is for this node; no kubelet runs here to use it
NODE = "dra-worker"


def _free_port() -> int:
    return free_ports(("one",))["one"]


@dataclass
class ControlPlane:
    dir: Path
    kubeconfig: Path
    gates: Mapping[str, bool]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def api(self) -> client.ApiClient:
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def log(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def start_scheduler(self, gates: Mapping[str, bool]) -> None:
        """(Re)start kube-scheduler with ``gates`` (the apiserver keeps its own): version
        skew between the components, as in a cluster being upgraded."""
        old = self.procs.pop("kube-scheduler", None)
        if old is not None:
            _stop(old)
        # --v=2: why a pod did not fit ("Unable to schedule pod; no fit"), so that a claim
        # that is never allocated leaves its reason in the log a failed wait shows
        _spawn(self, "kube-scheduler",
               [*scheduler_argv(bin_dir(), self.kubeconfig, _free_port(), gates), "--v=2"])

    def check_running(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited ({proc.returncode}):\n{self.log(name)}",
                            pytrace=False)  # fmt: skip


def _spawn(cp: ControlPlane, name: str, argv: list[str]) -> None:
    log = (cp.dir / f"{name}.log").open("wb")
    cp.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)  # fmt: skip
    log.close()


def _wait(cp: ControlPlane, what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cp.check_running()
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.3)
    pytest.fail(f"{what} not ready after {timeout:.0f}s", pytrace=False)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def control_plane(gates: Mapping[str, bool] | None = None,
                  scheduler: bool = False) -> Iterator[ControlPlane]:  # fmt: skip
    b = bin_dir()
    needed = ["etcd", "kube-apiserver"] + (
        ["kube-scheduler", "kube-controller-manager"] if scheduler else [])
    missing = [n for n in needed if not (b / n).is_file()]
    if missing:
        pytest.fail(f"missing {', '.join(missing)} in {b}: {HINT}", pytrace=False)
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed: apt-get install openssl", pytrace=False)
    d = Path(tempfile.mkdtemp(prefix="hwsb-cp-", dir="/tmp"))
    cp = ControlPlane(d, d / "kubeconfig", dict(gates or {}))
    try:
        pki = d / "pki"
        make_pki(pki, NODE, "127.0.0.1")
        port, etcd, peer = free_ports(("apiserver", "etcd", "peer")).values()
        write_kubeconfig(cp.kubeconfig, f"https://127.0.0.1:{port}", pki, "admin", "hw-sandbox")
        _spawn(cp, "etcd", etcd_argv(b, d / "etcd", etcd, peer))
        _spawn(cp, "kube-apiserver", [
            *apiserver_argv(b, pki, etcd, port, d / "certs", cp.gates),
            "--bind-address=127.0.0.1", "--endpoint-reconciler-type=none",
            "--authorization-mode=RBAC",
            # No serviceaccount controller runs: pods must not need the default SA.
            "--disable-admission-plugins=ServiceAccount",
        ])  # fmt: skip
        api = cp.api()

        def ready() -> bool:
            return bool(client.VersionApi(api).get_code().git_version)

        _wait(cp, "kube-apiserver", ready, 90)
        _wait(cp, "resource.k8s.io/v1", lambda: client.ResourceV1Api(api)
              .list_device_class() is not None, 30)  # fmt: skip
        # The apiserver's own controller creates `default` a moment after /version answers;
        # a test creating a pod there first would get 404 "namespaces default not found".
        _wait(cp, "namespace default", lambda: client.CoreV1Api(api)
              .read_namespace("default") is not None, 30)  # fmt: skip
        if scheduler:
            cp.start_scheduler(cp.gates)
            _spawn(cp, "kube-controller-manager", [
                str(b / "kube-controller-manager"), f"--kubeconfig={cp.kubeconfig}",
                f"--authentication-kubeconfig={cp.kubeconfig}",
                f"--authorization-kubeconfig={cp.kubeconfig}",
                "--bind-address=127.0.0.1", f"--secure-port={_free_port()}",
                "--leader-elect=false", "--controllers=resourceclaim-controller",
                *gate_flags(cp.gates),
            ])  # fmt: skip
            time.sleep(1)
            cp.check_running()
        yield cp
    finally:
        for proc in reversed(list(cp.procs.values())):
            _stop(proc)
        shutil.rmtree(d, ignore_errors=True)


def add_node(api: client.ApiClient, name: str, declared_features: list[str] | None = None) -> None:
    """A Node object with room for pods and no kubelet behind it: enough for scheduling.
    ``declared_features``: what a kubelet would report in ``status.declaredFeatures`` (a
    1.37 kubelet lists the node features it has enabled, e.g. DRAOptionalNodeOperations)."""
    core = client.CoreV1Api(api)
    res = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    core.create_node({"apiVersion": "v1", "kind": "Node",
                      "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
    core.patch_node_status(name, {"status": {
        "capacity": res, "allocatable": res,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Fake",
                        "message": "no kubelet: scheduling only"}],
        "declaredFeatures": declared_features or []}})  # fmt: skip
    # The apiserver's admission marks a new node not-ready; no node lifecycle controller
    # runs here to clear that taint (nor to add it back).
    core.patch_node(name, {"spec": {"taints": None}})


def apply_file(api: client.ApiClient, path: Path, namespace: str = "default") -> None:
    """Create every object of a YAML file (DeviceClasses, claims, templates, Pods)."""
    objects = client.CustomObjectsApi(api)
    plurals = {"DeviceClass": "deviceclasses", "ResourceClaimTemplate": "resourceclaimtemplates",
               "ResourceClaim": "resourceclaims"}  # fmt: skip
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["kind"] == "Pod":
            client.CoreV1Api(api).create_namespaced_pod(namespace, doc)
            continue
        group, version = doc["apiVersion"].split("/")
        plural = plurals[doc["kind"]]
        if doc["kind"] == "DeviceClass":
            objects.create_cluster_custom_object(group, version, plural, doc)
        else:
            objects.create_namespaced_custom_object(group, version, namespace, plural, doc)

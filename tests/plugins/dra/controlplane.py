"""A real Kubernetes control plane for the DRA tests: etcd, kube-apiserver and, on request,
kube-scheduler and kube-controller-manager (only its resourceclaim controller: it turns
ResourceClaimTemplates into claims; node lifecycle would taint our kubelet-less Node).

``sandbox.runtimes.native`` starts a whole node (containerd, kubelet) in one go and needs
root-wide state; these tests need only the API side, several times with different feature
gates, so this fixture is its own. Binaries come from ``scripts/build-k8s``; a missing one
FAILS the test with that hint. Certificates: a throwaway CA (``openssl``) signs the
apiserver's serving cert; clients authenticate with a static token (system:masters).
Every process is stopped and every file removed on exit.
"""

from __future__ import annotations

import contextlib
import os
import secrets
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

from sandbox.runtimes.native.common import free_ports

VERSION = os.environ.get("HWSANDBOX_K8S_VERSION", "1.37.2")
HINT = "run scripts/build-k8s (builds kube-apiserver, kube-scheduler, ... and etcd)"


def bin_dir() -> Path:
    override = os.environ.get("HWSANDBOX_K8S_BIN")
    if override:
        return Path(override)
    cache = Path(os.environ.get("HWSANDBOX_CACHE", str(Path.home() / ".cache" / "hw-sandbox")))
    return cache / "k8s" / f"v{VERSION}" / "bin"


def _free_port() -> int:
    return free_ports(("one",))["one"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _pki(d: Path) -> None:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"),
             "-subj", "/CN=hwsb-dra-test-ca", "-days", "2",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,digitalSignature")  # fmt: skip
    _openssl("req", *ec, "-keyout", str(d / "server.key"), "-out", str(d / "server.csr"),
             "-subj", "/CN=localhost")  # fmt: skip
    (d / "ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                           "extendedKeyUsage=serverAuth\n")  # fmt: skip
    _openssl("x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.crt"),
             "-CAkey", str(d / "ca.key"), "-set_serial", "0x" + secrets.token_hex(8),
             "-days", "2", "-extfile", str(d / "ext"), "-out", str(d / "server.crt"))  # fmt: skip
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(d / "sa.key"))  # fmt: skip
    _openssl("pkey", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub"))


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
        kc = str(self.kubeconfig)
        _spawn(self, "kube-scheduler", [
            str(bin_dir() / "kube-scheduler"), f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={_free_port()}",
            "--leader-elect=false", *_gate_args(gates),
        ])  # fmt: skip

    def check_running(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited ({proc.returncode}):\n{self.log(name)}",
                            pytrace=False)  # fmt: skip


def _gate_args(gates: Mapping[str, bool]) -> list[str]:
    flag = ",".join(f"{k}={str(v).lower()}" for k, v in sorted(gates.items()))
    return [f"--feature-gates={flag}"] if flag else []


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
        _pki(d)
        token = secrets.token_hex(16)
        (d / "tokens.csv").write_text(f"{token},admin,admin-uid,system:masters\n")
        port, etcd, peer = free_ports(("apiserver", "etcd", "peer")).values()
        cp.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {
                "server": f"https://127.0.0.1:{port}",
                "certificate-authority": str(d / "ca.crt")}}],
            "users": [{"name": "t", "user": {"token": token}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
        }))  # fmt: skip
        gate_args = _gate_args(cp.gates)
        _spawn(cp, "etcd", [
            str(b / "etcd"), "--data-dir", str(d / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level", "warn",
        ])  # fmt: skip
        _spawn(cp, "kube-apiserver", [
            str(b / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd}",
            "--bind-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--secure-port={port}", f"--cert-dir={d / 'certs'}",
            f"--tls-cert-file={d / 'server.crt'}", f"--tls-private-key-file={d / 'server.key'}",
            f"--token-auth-file={d / 'tokens.csv'}", "--authorization-mode=RBAC",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.0.0.0/24",
            # No serviceaccount controller runs: pods must not need the default SA.
            "--disable-admission-plugins=ServiceAccount", "--profiling=false",
            "--allow-privileged=true",
            *gate_args,
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
                "--leader-elect=false", "--controllers=resourceclaim-controller", *gate_args,
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

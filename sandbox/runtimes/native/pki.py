"""The sandbox's certificates (``openssl`` CLI) and kubeconfigs."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path

import yaml

from sandbox.commands import run
from sandbox.runtimes.native.common import SERVICE_IP


def _openssl(*args: str) -> None:
    run(["openssl", *args])


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(path))
    path.chmod(0o600)


def _issue(pki: Path, name: str, subject: str, usage: str, sans: Sequence[str] = ()) -> None:
    """``name.key`` + ``name.crt`` signed by the sandbox CA."""
    key, csr, crt, ext = (pki / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    _new_key(key)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    lines = [
        "[v3]",
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if sans:
        lines.append("subjectAltName=" + ",".join(sans))
    ext.write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey",
             str(pki / "ca.key"), "-set_serial", "0x" + secrets.token_hex(16), "-days", "365",
             "-extfile", str(ext), "-extensions", "v3", "-out", str(crt))
    csr.unlink()
    ext.unlink()


def make_pki(pki: Path, node: str, host_ip: str) -> None:
    pki.mkdir(parents=True, exist_ok=True, mode=0o700)
    _new_key(pki / "ca.key")
    _openssl("req", "-x509", "-new", "-key", str(pki / "ca.key"), "-subj", "/CN=hw-sandbox-ca",
             "-days", "3650", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
             "-out", str(pki / "ca.crt"))
    sans = ["DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local", "DNS:localhost", "IP:127.0.0.1",
            f"IP:{SERVICE_IP}", f"IP:{host_ip}"]
    _issue(pki, "apiserver", "/CN=kube-apiserver", "serverAuth", sans)
    _issue(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
           "clientAuth")
    _issue(pki, "admin", "/O=system:masters/CN=kubernetes-admin", "clientAuth")
    _issue(pki, "controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
    _issue(pki, "scheduler", "/CN=system:kube-scheduler", "clientAuth")
    _issue(pki, "kubelet", f"/O=system:nodes/CN=system:node:{node}", "clientAuth")
    _new_key(pki / "sa.key")
    _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def write_kubeconfig(path: Path, server: str, pki: Path, user: str, cluster: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {
            "server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": user, "user": {
            "client-certificate": str(pki / f"{user}.crt"),
            "client-key": str(pki / f"{user}.key")}}],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": user}}],
        "current-context": cluster,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)

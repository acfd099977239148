"""The ``kind`` runtime: one kind node per profile node replica, fake hardware inside each.

Steps of ``up`` (each named in errors): config (``kindconfig``), cluster (``kind create
cluster``), image (build the sandbox image with the Docker SDK and ``kind load`` it),
agent (a privileged DaemonSet per replica that mounts the replica's FUSE tree at
/var/lib/hw-sandbox/root and creates its device nodes in the node's /dev), plugins (our
reference device plugin). The node image comes from ``SANDBOX_KIND_IMAGE`` (kind's
default otherwise); nothing is pulled by the sandbox itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from sandbox.catalog import find_plugin
from sandbox.errors import CommandError, RuntimeBackendError, SandboxError
from sandbox.profile.resolve import Cluster
from sandbox.runtimes.base import (
    NodeStatus,
    Progress,
    ResourceStatus,
    SandboxStatus,
    read_record,
    write_record,
)
from sandbox.runtimes.kindconfig import NODE_LABEL, kind_config_text

IMAGE = "hw-sandbox:latest"
AGENT_NAMESPACE = "hw-sandbox"
ROOT_IN_NODE = "/var/lib/hw-sandbox/root"


def _run(argv: list[str], step: str, *, input_text: str | None = None,
         env: dict[str, str] | None = None, timeout: float = 900) -> str:
    try:
        result = subprocess.run(argv, input=input_text, capture_output=True, text=True,
                                check=False, env=env, timeout=timeout)
    except FileNotFoundError as exc:
        raise RuntimeBackendError(step, f"{argv[0]} not found") from exc
    if result.returncode != 0:
        err = CommandError(argv, result.returncode, result.stdout + result.stderr)
        raise RuntimeBackendError(step, str(err)) from err
    return result.stdout


def agent_manifests(cluster: Cluster, profile_text: str) -> list[dict[str, Any]]:
    """Namespace, profile ConfigMap and one agent DaemonSet per node replica."""
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": AGENT_NAMESPACE}},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": "hw-sandbox-profile", "namespace": AGENT_NAMESPACE},
         "data": {"profile.yaml": profile_text}},
    ]
    for node in cluster.nodes:
        name = f"agent-{node.name}"
        docs.append({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": name, "namespace": AGENT_NAMESPACE,
                         "labels": {"app.kubernetes.io/part-of": "hw-sandbox"}},
            "spec": {
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {
                        "nodeSelector": {NODE_LABEL: node.name},
                        "hostPID": False,
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [{
                            "name": "agent", "image": IMAGE, "imagePullPolicy": "Never",
                            "command": ["python3", "-m", "sandbox", "mount",
                                        "/etc/hw-sandbox/profile.yaml", "--node", node.name,
                                        ROOT_IN_NODE, "--state-dir", "/var/lib/hw-sandbox",
                                        "--dev-dir", "/host-dev"],
                            "env": [{"name": "HWSANDBOX_IN_NODE", "value": "1"}],
                            "securityContext": {"privileged": True},
                            "volumeMounts": [
                                {"name": "state", "mountPath": "/var/lib/hw-sandbox",
                                 "mountPropagation": "Bidirectional"},
                                {"name": "dev", "mountPath": "/host-dev"},
                                {"name": "profile", "mountPath": "/etc/hw-sandbox"},
                            ],
                        }],
                        "volumes": [
                            {"name": "state", "hostPath": {"path": "/var/lib/hw-sandbox",
                                                           "type": "DirectoryOrCreate"}},
                            {"name": "dev", "hostPath": {"path": "/dev"}},
                            {"name": "profile", "configMap": {"name": "hw-sandbox-profile"}},
                        ],
                    },
                },
            },
        })
    return docs


def dockerfile() -> str:
    """The sandbox image: the package with its FUSE and gRPC dependencies."""
    return (
        "FROM python:3.11-slim-bookworm\n"
        "RUN apt-get update && apt-get install -y --no-install-recommends fuse3 libfuse3-dev "
        "pkg-config gcc && rm -rf /var/lib/apt/lists/*\n"
        "COPY . /src\n"
        "RUN pip install --no-cache-dir /src\n"
    )


class KindRuntime:
    name = "kind"

    def unavailable_reason(self) -> str | None:
        if shutil.which("kind") is None:
            return "no kind binary (go install sigs.k8s.io/kind@v0.30.0)"
        try:
            import docker

            client = docker.from_env(timeout=3)
            client.ping()
        except Exception as exc:  # noqa: BLE001 - any failure means: no usable daemon
            return f"no Docker daemon reachable ({type(exc).__name__})"
        image = os.environ.get("SANDBOX_KIND_IMAGE")
        if image:
            try:
                client.images.get(image)
            except Exception:  # noqa: BLE001
                return f"SANDBOX_KIND_IMAGE={image} is not present locally"
        return None

    def up(self, cluster: Cluster, profile_path: str, state_dir: Path,
           progress: Progress) -> None:
        name = state_dir.name
        record: dict[str, Any] = {"name": name, "runtime": self.name, "profile": profile_path,
                                  "created": time.time(), "nodes": {}}
        for node in cluster.nodes:
            d = state_dir / "nodes" / node.name
            d.mkdir(parents=True, exist_ok=True)
            record["nodes"][node.name] = {"root": str(d / "root"),
                                          "socket": str(d / "control.sock")}
        write_record(state_dir, record)
        config = state_dir / "kind-config.yaml"
        config.write_text(kind_config_text(cluster, name, state_dir,
                                           os.environ.get("SANDBOX_KIND_IMAGE")))
        kubeconfig = state_dir / "kubeconfig"
        progress(f"creating kind cluster {name} ({len(cluster.nodes)} node(s))")
        _run(["kind", "create", "cluster", "--name", name, "--config", str(config),
              "--kubeconfig", str(kubeconfig), "--wait", "120s"], "cluster")
        record["kubeconfig"] = str(kubeconfig)
        write_record(state_dir, record)
        progress("building the sandbox image")
        self._build_image(progress)
        _run(["kind", "load", "docker-image", IMAGE, "--name", name], "image")
        progress("deploying the fake-hardware agent")
        docs = agent_manifests(cluster, Path(profile_path).read_text())
        self._apply(kubeconfig, yaml.safe_dump_all(docs), "agent")
        progress("deploying the reference device plugin")
        self._apply(kubeconfig, find_plugin("hw-sandbox-device-plugin").text(), "plugins")

    def _build_image(self, progress: Progress) -> None:
        import docker

        root = Path(__file__).resolve().parents[2]
        with tempfile.TemporaryDirectory() as ctx:
            shutil.copytree(root, Path(ctx) / "src", ignore=shutil.ignore_patterns(
                ".git", ".tox", "__pycache__", "*.egg-info", ".venv", "build"))
            (Path(ctx) / "src" / "Dockerfile.sandbox").write_text(dockerfile())
            try:
                docker.from_env().images.build(path=str(Path(ctx) / "src"),
                                               dockerfile="Dockerfile.sandbox", tag=IMAGE, rm=True)
            except Exception as exc:  # noqa: BLE001 - docker raises many types
                raise RuntimeBackendError("image", f"docker build failed: {exc}") from exc

    def _apply(self, kubeconfig: Path, text: str, step: str) -> None:
        _run(["kubectl", "--kubeconfig", str(kubeconfig), "apply", "-f", "-"], step,
             input_text=text)

    def down(self, state_dir: Path, progress: Progress) -> None:
        progress(f"deleting kind cluster {state_dir.name}")
        _run(["kind", "delete", "cluster", "--name", state_dir.name], "delete")
        shutil.rmtree(state_dir, ignore_errors=True)

    def status(self, state_dir: Path) -> SandboxStatus:
        record = read_record(state_dir) or {}
        out = SandboxStatus(state_dir.name, self.name, record.get("profile", "?"))
        kubeconfig = record.get("kubeconfig")
        if not kubeconfig:
            return out
        raw = _run(["kubectl", "--kubeconfig", kubeconfig, "get", "nodes", "-o", "json"],
                   "status")
        for item in json.loads(raw).get("items", []):
            labels = item["metadata"].get("labels", {})
            node = NodeStatus(labels.get(NODE_LABEL, item["metadata"]["name"]), ready=any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in item["status"].get("conditions", [])))
            cap, alloc = item["status"].get("capacity", {}), item["status"].get("allocatable", {})
            for res, value in sorted(cap.items()):
                if "/" in res and not res.startswith(("hugepages-", "kubernetes.io/")):
                    node.resources.append(ResourceStatus(res, int(value), int(alloc.get(res, 0))))
            out.nodes.append(node)
        return out

    def restart_kubelet(self, state_dir: Path, node: str) -> None:
        target = self._kind_node_for(state_dir, node)
        _run(["docker", "exec", target, "systemctl", "restart", "kubelet"], "restart-kubelet")

    def _kind_node_for(self, state_dir: Path, node: str) -> str:
        record = read_record(state_dir) or {}
        kubeconfig = record.get("kubeconfig")
        if not kubeconfig:
            raise SandboxError(f"sandbox {state_dir.name!r} has no kubeconfig")
        out = _run(["kubectl", "--kubeconfig", kubeconfig, "get", "nodes", "-l",
                    f"{NODE_LABEL}={node}", "-o", "jsonpath={.items[0].metadata.name}"],
                   "restart-kubelet")
        if not out:
            raise SandboxError(f"no kind node carries {NODE_LABEL}={node}")
        return out

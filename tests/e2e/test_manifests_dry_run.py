"""Every manifest the sandbox ships or generates is accepted by the real API server.

Server-side dry run (`kubectl apply --dry-run=server`) runs admission and validation in
kube-apiserver without persisting anything: the bundled plugin manifests, the templates
`sandbox plugins template` fills for a plugin author's own image and, for every shipped
profile, the kind runtime's agent manifests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from cluster import NativeCluster

from sandbox.manifests import PLUGINS, plugin_template
from sandbox.profile import load_profile
from sandbox.runtimes.kind.api import agent_manifests
from sandbox.runtimes.native import bin_dir

REPO = Path(__file__).resolve().parents[2]
PROFILES = sorted((REPO / "profiles").glob("*.yaml"))


def _dry_run(cluster: NativeCluster, text: str) -> str:
    kubectl = bin_dir() / "kubectl"
    if not kubectl.is_file():
        pytest.fail(f"{kubectl} missing: run scripts/build-k8s")
    result = subprocess.run(
        [str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "apply", "--dry-run=server",
         "-f", "-"], input=text, text=True, capture_output=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("plugin", PLUGINS, ids=lambda p: p.name)
def test_bundled_manifest_passes_server_side_validation(native_cluster: NativeCluster,
                                                        plugin: object) -> None:
    text = plugin.text()  # type: ignore[attr-defined]
    out = _dry_run(native_cluster, text)
    kinds = [d["kind"] for d in yaml.safe_load_all(text) if d]
    assert out.count("(server dry run)") == len(kinds)


@pytest.mark.parametrize("dra", [False, True], ids=["device-plugin", "dra-driver"])
def test_plugin_template_passes_server_side_validation(native_cluster: NativeCluster,
                                                        dra: bool) -> None:
    """Both templates, filled as `sandbox plugins template` fills them (the DRA one in
    another namespace than kube-system, so the namespace is written everywhere it must)."""
    namespace = "hw-sandbox" if dra else "kube-system"
    if dra:
        _dry_run_create_namespace(native_cluster)
    text = plugin_template("registry.example.com/acme/my_plugin:v1.2", namespace=namespace,
                           command=["/usr/bin/my-plugin"], args=["-v", "5", "a b"], dra=dra)
    out = _dry_run(native_cluster, text)
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert out.count("(server dry run)") == len(docs) == (4 if dra else 1), out
    assert "daemonset.apps/my-plugin created (server dry run)" in out, out
    assert {d["metadata"].get("namespace", namespace) for d in docs} == {namespace}


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_agent_manifests_pass_server_side_validation(native_cluster: NativeCluster,
                                                     profile: Path) -> None:
    cluster = load_profile(profile).cluster
    docs = agent_manifests(cluster)
    # The namespace must exist for the namespaced objects to be dry-run against it.
    _dry_run_create_namespace(native_cluster)
    out = _dry_run(native_cluster, yaml.safe_dump_all(docs[1:]))
    assert out.count("(server dry run)") == len(docs) - 1
    # the agents are static pods: the kubelet creates their mirror pods through the API
    assert out.count("pod/agent-") == len(cluster.nodes), out


def _dry_run_create_namespace(cluster: NativeCluster) -> None:
    kubectl = bin_dir() / "kubectl"
    subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "create",
                    "namespace", "hw-sandbox"], capture_output=True, check=False, timeout=60)

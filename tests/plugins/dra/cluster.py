"""A scheduling cluster for the DRA tests: a real control plane (``controlplane``), Node
objects standing in for kubelets, and our driver as its own process per node publishing
that node's pool from a rendered tree (``--no-kubelet-plugin``: allocation needs no
kubelet; the scheduler writes ``status.allocation`` and binds the pod, which never runs).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from sandbox.draconfig import driver_config
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import load_profile
from tests.plugins.dra.controlplane import ControlPlane, add_node, apply_file, control_plane
from tests.support.paths import REPO

GROUP, VERSION, NS = "resource.k8s.io", "v1", "default"
DRIVER = "dra.hwsandbox.dev"


@dataclass(frozen=True)
class Node:
    profile: str  # relative to the repository; the node of that name in it
    driver_args: Sequence[str] = ()
    declared_features: Sequence[str] = ()
    edit_config: Callable[[dict[str, Any]], None] | None = None  # on driver_config(node)


@dataclass
class Cluster:
    cp: ControlPlane
    api: client.ApiClient
    objects: client.CustomObjectsApi
    core: client.CoreV1Api
    drivers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    roots: dict[str, Path] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)  # each node's driver output

    def claim(self, name: str, request: dict[str, Any] | None = None, *,
              requests: list[dict[str, Any]] | None = None,
              constraints: list[dict[str, Any]] | None = None) -> None:  # fmt: skip
        """A ResourceClaim: one request ``r`` asking ``exactly`` for ``request``, or the
        given ``requests`` (each with its name and ``exactly`` or ``firstAvailable``)."""
        devices: dict[str, Any] = {"requests": requests or [{"name": "r", "exactly": request}]}
        if constraints:
            devices["constraints"] = constraints
        self.objects.create_namespaced_custom_object(GROUP, VERSION, NS, "resourceclaims", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
            "metadata": {"name": name}, "spec": {"devices": devices},
        })  # fmt: skip

    def pod(self, name: str, node: str, claim: str | None = None,
            template: str | None = None, claims: Sequence[str] = ()) -> None:  # fmt: skip
        """A pod on ``node`` using ``claim``, a claim from ``template``, or all ``claims``
        (the scheduler allocates a pod's claims in one scheduling cycle)."""
        if claims:
            refs = [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
        else:
            ref = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template}
            refs = [{"name": "c0", **ref}]
        self.core.create_namespaced_pod(NS, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "resourceClaims": refs,
                "containers": [{"name": "main", "image": "registry.invalid/pause:never-pulled",
                                "resources": {"claims": [{"name": r["name"]} for r in refs]}}],
            },
        })  # fmt: skip

    def get_claim(self, name: str) -> dict[str, Any]:
        claim: dict[str, Any] = self.objects.get_namespaced_custom_object(
            GROUP, VERSION, NS, "resourceclaims", name)
        return claim

    def allocation(self, claim: str) -> dict[str, Any] | None:
        alloc: dict[str, Any] | None = (self.get_claim(claim).get("status") or {}).get(
            "allocation")
        return alloc

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.cp.check_running()
            for proc in self.drivers:
                assert proc.poll() is None, "the DRA driver exited"
            value = check()
            if value:
                return value
            time.sleep(0.3)
        pytest.fail(f"timed out waiting for {what}\n--- pods not scheduled ---\n"
                    f"{self._unscheduled()}\n--- kube-scheduler log ---\n"
                    f"{self.cp.log('kube-scheduler')}", pytrace=False)  # fmt: skip

    def _unscheduled(self) -> str:
        """Each pod not (yet) bound, with its PodScheduled condition: the scheduler's reason."""
        lines = []
        for pod in self.core.list_namespaced_pod(NS).items:
            if pod.spec.node_name:
                continue
            conds = [c for c in pod.status.conditions or [] if c.type == "PodScheduled"]
            why = f"{conds[0].reason}: {conds[0].message}" if conds else "not tried yet"
            lines.append(f"{pod.metadata.name}: {why}")
        return "\n".join(lines) or "(none)"

    def allocated(self, claim: str) -> list[dict[str, Any]]:
        """The claim's allocation results, once the scheduler wrote them."""
        results: list[dict[str, Any]] = self.wait(
            f"claim {claim} allocated",
            lambda: ((self.allocation(claim) or {}).get("devices") or {}).get("results"),
        )  # fmt: skip
        return results

    def unschedulable(self, pod: str) -> str:
        """The scheduler's message once ``pod`` is Unschedulable."""

        def check() -> str | None:
            status = self.core.read_namespaced_pod(pod, NS).status
            for cond in status.conditions or []:
                if cond.type == "PodScheduled" and cond.reason == "Unschedulable":
                    return str(cond.message)
            return None

        message: str = self.wait(f"pod {pod} Unschedulable", check)
        return message

    def delete(self, pod: str, *claims: str) -> None:
        """Delete the pod and its claims, and wait until the claims are gone (their devices
        free again for the next test)."""
        self.core.delete_namespaced_pod(pod, NS, grace_period_seconds=0)
        for claim in claims:
            self.objects.delete_namespaced_custom_object(GROUP, VERSION, NS, "resourceclaims",
                                                         claim)  # fmt: skip
        names = set(claims)
        self.wait(f"claims {sorted(names)} deleted", lambda: not names & {
            c["metadata"]["name"] for c in self.objects.list_namespaced_custom_object(
                GROUP, VERSION, NS, "resourceclaims")["items"]})  # fmt: skip

    def slices(self, node: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.objects.list_cluster_custom_object(
            GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={node}")["items"]
        return items


@contextlib.contextmanager
def cluster(nodes: Mapping[str, Node], gates: Mapping[str, bool] | None = None,
            files: Sequence[str] = ("examples/dra/deviceclasses.yaml",),
            ) -> Iterator[Cluster]:  # fmt: skip
    """A control plane with scheduler (``gates`` on every component), ``files`` applied,
    and for every node a Node object and a driver process publishing its pool."""
    with control_plane(gates, scheduler=True) as cp, tempfile.TemporaryDirectory(
            prefix="hwsb-sched-") as tmp:  # fmt: skip
        api = cp.api()
        c = Cluster(cp, api, client.CustomObjectsApi(api), client.CoreV1Api(api))
        for f in files:
            apply_file(api, REPO / f)
        try:
            for name, node in nodes.items():
                add_node(api, name, list(node.declared_features))
                spec = load_profile(str(REPO / node.profile)).cluster.node(name)
                assert spec is not None, f"no node {name} in {node.profile}"
                root = c.roots[name] = Path(tmp) / name
                render(build_tree(spec), root)
                config = driver_config(spec)
                if node.edit_config is not None:
                    node.edit_config(config)
                (Path(tmp) / f"{name}.json").write_text(json.dumps(config))
                c.logs[name] = Path(tmp) / f"{name}.log"
                log = c.logs[name].open("wb")
                c.drivers.append(subprocess.Popen(
                    [sys.executable, "-m", "hwplugins.dra", "--root", str(root),
                     "--node-name", name, "--kubeconfig", str(cp.kubeconfig),
                     "--config", str(Path(tmp) / f"{name}.json"), "--no-kubelet-plugin",
                     "--interval", "0.5", *node.driver_args],
                    stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
                log.close()
            c.wait("every pool published", lambda: {
                s["spec"]["nodeName"] for s in c.objects.list_cluster_custom_object(
                    GROUP, VERSION, "resourceslices")["items"]} == set(nodes))  # fmt: skip
            yield c
        finally:
            for proc in c.drivers:
                proc.terminate()
                proc.wait(10)


def example_devices(path: str, claim: str) -> dict[str, Any]:
    """``spec.devices`` of the ResourceClaim ``claim`` in an example file (so the tests
    run exactly what a workshop applies)."""
    for doc in yaml.safe_load_all((REPO / path).read_text()):
        if doc["kind"] == "ResourceClaim" and doc["metadata"]["name"] == claim:
            devices: dict[str, Any] = doc["spec"]["devices"]
            return devices
    raise AssertionError(f"no ResourceClaim {claim} in {path}")


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def attr(key: str) -> str:
    return f'device.attributes["{DRIVER}"].{key}'


def cel(*expressions: str) -> list[dict[str, Any]]:
    return [{"cel": {"expression": " && ".join(expressions)}}]

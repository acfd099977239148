"""The driver's slices allocated by the REAL kube-scheduler (v1.37, default feature gates).

A real etcd, kube-apiserver, kube-scheduler and kube-controller-manager (resourceclaim
controller) run; two Node objects stand in for kubelets (allocation needs none: the
scheduler writes ``status.allocation`` and binds the pod even if it never runs). The driver
runs as its own process against rendered trees and publishes the pools:

- ``mig-worker`` (profiles/mig-partitions.yaml): four partitionable A100 80GB;
- ``dra-worker`` (tests/data/dra-nic-gpu.yaml): a 10G NIC with consumable bandwidth.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from sandbox.dra import driver_config
from sandbox.fakehw.build import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import load_profile
from tests.dra.controlplane import ControlPlane, add_node, apply_file, control_plane

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, NS = "resource.k8s.io", "v1", "default"
DRIVER = "dra.hwsandbox.dev"
NODES = {"mig-worker": "profiles/mig-partitions.yaml", "dra-worker": "tests/data/dra-nic-gpu.yaml"}


@dataclass
class Cluster:
    cp: ControlPlane
    api: client.ApiClient
    objects: client.CustomObjectsApi
    core: client.CoreV1Api
    drivers: list[subprocess.Popen[bytes]]
    roots: dict[str, Path]

    def claim(self, name: str, request: dict[str, Any]) -> None:
        self.objects.create_namespaced_custom_object(GROUP, VERSION, NS, "resourceclaims", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "r", "exactly": request}]}},
        })  # fmt: skip

    def pod(self, name: str, node: str, claim: str | None = None,
            template: str | None = None) -> None:  # fmt: skip
        ref = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template}
        self.core.create_namespaced_pod(NS, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "resourceClaims": [{"name": "c", **ref}],
                "containers": [{"name": "main", "image": "registry.invalid/pause:never-pulled",
                                "resources": {"claims": [{"name": "c"}]}}],
            },
        })  # fmt: skip

    def get_claim(self, name: str) -> dict[str, Any]:
        claim: dict[str, Any] = self.objects.get_namespaced_custom_object(
            GROUP, VERSION, NS, "resourceclaims", name)
        return claim

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
        pytest.fail(f"timed out waiting for {what}\n--- kube-scheduler log ---\n"
                    f"{self.cp.log('kube-scheduler')}", pytrace=False)  # fmt: skip

    def allocated(self, claim: str) -> list[dict[str, Any]]:
        """The claim's allocation results, once the scheduler wrote them."""
        results: list[dict[str, Any]] = self.wait(
            f"claim {claim} allocated",
            lambda: ((self.get_claim(claim).get("status") or {}).get("allocation") or {})
            .get("devices", {}).get("results"),
        )  # fmt: skip
        return results

    def unschedulable(self, pod: str) -> str:
        def check() -> str | None:
            status = self.core.read_namespaced_pod(pod, NS).status
            for cond in status.conditions or []:
                if cond.type == "PodScheduled" and cond.reason == "Unschedulable":
                    return str(cond.message)
            return None

        message: str = self.wait(f"pod {pod} Unschedulable", check)
        return message

    def delete(self, pod: str, claim: str) -> None:
        self.core.delete_namespaced_pod(pod, NS, grace_period_seconds=0)
        self.objects.delete_namespaced_custom_object(GROUP, VERSION, NS, "resourceclaims", claim)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with control_plane(scheduler=True) as cp, tempfile.TemporaryDirectory(
            prefix="hwsb-sched-") as tmp:  # fmt: skip
        api = cp.api()
        objects = client.CustomObjectsApi(api)
        core = client.CoreV1Api(api)
        apply_file(api, REPO / "examples/dra/deviceclasses.yaml")
        apply_file(api, REPO / "examples/dra/mig-partitions.yaml")
        drivers: list[subprocess.Popen[bytes]] = []
        c = Cluster(cp, api, objects, core, drivers, {})
        try:
            for name, profile in NODES.items():
                add_node(api, name)
                spec = load_profile(str(REPO / profile)).cluster.node(name)
                assert spec is not None
                root = c.roots[name] = Path(tmp) / name
                render(build_tree(spec), root)
                (Path(tmp) / f"{name}.json").write_text(json.dumps(driver_config(spec)))
                log = (Path(tmp) / f"{name}.log").open("wb")
                drivers.append(subprocess.Popen(
                    [sys.executable, "-m", "hwplugins.dra", "--root", str(root),
                     "--node-name", name, "--kubeconfig", str(cp.kubeconfig),
                     "--config", str(Path(tmp) / f"{name}.json"), "--no-kubelet-plugin",
                     "--interval", "0.5"],
                    stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
                log.close()
            c.wait("both pools published", lambda: {
                s["spec"]["nodeName"] for s in objects.list_cluster_custom_object(
                    GROUP, VERSION, "resourceslices")["items"]} == set(NODES))  # fmt: skip
            yield c
        finally:
            for proc in drivers:
                proc.terminate()
                proc.wait(10)


def _partition(gpu: str, profile: str) -> dict[str, Any]:
    expr = (f'device.attributes["{DRIVER}"].parent == "{gpu}" && '
            f'device.attributes["{DRIVER}"].profile == "{profile}"')  # fmt: skip
    return {"deviceClassName": "gpu-partition.hwsandbox.dev", "selectors": [{"cel": {
        "expression": expr}}]}  # fmt: skip


def _whole(gpu: str) -> dict[str, Any]:
    expr = f'device.attributes["resource.kubernetes.io"].pciBusID == "{_bdf(gpu)}"'
    return {"deviceClassName": "gpu.hwsandbox.dev", "selectors": [{"cel": {"expression": expr}}]}


def _bdf(gpu: str) -> str:
    d, b, s, f = gpu.removeprefix("gpu-").split("-")
    return f"{d}:{b}:{s}.{f}"


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_partitions_that_fit_are_allocated_together(cluster: Cluster) -> None:
    gpu = "gpu-0000-01-00-0"
    names = [_name("fit") for _ in range(2)]
    for n in names:  # 2 x 3g.40gb = 8 memory slices, 6 compute slices: fits exactly
        cluster.claim(n, _partition(gpu, "3g.40gb"))
        cluster.pod(n, "mig-worker", claim=n)
    devices = [cluster.allocated(n)[0]["device"] for n in names]
    assert sorted(devices) == [f"{gpu}-3g-40gb-0", f"{gpu}-3g-40gb-1"]
    pods = [cluster.core.read_namespaced_pod(n, NS) for n in names]
    assert all(p.spec.node_name == "mig-worker" for p in pods)


def test_partitions_exceeding_the_counters_are_never_allocated_together(
    cluster: Cluster,
) -> None:
    gpu = "gpu-0000-02-00-0"
    first, second = _name("big"), _name("bigger")
    cluster.claim(first, _partition(gpu, "3g.40gb"))
    cluster.pod(first, "mig-worker", claim=first)
    assert cluster.allocated(first)[0]["device"].startswith(f"{gpu}-3g-40gb-")
    cluster.claim(second, _partition(gpu, "7g.80gb"))  # 4 + 8 memory slices > 8
    cluster.pod(second, "mig-worker", claim=second)
    message = cluster.unschedulable(second)
    assert "cannot allocate all claims" in message, message
    assert not (cluster.get_claim(second).get("status") or {}).get("allocation")
    cluster.delete(first, first)  # the counters come back: now the big one fits
    assert cluster.allocated(second)[0]["device"] == f"{gpu}-7g-80gb-0"


def test_a_whole_gpu_excludes_its_partitions(cluster: Cluster) -> None:
    gpu = "gpu-0000-81-00-0"
    whole, part = _name("whole"), _name("part")
    cluster.claim(whole, _whole(gpu))
    cluster.pod(whole, "mig-worker", claim=whole)
    assert cluster.allocated(whole)[0]["device"] == gpu
    cluster.claim(part, _partition(gpu, "1g.10gb"))
    cluster.pod(part, "mig-worker", claim=part)
    cluster.unschedulable(part)
    assert not (cluster.get_claim(part).get("status") or {}).get("allocation")


def test_example_template_gets_a_partition(cluster: Cluster) -> None:
    pod = _name("tmpl")
    cluster.pod(pod, "mig-worker", template="mig-1g-10gb")
    claim = cluster.wait("claim from the template", lambda: next(
        (s.resource_claim_name for s in (cluster.core.read_namespaced_pod(pod, NS).status
                                         .resource_claim_statuses or [])), None))  # fmt: skip
    result = cluster.allocated(claim)[0]
    assert result["driver"] == DRIVER
    assert result["pool"] == "mig-worker"
    assert "-1g-10gb-" in result["device"]


def test_nic_bandwidth_is_consumable_capacity(cluster: Cluster) -> None:
    nic = {"deviceClassName": "nic.hwsandbox.dev", "capacity": {"requests": {"bandwidth": "3G"}}}
    names = [_name("bw") for _ in range(4)]
    for n in names[:3]:
        cluster.claim(n, nic)
        cluster.pod(n, "dra-worker", claim=n)
    results = [cluster.allocated(n)[0] for n in names[:3]]
    assert {r["device"] for r in results} == {"nic-0000-01-00-0"}
    assert all(r["consumedCapacity"] == {"bandwidth": "3G"} for r in results)
    assert len({r["shareID"] for r in results}) == 3  # one share per claim
    cluster.claim(names[3], nic)  # 4 x 3G > 10G
    cluster.pod(names[3], "dra-worker", claim=names[3])
    cluster.unschedulable(names[3])
    assert not (cluster.get_claim(names[3]).get("status") or {}).get("allocation")


def test_a_tainted_device_is_not_allocated(cluster: Cluster) -> None:
    """An AER fatal error in sysfs: the driver taints the GPU (NoExecute) at its next rescan
    and the scheduler no longer hands it out."""
    pci = cluster.roots["dra-worker"] / "sys/bus/pci/devices/0000:02:00.0"
    gpu = "gpu-0000-02-00-0"
    assert (pci / "class").read_text().startswith("0x03")
    (pci / "aer_dev_fatal").write_text("TOTAL_ERR_FATAL 1\n")

    def tainted() -> bool:
        slices = cluster.objects.list_cluster_custom_object(
            GROUP, VERSION, "resourceslices", field_selector="spec.nodeName=dra-worker")
        return any(d["name"] == gpu and d.get("taints") for s in slices["items"]
                   for d in s["spec"].get("devices", []))  # fmt: skip

    cluster.wait("the GPU tainted", tainted, timeout=10)
    name = _name("tainted")
    cluster.claim(name, _whole(gpu))
    cluster.pod(name, "dra-worker", claim=name)
    cluster.unschedulable(name)
    assert not (cluster.get_claim(name).get("status") or {}).get("allocation")

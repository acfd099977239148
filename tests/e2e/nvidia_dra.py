"""NVIDIA's DRA driver on the native runtime, for test_native_nvidia_dra.py and
test_native_nvidia_mig_dra.py: its image imported and the bundled manifest deployed
(`sandbox plugins deploy nvidia-dra-driver`), its slices and pod read back, a claim's pod.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import (
    NativeCluster,
    claim_pod_manifest,
    custom_objects,
    default_service_account,
    delete_object,
    events,
    kubectl,
    phase,
    pod_log,
    pods_state,
    wait_until,
)

from sandbox.runtimes.native.hostpaths import HOST_STATE
from tests.support.nvidia import DRA_IMAGE, write_dra_image

DRIVER = "gpu.nvidia.com"
GROUP, API, NS = "resource.k8s.io", "v1", "default"
LABEL = "app.kubernetes.io/name=nvidia-dra-driver"
DAEMONSET = "nvidia-dra-driver-kubelet-plugin"


def devices(cluster: NativeCluster) -> dict[str, dict[str, Any]]:
    """Device name -> device, over the driver's slices for the node."""
    items = custom_objects(cluster).list_cluster_custom_object(
        GROUP, API, "resourceslices",
        field_selector=f"spec.nodeName={cluster.node.name},spec.driver={DRIVER}")["items"]
    return {d["name"]: d for s in items for d in s["spec"].get("devices", [])}


def attr(device: dict[str, Any], name: str) -> Any:
    """A device attribute's value (whatever its type: string, int, version, bool)."""
    value = device.get("attributes", {}).get(name, {})
    return next(iter(value.values()), None) if value else None


def driver_log(cluster: NativeCluster) -> str:
    """The log of the driver's pod ("" before it has one)."""
    pods = cluster.core.list_namespaced_pod("kube-system", label_selector=LABEL).items
    try:
        return "".join(str(cluster.core.read_namespaced_pod_log(p.metadata.name, "kube-system"))
                       for p in pods)
    except Exception:  # noqa: BLE001 - a pod still starting has no log yet
        return ""


def driver_state(cluster: NativeCluster) -> str:
    return pods_state(cluster, "kube-system", LABEL) or "no nvidia-dra-driver pod"


def _published(cluster: NativeCluster, want: int) -> bool:
    """The driver published ``want`` devices; FAILS at once when its container cannot
    start (no point waiting out the timeout)."""
    for p in cluster.core.list_namespaced_pod("kube-system", label_selector=LABEL).items:
        for c in p.status.container_statuses or []:
            waiting = c.state.waiting
            if waiting is not None and waiting.reason in ("CreateContainerError",
                                                          "CrashLoopBackOff"):
                pytest.fail(f"NVIDIA's DRA driver does not start:\n{driver_state(cluster)}",
                            pytrace=False)
    return len(devices(cluster)) == want


@contextlib.contextmanager
def deployed(cluster: NativeCluster, tmp_path: Path, want: int,
             *env: str) -> Iterator[str]:
    """Import the image, `sandbox plugins deploy nvidia-dra-driver [--env NAME=VALUE...]`,
    wait for ``want`` published devices; yields deploy's output. Removes the DaemonSet and
    waits for its pod to go on exit."""
    archive = write_dra_image(tmp_path / "nvidia-dra-driver.oci.tar")
    cluster.ctr("images", "import", str(archive))
    assert DRA_IMAGE in cluster.ctr("images", "ls", "-q").split()
    out = cluster.sandbox_cli("plugins", "deploy", "nvidia-dra-driver",
                              *(f"--env={e}" for e in env))
    assert (HOST_STATE / "driver").resolve() == cluster.state_dir / "driver", out
    try:
        wait_until(f"{DRIVER}'s ResourceSlices with {want} devices",
                   lambda: _published(cluster, want), 180,
                   describe=lambda: f"{sorted(devices(cluster))}\n{driver_state(cluster)}")
        yield out
    finally:
        kubectl(cluster, "-n", "kube-system", "delete", "daemonset", DAEMONSET,
                "--ignore-not-found", "--wait=true")
        wait_until("the driver's pod is gone", lambda: not cluster.core.list_namespaced_pod(
            "kube-system", label_selector=LABEL).items, 120,
            describe=lambda: driver_state(cluster))


def claim_spec_file(cluster: NativeCluster, uid: str) -> Path:
    """Where the driver writes a claim's CDI spec (its transient spec name), on native."""
    return cluster.layout.cdi_plugins / f"k8s.gpu.nvidia.com-claim_{uid}.yaml"


@contextlib.contextmanager
def claim_pod(cluster: NativeCluster, name: str, exactly: dict[str, Any],
              command: str) -> Iterator[tuple[dict[str, Any], str]]:
    """A ResourceClaim ``name`` (one request, ``exactly``) and a busybox pod using it that
    runs ``command`` then sleeps; yields (the allocated device result, the claim's uid) once
    the pod runs and has printed "done". On exit deletes both and waits until the driver
    unprepared the claim (its CDI spec gone)."""
    wait_until("the default service account", lambda: default_service_account(cluster))
    objects = custom_objects(cluster)
    spec = None
    try:
        objects.create_namespaced_custom_object(GROUP, API, NS, "resourceclaims", {
            "apiVersion": f"{GROUP}/{API}", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        })  # fmt: skip
        uid = objects.get_namespaced_custom_object(
            GROUP, API, NS, "resourceclaims", name)["metadata"]["uid"]
        spec = claim_spec_file(cluster, uid)
        cluster.core.create_namespaced_pod(
            NS, claim_pod_manifest(name, name, f"{command}; echo done; sleep 3600"))
        wait_until(f"pod {name} to run", lambda: phase(cluster, name) != "Pending", 180,
                   describe=lambda: events(cluster, name) + "\n" + driver_state(cluster))
        assert phase(cluster, name) == "Running", events(cluster, name)
        wait_until("the pod's output", lambda: "done" in pod_log(cluster, name), 30)
        claim = objects.get_namespaced_custom_object(GROUP, API, NS, "resourceclaims", name)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (DRIVER, cluster.node.name)
        yield result, uid
    finally:
        delete_object(cluster, "pod", name)
        wait_until(f"pod {name} gone", lambda: name not in [
            p.metadata.name for p in cluster.core.list_namespaced_pod(NS).items], 60)
        delete_object(cluster, "resourceclaims", name)
        if spec is not None:
            wait_until("the claim's CDI spec removed (unprepared)", lambda: not spec.exists(),
                       60, describe=lambda: driver_state(cluster))

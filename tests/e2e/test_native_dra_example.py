"""kubernetes-sigs' dra-example-driver v0.2.0, unmodified, on the native runtime (issue 15,
item 6).

Built from its Go module (scripts/build-plugins dra-example-driver, into the cache), put
into an OCI image from that local file (``static_image``, ``sandbox.images.oci``; there is no
registry), imported into the node's containerd and run by the DaemonSet of our own
manifest (plugins/manifests/dra-example-driver.yaml), with two native-runtime settings the
manifest's header names: its CDI_ROOT volume is ``state_dir/cdi-plugins`` (one of
containerd's ``cdi_spec_dirs``) and the API server is reached at the host address (no
kube-proxy: the Service IP does not route). Then, with the real scheduler, kubelet and
containerd: its ResourceSlice (8 fake GPUs of driver gpu.example.com) is published, a claim
for one of them is allocated and prepared, and the pod sees the driver's env through CDI.

Runs on ``mig_cluster`` (the cluster test_native_dra_cdi.py leaves up), next to our own DRA
driver: two drivers on one kubelet.
"""

from __future__ import annotations

import time
from typing import Any

import yaml
from cluster import (
    REPO,
    NativeCluster,
    claim_pod_manifest,
    default_service_account,
    events,
    kubectl,
    phase,
    wait_until,
)

from sandbox.runtimes.record import read_record
from tests.support.thirdparty import plugin_binary, static_image

DRIVER = "gpu.example.com"
VERSION = "v0.2.0"
IMAGE = f"localhost/hw-sandbox/dra-example-driver:{VERSION}"
MANIFEST = REPO / "plugins" / "manifests" / "dra-example-driver.yaml"
GROUP, API, NS = "resource.k8s.io", "v1", "default"


def _manifest(cluster: NativeCluster) -> str:
    record = read_record(cluster.state_dir)
    assert record is not None
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (cdi,) = [v for v in spec["volumes"] if v["name"] == "cdi"]
    cdi["hostPath"]["path"] = str(cluster.layout.cdi_plugins)
    (plugin,) = spec["containers"]
    plugin["env"] += [{"name": "KUBERNETES_SERVICE_HOST", "value": str(record.host_ip)},
                      {"name": "KUBERNETES_SERVICE_PORT",
                       "value": str((record.ports or {})["apiserver"])}]
    return yaml.safe_dump_all(docs)


def _objects(cluster: NativeCluster) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(cluster.core.api_client)


def _slice_devices(cluster: NativeCluster) -> list[str]:
    items = _objects(cluster).list_cluster_custom_object(
        GROUP, API, "resourceslices",
        field_selector=f"spec.nodeName={cluster.node.name},spec.driver={DRIVER}")["items"]
    return sorted(d["name"] for s in items for d in s["spec"].get("devices", []))


def _driver_state(cluster: NativeCluster) -> str:
    pods = cluster.core.list_namespaced_pod(
        "kube-system", label_selector="app.kubernetes.io/name=dra-example-driver").items
    out = []
    for p in pods:
        out.append(f"{p.metadata.name}: {p.status.phase}; volumes "
                   f"{[(v.name, v.projected is not None) for v in p.spec.volumes or []]}; "
                   f"mounts {[(m.name, m.mount_path) for m in p.spec.containers[0].volume_mounts]}")
        try:
            log = cluster.core.read_namespaced_pod_log(p.metadata.name, "kube-system",
                                                       tail_lines=20)
            out.append(str(log))
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            out.append(f"(no log: {exc})")
    return "\n".join(out) or "no dra-example-driver pod"


def test_dra_example_driver_publishes_allocates_and_injects_env(
        mig_cluster: NativeCluster) -> None:
    cluster = mig_cluster
    started = time.monotonic()
    tarball = static_image(plugin_binary("dra-example-driver"), IMAGE,
                           "/usr/bin/dra-example-kubeletplugin")
    cluster.ctr("images", "import", str(tarball))
    assert IMAGE in cluster.ctr("images", "ls", "-q").split()
    manifest = _manifest(cluster)
    wait_until("the default service account", lambda: default_service_account(cluster))
    kubectl(cluster, "apply", "-f", "-", stdin=manifest)
    pod = "example-gpu"
    try:
        wait_until(f"{DRIVER}'s ResourceSlice with 8 devices",
                   lambda: len(_slice_devices(cluster)) == 8, 120,
                   describe=lambda: f"{_slice_devices(cluster)}\n{_driver_state(cluster)}")
        assert _slice_devices(cluster) == sorted(f"gpu-{i}" for i in range(8))
        print(f"dra-example-driver's slice published {time.monotonic() - started:.0f}s "
              "after the build/import/apply started")

        _objects(cluster).create_namespaced_custom_object(GROUP, API, NS, "resourceclaims", {
            "apiVersion": f"{GROUP}/{API}", "kind": "ResourceClaim",
            "metadata": {"name": pod},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        })  # fmt: skip
        uid = _objects(cluster).get_namespaced_custom_object(
            GROUP, API, NS, "resourceclaims", pod)["metadata"]["uid"]
        cluster.core.create_namespaced_pod(
            NS, claim_pod_manifest(pod, pod, "env | sort; echo done; sleep 3600"))
        wait_until(f"pod {pod} to run", lambda: phase(cluster, pod) != "Pending", 120,
                   describe=lambda: events(cluster, pod) + "\n" + _driver_state(cluster))
        assert phase(cluster, pod) == "Running", events(cluster, pod)

        claim = _objects(cluster).get_namespaced_custom_object(
            GROUP, API, NS, "resourceclaims", pod)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (DRIVER, cluster.node.name)
        device = result["device"]
        assert device in _slice_devices(cluster)

        def log() -> str:
            return str(cluster.core.read_namespaced_pod_log(pod, NS))

        wait_until("the pod's env", lambda: "done" in log(), 30)
        env = dict(line.split("=", 1) for line in log().splitlines() if "=" in line)
        n = device.removeprefix("gpu-")
        # the driver's CDI edits, per device and common (cdi.go, state.go of v0.2.0)
        assert env.get(f"GPU_DEVICE_{n}") == device, env
        assert env.get(f"GPU_DEVICE_{n}_RESOURCE_CLAIM") == uid, env
        assert env.get("DRA_RESOURCE_DRIVER_NAME") == DRIVER, env
        assert env.get("KUBERNETES_NODE_NAME") == cluster.node.name, env
        assert not [k for k in env if k.startswith("GPU_DEVICE_") and not k.startswith(
            f"GPU_DEVICE_{n}")], env
    finally:
        from kubernetes.client.exceptions import ApiException

        for delete in (
            lambda: cluster.core.delete_namespaced_pod(pod, NS, grace_period_seconds=0),
            lambda: _objects(cluster).delete_namespaced_custom_object(
                GROUP, API, NS, "resourceclaims", pod),
        ):
            try:
                delete()
            except ApiException as exc:
                if exc.status != 404:
                    raise
        kubectl(cluster, "delete", "--ignore-not-found", "--wait=false", "-f", "-",
                 stdin=manifest)

"""Claims reach the container: CDI on the native runtime's containerd 2.x (issue 15, 1 + 8).

``mig_cluster``: profiles/mig-partitions.yaml (node mig-worker, 4 partitionable A100 80GB)
with the reference DRA driver, no device plugin, and ``DRADeviceCompatibilityGroups`` on in
every component (``NativeRuntime(feature_gates=...)``, what ``sandbox up --feature-gates``
passes). containerd is 2.4 built by scripts/build-containerd with ``cdi_spec_dirs =
[state_dir/cdi]``, where the driver writes a spec per prepared claim whose ``hostPath``s
name the node's device nodes under ``state_dir/dev`` (all 1:3); containerd sees them
through the /dev overlay in its own mount namespace, the host's /dev is never written.

What is checked, with the real scheduler, kubelet and containerd:

1. one pod, two containers: one holds a claim for a whole GPU, the other one for a MIG-like
   1g.10gb partition (a different GPU: a whole GPU consumes all its counters). The kubelet
   prepares both claims through the driver (NodePrepareResources), containerd applies the
   CDI specs, and each container sees exactly the device nodes of its own claim (as char
   devices 1:3, the node's) and the env the driver set (``NVIDIA_VISIBLE_DEVICES``,
   ``HWSANDBOX_DEVICE_*``, ``HWSANDBOX_PARTITION`` for the partition only);
2. deleting the pod unprepares both (CDI files and checkpoint entries gone, claims
   deallocated);
3. the feature gate reached every component (each one's ``kubernetes_feature_enabled``
   metric); ``sandbox up`` refusing bad gates and DRA options: tests/cli/test_up_flags.py;
4. faults reach the cluster: ``sandbox fault health … unhealthy`` of the GPU under a running
   pod's partition claim puts a NoExecute taint on the GPU and its partitions, and the
   controller-manager's device-taint-eviction controller evicts the pod; ``sandbox fault
   unplug`` of a GPU takes its partitions out of the slices, ``plug`` brings them back.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cluster import (
    DRIVER,
    GROUP,
    MIG_FEATURE_GATES,
    NS,
    VERSION,
    NativeCluster,
    component_log,
    custom_objects,
    default_service_account,
    delete_object,
    ensure_device_classes,
    events,
    gpu_minor,
    phase,
    read_claim,
    slice_devices,
    wait_until,
)

from sandbox.runtimes.native import BUSYBOX_REF, running
from sandbox.runtimes.record import read_record

PARTITION_PROFILE = "1g.10gb"
# what a container prints: its NVIDIA device nodes with major:minor (hex), then its env
COMMAND = ("for f in $(find /dev -name 'nvidia*' | sort); do stat -c 'node %n %t:%T' \"$f\"; "
           "done; env | grep -E '^(NVIDIA_VISIBLE_DEVICES|HWSANDBOX_)' | sort | sed 's/^/env /'; "
           "echo done; sleep 3600")


def _diagnose(cluster: NativeCluster) -> str:
    return component_log(cluster, "dra-driver") + component_log(cluster, "containerd", 20)


def _create_claim(cluster: NativeCluster, name: str, device_class: str,
                  selector: str | None = None) -> str:
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    objects = custom_objects(cluster)
    objects.create_namespaced_custom_object(GROUP, VERSION, NS, "resourceclaims", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "dev", "exactly": exactly}]}},
    })  # fmt: skip
    return str(read_claim(cluster, name)["metadata"]["uid"])


def _container(name: str, claim: str) -> dict[str, Any]:
    return {"name": name, "image": BUSYBOX_REF, "imagePullPolicy": "Never",
            "command": ["sh", "-c", COMMAND], "resources": {"claims": [{"name": claim}]}}


def _output(cluster: NativeCluster, pod: str, container: str) -> tuple[dict[str, str],
                                                                       dict[str, str]]:
    """(device node path -> "major:minor", env name -> value) the container printed."""
    text = str(cluster.core.read_namespaced_pod_log(pod, NS, container=container))
    nodes, env = {}, {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "node":
            path, numbers = rest.rsplit(" ", 1)
            nodes[path] = numbers
        elif kind == "env":
            key, _, value = rest.partition("=")
            env[key] = value
    return nodes, env


@pytest.fixture
def cluster(mig_cluster: NativeCluster) -> NativeCluster:
    wait_until("the DRA driver's ResourceSlices for the node",
               lambda: bool(slice_devices(mig_cluster)), 60,
               describe=lambda: _diagnose(mig_cluster))
    ensure_device_classes(mig_cluster)
    wait_until("the default service account", lambda: default_service_account(mig_cluster))
    return mig_cluster


def test_whole_gpu_and_partition_claims_reach_their_containers_through_cdi(
        cluster: NativeCluster) -> None:
    host_dev_before = sorted(os.listdir("/dev"))
    devices = slice_devices(cluster)
    partitions = [n for n, d in devices.items()
                  if d["attributes"]["type"] == {"string": "gpu-partition"}]
    assert partitions, f"no partitions in the slices: {sorted(devices)}"
    pod = "cdi-gpu-and-mig"
    uids = {
        "whole": _create_claim(cluster, "cdi-whole", "gpu.hwsandbox.dev"),
        "part": _create_claim(
            cluster, "cdi-part", "gpu-partition.hwsandbox.dev",
            f'device.attributes["{DRIVER}"].profile == "{PARTITION_PROFILE}"'),
    }
    manifest = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
        "spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "whole", "resourceClaimName": "cdi-whole"},
                               {"name": "part", "resourceClaimName": "cdi-part"}],
            "containers": [_container("whole", "whole"), _container("part", "part")],
        },
    }  # fmt: skip
    cluster.core.create_namespaced_pod(NS, manifest)
    try:
        wait_until(f"pod {pod} to run", lambda: phase(cluster, pod) != "Pending", 120,
                   describe=lambda: events(cluster, pod) + _diagnose(cluster))
        assert phase(cluster, pod) == "Running", events(cluster, pod) + _diagnose(cluster)

        allocated: dict[str, dict[str, Any]] = {}
        for which, claim_name in (("whole", "cdi-whole"), ("part", "cdi-part")):
            allocation = read_claim(cluster, claim_name)["status"]["allocation"]
            (result,) = allocation["devices"]["results"]
            assert (result["driver"], result["pool"]) == (DRIVER, cluster.node.name)
            allocated[which] = devices[result["device"]]
        whole, part = allocated["whole"], allocated["part"]
        attr = "type"
        assert whole["attributes"][attr] == {"string": "gpu"}
        assert part["attributes"][attr] == {"string": "gpu-partition"}
        assert part["attributes"]["profile"] == {"string": PARTITION_PROFILE}
        pci = {w: d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
               for w, d in allocated.items()}
        assert pci["whole"] != pci["part"], "a whole GPU and a partition of it, both allocated"

        for which in ("whole", "part"):
            wait_until(f"container {which}'s output", lambda w=which: "done" in str(
                cluster.core.read_namespaced_pod_log(pod, NS, container=w)), 30)
            nodes, env = _output(cluster, pod, which)
            cdi_file = cluster.layout.cdi / f"hwsandbox.dev-gpu_{uids[which]}.json"
            (cdi_dev,) = json.loads(cdi_file.read_text())["devices"]
            edits = cdi_dev["containerEdits"]
            want_nodes = {n["path"] for n in edits["deviceNodes"]}
            for n in edits["deviceNodes"]:  # the node's own device nodes, never the host's /dev
                assert Path(n["hostPath"]) == cluster.layout.dev / n["path"].removeprefix("/dev/")
            # exactly the claim's NVIDIA nodes, each the node's 1:3 (what up made)
            assert set(nodes) == want_nodes, f"{which}: {nodes} vs the CDI spec {want_nodes}"
            assert set(nodes.values()) == {"1:3"}, nodes
            primary = f"/dev/nvidia{gpu_minor(cluster, pci[which])}"
            assert primary in nodes, f"{which} ({pci[which]}): {sorted(nodes)}"
            other = "part" if which == "whole" else "whole"
            assert f"/dev/nvidia{gpu_minor(cluster, pci[other])}" not in nodes
            # the env the driver set, and nothing of the other claim's
            want_env = dict(e.split("=", 1) for e in edits["env"])
            assert env == want_env, f"{which}: {env} vs the CDI spec {want_env}"
            assert env.get("NVIDIA_VISIBLE_DEVICES"), env
            if which == "part":
                assert env["HWSANDBOX_PARTITION"] == PARTITION_PROFILE
            else:
                assert "HWSANDBOX_PARTITION" not in env
        checkpoint = json.loads((cluster.layout.dra / "checkpoint.json").read_text())["claims"]
        assert set(checkpoint) == set(uids.values())

        # Pod gone -> NodeUnprepareResources for both claims, partition included.
        delete_object(cluster, "pod", pod)
        # The driver removes a claim's CDI files, then rewrites its checkpoint: wait for both.
        def claims() -> Any:
            return json.loads((cluster.layout.dra / "checkpoint.json").read_text())["claims"]

        wait_until("NodeUnprepareResources to remove both claims' CDI files and entries",
                   lambda: not list(cluster.layout.cdi.glob("*.json")) and not claims(), 90,
                   describe=lambda: f"{list(cluster.layout.cdi.glob('*.json'))}, checkpoint "
                   f"{list(claims())}" + _diagnose(cluster))
        assert claims() == {}
        for claim_name in ("cdi-whole", "cdi-part"):
            wait_until(f"{claim_name} to be deallocated",
                       lambda c=claim_name: not read_claim(cluster, c).get("status"), 60)
    finally:
        delete_object(cluster, "pod", pod)
        for claim_name in ("cdi-whole", "cdi-part"):
            delete_object(cluster, "resourceclaims", claim_name)
    assert sorted(os.listdir("/dev")) == host_dev_before, "the host's /dev changed"
    assert running(cluster.layout, "dra-driver") is not None, "the DRA driver died"


def _metric_gate(text: str, gate: str) -> str | None:
    match = re.search(rf'^kubernetes_feature_enabled\{{name="{gate}",stage="[A-Z]*"\}} (\d)$',
                      text, re.M)
    return match.group(1) if match else None


def test_feature_gates_reach_every_component(cluster: NativeCluster) -> None:
    (gate, on), = MIG_FEATURE_GATES.items()
    want = "1" if on else "0"
    pki = cluster.layout.pki
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    insecure = ssl.create_default_context()  # scheduler and controller-manager: self-signed
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    insecure.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    record = read_record(cluster.state_dir)
    assert record is not None
    assert record.feature_gates == MIG_FEATURE_GATES
    ports = record.ports
    assert ports is not None
    api = f"https://127.0.0.1:{ports['apiserver']}"
    urls = {
        "kube-apiserver": (f"{api}/metrics", ctx),
        "kubelet": (f"{api}/api/v1/nodes/{cluster.node.name}/proxy/metrics", ctx),
        "kube-scheduler": (f"https://127.0.0.1:{ports['scheduler']}/metrics", insecure),
        "kube-controller-manager": (
            f"https://127.0.0.1:{ports['controller-manager']}/metrics", insecure),
    }
    for component, (url, context) in urls.items():
        with urllib.request.urlopen(url, timeout=10, context=context) as resp:  # noqa: S310
            text = resp.read().decode()
        assert _metric_gate(text, gate) == want, (
            f"{component}: kubernetes_feature_enabled for {gate} is "
            f"{_metric_gate(text, gate)}, want {want}")


# -- 4. faults on the real cluster ------------------------------------------------------------


def _pci_of(device: dict[str, Any]) -> str:
    return str(device["attributes"]["resource.kubernetes.io/pciBusID"]["string"])


def _gpu_ids(cluster: NativeCluster) -> dict[str, str]:
    """PCI address -> the profile's device id (gpu0...), from `sandbox fault list`."""
    listed = json.loads(cluster.sandbox_cli("fault", "list", "-o", "json"))[cluster.node.name]
    return {info["pci_address"]: name for name, info in listed.items() if info["kind"] == "gpu"}


def _taints(cluster: NativeCluster, pci: str) -> dict[str, list[dict[str, Any]]]:
    """Device name -> its taints, for the GPU at ``pci`` and each of its partitions."""
    return {n: d.get("taints", []) for n, d in slice_devices(cluster).items() if _pci_of(d) == pci}


def _pod_exists(cluster: NativeCluster, pod: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        cluster.core.read_namespaced_pod(pod, NS)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def test_an_unhealthy_gpu_evicts_its_partitions_pod_and_unplug_takes_them_away(
        cluster: NativeCluster) -> None:
    node, pod, claim = cluster.node.name, "taint-victim", "taint-part"
    _create_claim(cluster, claim, "gpu-partition.hwsandbox.dev",
                  f'device.attributes["{DRIVER}"].profile == "{PARTITION_PROFILE}"')
    cluster.core.create_namespaced_pod(NS, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                 "resourceClaims": [{"name": "part", "resourceClaimName": claim}],
                 "containers": [_container("part", "part")]},
    })  # fmt: skip
    ids = _gpu_ids(cluster)
    sick = ""
    try:
        wait_until(f"pod {pod} to run", lambda: phase(cluster, pod) == "Running", 120,
                   describe=lambda: events(cluster, pod) + _diagnose(cluster))
        (result,) = read_claim(cluster, claim)["status"]["allocation"]["devices"]["results"]
        pci = _pci_of(slice_devices(cluster)[result["device"]])
        sick = ids[pci]
        assert not any(_taints(cluster, pci).values())
        # the workshop view finds the native sandbox's API server through its record
        view = cluster.sandbox_cli("dra", "claims")
        assert claim in view, view
        assert pod in view, view

        cluster.sandbox_cli("fault", "health", node, sick, "unhealthy", "--reason", "aer-fatal")
        wait_until(f"a NoExecute taint on {sick} and every partition of it",
                   lambda: all(any(t["effect"] == "NoExecute" for t in ts)
                               for ts in _taints(cluster, pci).values()), 60,
                   describe=lambda: str(_taints(cluster, pci)) + _diagnose(cluster))
        assert len(_taints(cluster, pci)) > 1, "the GPU and its partitions"
        wait_until(f"the device-taint-eviction controller to evict {pod}",
                   lambda: not _pod_exists(cluster, pod), 90,
                   describe=lambda: events(cluster, pod)
                   + component_log(cluster, "kube-controller-manager"))
        assert "DeviceTaintManagerEviction" in events(cluster, pod), events(cluster, pod)

        cluster.sandbox_cli("fault", "health", node, sick, "healthy")
        wait_until(f"{sick}'s taints to go", lambda: not any(_taints(cluster, pci).values()), 60)
        sick = ""

        # Unplug a GPU nobody holds: it and its partitions leave the slices, and come back.
        other = next(a for a in sorted(ids) if a != pci)
        before = set(_taints(cluster, other))
        assert len(before) > 1, before
        cluster.sandbox_cli("fault", "unplug", node, ids[other])
        try:
            wait_until(f"{ids[other]}'s devices to leave the slices",
                       lambda: not _taints(cluster, other), 60, describe=lambda: _diagnose(cluster))
        finally:
            cluster.sandbox_cli("fault", "plug", node, ids[other])
        wait_until(f"{ids[other]}'s devices to come back",
                   lambda: set(_taints(cluster, other)) == before, 60,
                   describe=lambda: _diagnose(cluster))
    finally:
        if sick:
            cluster.sandbox_cli("fault", "health", node, sick, "healthy")
        delete_object(cluster, "pod", pod)
        delete_object(cluster, "resourceclaims", claim)

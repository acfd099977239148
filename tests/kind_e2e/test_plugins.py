"""Bundled manifests in kind: Intel's GPU plugin (unmodified, its image built here from its
Go module) and our DRA driver allocating a MIG-like partition to a pod."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from sandbox.runtimes._images import Layer, write_image
from tests.kind_e2e.conftest import REPO, KindSandbox
from tests.thirdparty import plugin_binary

INTEL_IMAGE = "intel/intel-gpu-plugin:0.36.0"
I915 = "gpu.intel.com/i915"


def _load_intel_image(sb: KindSandbox) -> None:
    """Intel's plugin binary (scripts/build-plugins) as the image its manifest names."""
    binary = plugin_binary("intel-gpu-plugin")
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "intel-gpu-plugin.oci.tar"
        entry = "/usr/local/bin/intel_gpu_device_plugin"
        write_image(archive, f"docker.io/{INTEL_IMAGE}",
                    Layer(files={entry: binary}, executables={entry}, dirs={"/tmp"}),
                    entrypoint=[entry])
        subprocess.run(["kind", "load", "image-archive", str(archive), "--name", sb.name],
                       check=True, capture_output=True, env=sb.kenv.env, timeout=300)


def test_intel_gpu_plugin_advertises_i915(sandbox_factory: Callable[..., KindSandbox]) -> None:
    sb = sandbox_factory("intel-flex-sriov.yaml", "hwsb-e2e-intel")
    # our reference plugin advertises i915 too: take it away first, so that what comes
    # back can only be Intel's plugin
    sb.kubectl("-n", "kube-system", "delete", "daemonset", "hw-sandbox-device-plugin",
               "--wait=true")
    sb.wait_for("the reference plugin's i915 devices are gone",
                lambda: sb.resource("flex-worker", I915)[1] == 0, timeout=120)
    _load_intel_image(sb)
    sb.sandbox("plugins", "deploy", "intel-gpu-plugin", "--name", sb.name)
    sb.wait_for(f"Intel's plugin advertises {I915}",
                lambda: sb.resource("flex-worker", I915)[1] > 0, timeout=120)
    capacity, allocatable = sb.resource("flex-worker", I915)
    print(f"Intel GPU plugin v0.36.0 in kind: {I915} capacity {capacity}, "
          f"allocatable {allocatable}")
    assert allocatable == 5  # the PF with VFs enabled is hidden; 1 PF + 4 VFs offered
    # the socket registered with the node's kubelet is Intel's, and the only plugin left
    sockets = subprocess.run(["docker", "exec", f"{sb.name}-worker", "ls",
                              "/var/lib/kubelet/device-plugins"], capture_output=True,
                             text=True, check=True).stdout.split()
    assert "gpu.intel.com-i915.sock" in sockets, sockets
    assert not [s for s in sockets if s.startswith("hwplugins-")], sockets


def test_dra_driver_allocates_a_mig_partition(
        sandbox_factory: Callable[..., KindSandbox]) -> None:
    sb = sandbox_factory("mig-partitions.yaml", "hwsb-e2e-dra")
    config = sb.sandbox("dra", "config", str(REPO / "profiles" / "mig-partitions.yaml")).stdout
    docs = [d for d in yaml.safe_load_all(
        (REPO / "plugins" / "manifests" / "hw-sandbox-dra-driver.yaml").read_text()) if d]
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            doc["data"]["config.yaml"] = config
    sb.kubectl("apply", "-f", "-", input_text=yaml.safe_dump_all(docs))
    sb.kubectl("apply", "-f", str(REPO / "examples" / "dra" / "deviceclasses.yaml"))
    sb.kubectl("apply", "-f", str(REPO / "examples" / "dra" / "mig-partitions.yaml"))
    sb.wait_for("the driver publishes partitions", lambda: "1g-10gb" in sb.kubectl(
        "get", "resourceslices", "-o", "json"), timeout=120)
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "mig-pod"},
        "spec": {
            "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": "mig-1g-10gb"}],
            "containers": [{
                "name": "c", "image": "hw-sandbox:latest", "imagePullPolicy": "Never",
                "command": ["sleep", "3600"],
                "resources": {"claims": [{"name": "mig"}]},
            }],
        },
    }
    sb.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
    # the claim made from the template lives as long as the pod: look while it runs
    sb.wait_for("the pod with the claim runs", lambda: sb.kubectl(
        "get", "pod", "mig-pod", "-o", "jsonpath={.status.phase}") == "Running", timeout=120)
    claims = json.loads(sb.kubectl("get", "resourceclaims", "-o", "json"))["items"]
    assert len(claims) == 1, claims
    results = claims[0]["status"]["allocation"]["devices"]["results"]
    assert len(results) == 1, results
    assert results[0]["driver"] == "dra.hwsandbox.dev", results
    assert "1g-10gb" in results[0]["device"], results
    assert claims[0]["status"]["reservedFor"][0]["name"] == "mig-pod"
    print(f"claim allocated {results[0]['pool']}/{results[0]['device']}; pod runs")
    sb.kubectl("delete", "pod", "mig-pod", "--wait=true")

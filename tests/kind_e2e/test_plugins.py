"""Bundled manifests in kind: Intel's GPU plugin (unmodified, its image built here from its
Go module), our DRA driver allocating a MIG-like partition to a pod, and NVIDIA's device
plugin then NVIDIA's DRA driver on our NVML. On the MIG profile's cluster first, another
topology policy (issue 22): under best-effort the kubelet admits a pod that
single-numa-node would reject (tests/kind_e2e/test_kind.py), with GPUs of both NUMA nodes."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from sandbox.images.oci import PATH, write_archive
from sandbox.images.tarfiles import layer_tar
from tests.kind_e2e.conftest import REPO, KindSandbox, Pristine, down
from tests.kind_e2e.test_kind import GPU, _held, _numa_of_gpus, _phase, _pod
from tests.support.thirdparty import plugin_binary

INTEL_IMAGE = "intel/intel-gpu-plugin:0.36.0"
I915 = "gpu.intel.com/i915"


def _load_intel_image(sb: KindSandbox) -> None:
    """Intel's plugin binary (scripts/build-plugins) as the image its manifest names."""
    binary = plugin_binary("intel-gpu-plugin")
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "intel-gpu-plugin.oci.tar"
        entry = "/usr/local/bin/intel_gpu_device_plugin"
        write_archive(archive, f"docker.io/{INTEL_IMAGE}",
                      [layer_tar({entry: binary}, {entry}, dirs={"/tmp"})],
                      {"Env": [PATH], "Entrypoint": [entry]})
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


@pytest.fixture(scope="module")
def mig(sandbox_factory: Callable[..., KindSandbox]) -> KindSandbox:
    """profiles/mig-partitions.yaml with our plugin: 2 A100s on each of 2 NUMA nodes, the
    kubelet's topology policy best-effort. One cluster for the two tests below (a kind
    cluster's ``up`` and ``down`` are ~45 s of the run)."""
    return sandbox_factory("mig-partitions.yaml", "hwsb-e2e-dra")


def test_best_effort_admits_more_gpus_than_one_numa_node_has(mig: KindSandbox) -> None:
    numa = _numa_of_gpus(mig, "mig-worker")
    assert sorted(numa.values()) == [0, 0, 1, 1], numa
    mig.kubectl("apply", "-f", "-", input_text=json.dumps(
        _pod("three-gpus", "sleep 3600", {GPU: "3"})))
    mig.wait_for("three-gpus running", lambda: _phase(mig, "three-gpus").startswith("Running"))
    _, given = _held(mig, "three-gpus", "mig-worker")
    assert len(given) == 3, given
    assert {numa[u] for u in given} == {0, 1}, given
    mig.kubectl("delete", "pod", "three-gpus", "--wait=true")


def test_dra_drivers_allocate_mig_devices(mig: KindSandbox) -> None:
    """Our DRA driver allocates a MIG-like partition to a pod; then NVIDIA's DRA driver, in
    its place, a MIG device (``_nvidia_dra_driver_mig``)."""
    sb = mig
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
            # `sleep` as PID 1 ignores SIGTERM: the default 30 s grace is the delete's wait
            "terminationGracePeriodSeconds": 1,
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
    # then NVIDIA's DRA driver in its place (one DRA driver publishing these GPUs)
    sb.kubectl("delete", "-f", "-", "--wait=true", input_text=yaml.safe_dump_all(docs))
    _nvidia_dra_driver_mig(sb)


NV_GPU = "nvidia.com/gpu"


def _load_nvidia_image(sb: KindSandbox) -> None:
    """NVIDIA's plugin and GFD binaries (scripts/build-plugins, unmodified) with the glibc
    they link, as the image the bundled manifest names (tests/nvidia.write_nvidia_image:
    the image is ours, there is no registry here; the programs are NVIDIA's)."""
    from tests.support.nvidia import write_nvidia_image

    with tempfile.TemporaryDirectory() as tmp:
        archive = write_nvidia_image(Path(tmp) / "nvidia-device-plugin.oci.tar")
        subprocess.run(["kind", "load", "image-archive", str(archive), "--name", sb.name],
                       check=True, capture_output=True, env=sb.kenv.env, timeout=300)


def test_nvidia_device_plugin_then_dra_driver_in_pods(demo_no_plugin: Pristine) -> None:
    """The bundled manifest, as a user applies it: NVIDIA's plugin in a pod on the node,
    our NVML mounted from the node, advertising the profile's 8 H100s; a fault reaches its
    own Xid health check. Then, in its place on the same node, NVIDIA's DRA driver
    (``_nvidia_dra_driver``). The sandbox (``demo_no_plugin``) is taken down at the end."""
    from tests.support.nvidia import nvml_library

    # without our reference plugin (test_intel_gpu_plugin_advertises_i915 deletes its
    # DaemonSet instead): nothing advertises the GPUs until NVIDIA's plugin does
    sb = demo_no_plugin.sandbox
    daemonsets = sb.kubectl("-n", "kube-system", "get", "daemonsets", "-o", "name").split()
    assert "daemonset.apps/hw-sandbox-device-plugin" not in daemonsets, daemonsets
    assert sb.resource("gpu-worker", NV_GPU) == (0, 0)
    _load_nvidia_image(sb)
    out = sb.sandbox("plugins", "deploy", "nvidia-device-plugin", "--name", sb.name).stdout
    # deploy put our NVML where the manifest mounts it from: the node's
    # /var/lib/hw-sandbox/nvml, which is this host directory (kind extraMounts)
    placed = sb.state_dir / "nodes" / "gpu-worker" / "nvml" / "libnvidia-ml.so.1"
    assert f"our NVML for the node's pods: {placed}" in out, out
    assert placed.read_bytes() == nvml_library().read_bytes()
    # our nvidia-smi beside it, on the node, answering from the node's tree
    listed = subprocess.run(["docker", "exec", "-e", "HWSANDBOX_NVML_ROOT=/var/lib/hw-sandbox/root",
                             f"{sb.name}-worker", "/var/lib/hw-sandbox/nvml/nvidia-smi", "-L"],
                            capture_output=True, text=True, check=True).stdout
    uuids = re.findall(r"^GPU \d: NVIDIA H100 80GB HBM3 \(UUID: (GPU-[0-9a-f-]+)\)$", listed,
                       re.MULTILINE)  # fmt: skip
    assert len(set(uuids)) == 8, listed
    took = sb.wait_for(f"NVIDIA's plugin advertises 8 {NV_GPU}",
                       lambda: sb.resource("gpu-worker", NV_GPU) == (8, 8), timeout=180)
    print(f"NVIDIA device plugin v0.18.0 in a kind pod: {NV_GPU} 8/8 after {took:.1f}s")
    sockets = subprocess.run(["docker", "exec", f"{sb.name}-worker", "ls",
                              "/var/lib/kubelet/device-plugins"], capture_output=True,
                             text=True, check=True).stdout.split()
    assert "nvidia-gpu.sock" in sockets, sockets
    assert not [s for s in sockets if s.startswith("hwplugins-")], sockets
    sb.sandbox("fault", "--name", sb.name, "health", "gpu-worker", "gpu3", "unhealthy",
               "--reason", "aer-fatal")
    took = sb.wait_for("NVIDIA's plugin marks gpu3 unhealthy (its Xid health check)",
                       lambda: sb.resource("gpu-worker", NV_GPU) == (8, 7), timeout=60)
    print(f"fault -> NVIDIA's plugin: allocatable 7 after {took:.1f}s")
    # gpu-feature-discovery, from the same manifest, labels what our NVML says
    gfd = "/etc/kubernetes/node-feature-discovery/features.d/gfd"
    sb.wait_for("gpu-feature-discovery writes its labels", lambda: subprocess.run(
        ["docker", "exec", f"{sb.name}-worker", "test", "-s", gfd]).returncode == 0, timeout=60)
    labels = subprocess.run(["docker", "exec", f"{sb.name}-worker", "cat", gfd],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for want in ("nvidia.com/gpu.count=8", "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
                 "nvidia.com/gpu.memory=81920", "nvidia.com/gpu.compute.major=9"):
        assert want in labels, labels
    sb.kubectl("-n", "kube-system", "delete", "daemonset", "nvidia-device-plugin",
               "gpu-feature-discovery", "--wait=true")
    _nvidia_dra_driver(sb, set(uuids))
    down(sb)  # its tree is faulted now; test_workflow.py needs only its state from before


def _minors(sb: KindSandbox) -> dict[str, int]:
    """GPU UUID -> device minor, from the node tree's driver information files."""
    out = subprocess.run(["docker", "exec", f"{sb.name}-worker", "sh", "-c",
                          "cat /var/lib/hw-sandbox/root/proc/driver/nvidia/gpus/*/information"],
                         capture_output=True, text=True, check=True).stdout
    return dict(zip(re.findall(r"GPU UUID:\s*(\S+)", out),
                    map(int, re.findall(r"Device Minor:\s*(\d+)", out)), strict=True))


def _deploy_nvidia_dra(sb: KindSandbox, node: str, want: int) -> dict[str, dict[str, str]]:
    """NVIDIA's DRA driver v0.4.1 (unmodified; image from its Go module, tests/support/
    nvidia.write_dra_image) by the bundled manifest, once it has published ``want``
    devices: device name -> its string/int attributes."""
    from tests.support.nvidia import write_dra_image

    with tempfile.TemporaryDirectory() as tmp:
        archive = write_dra_image(Path(tmp) / "nvidia-dra-driver.oci.tar")
        subprocess.run(["kind", "load", "image-archive", str(archive), "--name", sb.name],
                       check=True, capture_output=True, env=sb.kenv.env, timeout=300)
    sb.sandbox("plugins", "deploy", "nvidia-dra-driver", "--name", sb.name)
    assert (sb.state_dir / "nodes" / node / "driver" / "usr" / "bin" / "nvidia-smi").is_file()

    def published() -> dict[str, dict[str, str]]:
        slices = json.loads(sb.kubectl("get", "resourceslices", "-o", "json"))["items"]
        return {d["name"]: {k: str(next(iter(v.values()))) for k, v in d["attributes"].items()}
                for s in slices if s["spec"]["driver"] == "gpu.nvidia.com"
                for d in s["spec"]["devices"]}

    took = sb.wait_for(f"NVIDIA's DRA driver publishes {want} devices",
                       lambda: len(published()) == want, timeout=180)
    print(f"NVIDIA DRA driver v0.4.1 in a kind pod: {want} devices published after {took:.1f}s")
    return published()


def _claim_pod(sb: KindSandbox, name: str, exactly: dict[str, object],
               command: str) -> tuple[dict[str, str], str, str]:
    """A ResourceClaim and a pod using it that runs ``command`` then prints "done"; once
    it has: (the allocation result, the claim's CDI spec on the node, the pod's log). Both
    are deleted again."""
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": name},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"terminationGracePeriodSeconds": 1,
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                    "containers": [{"name": "c", "image": "hw-sandbox:latest",
                                    "imagePullPolicy": "Never",
                                    "command": ["sh", "-c", f"{command}; echo done; sleep 3600"],
                                    "resources": {"claims": [{"name": "gpu"}]}}]}}
    sb.kubectl("apply", "-f", "-", input_text=json.dumps(claim))
    sb.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
    try:
        sb.wait_for("the pod with NVIDIA's claim runs", lambda: sb.kubectl(
            "get", "pod", name, "-o", "jsonpath={.status.phase}") == "Running", timeout=180)
        got = json.loads(sb.kubectl("get", "resourceclaim", name, "-o", "json"))
        result = got["status"]["allocation"]["devices"]["results"][0]
        assert result["driver"] == "gpu.nvidia.com", result
        spec = subprocess.run(["docker", "exec", f"{sb.name}-worker", "cat",
                               f"/var/run/cdi/k8s.gpu.nvidia.com-claim_{got['metadata']['uid']}"
                               ".yaml"], capture_output=True, text=True, check=True).stdout
        sb.wait_for("the pod's output", lambda: "done" in sb.kubectl("logs", name).split(),
                    timeout=30)
        return result, spec, sb.kubectl("logs", name)
    finally:
        sb.kubectl("delete", "pod", name, "--wait=true", "--ignore-not-found")
        sb.kubectl("delete", "resourceclaim", name, "--wait=true", "--ignore-not-found")


def _nvidia_dra_driver(sb: KindSandbox, uuids: set[str]) -> None:
    """NVIDIA's DRA driver's slices list the node's 8 GPUs by UUID, and a claim's pod sees
    exactly the allocated GPU's /dev/nvidiaN (the node's containerd 2.x applies the
    driver's CDI spec)."""
    devices = _deploy_nvidia_dra(sb, "gpu-worker", 8)
    assert {d["uuid"] for d in devices.values()} == uuids, devices
    result, spec, log = _claim_pod(sb, "nv-gpu", {"deviceClassName": "gpu.nvidia.com"},
                                   "ls /dev")
    minor = _minors(sb)[devices[result["device"]]["uuid"]]
    assert f"/dev/nvidia{minor}" in spec, spec
    assert "/var/lib/hw-sandbox/driver/usr/lib/" in spec, spec
    assert sorted(n for n in log.split() if re.fullmatch(r"nvidia\d+", n)) == \
        [f"nvidia{minor}"], log  # fmt: skip


def _nvidia_dra_driver_mig(sb: KindSandbox) -> None:
    """On mig-partitions: the 16 MIG devices (4/4/8 by profile), and a 1g.10gb claim's pod
    with its parent's /dev/nvidiaN and two nvidia-caps nodes, which are /dev/null stand-ins
    (the CDI spec's 237:N never become real nodes: the runtime wrapper)."""
    devices = _deploy_nvidia_dra(sb, "mig-worker", 16)
    profiles = [d["profile"] for d in devices.values()]
    assert {p: profiles.count(p) for p in set(profiles)} == \
        {"3g.40gb": 4, "2g.20gb": 4, "1g.10gb": 8}, profiles  # fmt: skip
    one = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {
        "expression": "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]}
    result, spec, log = _claim_pod(
        sb, "nv-mig", one, "ls /dev; stat -c 'caps %n %t:%T' /dev/nvidia-caps/*")
    parent = _minors(sb)[devices[result["device"]]["parentUUID"]]
    assert sorted(n for n in log.split() if re.fullmatch(r"nvidia\d+", n)) == \
        [f"nvidia{parent}"], log  # fmt: skip
    caps = re.findall(r"^caps /dev/nvidia-caps/nvidia-cap(\d+) (\w+):(\w+)$", log, re.M)
    assert len(caps) == 2, log
    assert {(major, minor) for _, major, minor in caps} == {("1", "3")}, log
    for n, _, _ in caps:
        assert f"/dev/nvidia-caps/nvidia-cap{n}" in spec, spec
    assert "major: 237" in spec, spec


"""The reference DRA driver (``hwplugins.dra``) against the REAL kubelet (native runtime).

``dra_cluster``: profiles/8gpu-2numa.yaml (node gpu-worker, 8 H100 + 2 ConnectX-7) started
with ``NativeRuntime(dra_driver=True, reference_plugin=False)``: after the kubelet is
healthy the runtime starts ``python -m hwplugins.dra`` on the node's FUSE tree with the
kubelet's own ``/var/lib/kubelet/plugins_registry`` and ``plugins`` dirs, ``--cdi-dir
state_dir/cdi`` (containerd's ``cdi_spec_dirs``), ``--host-dev-dir state_dir/dev`` and the
partition config of ``sandbox dra config``. No device plugin runs: GPUs reach pods only
through claims. What is checked, end to end:

1. the kubelet's plugin watcher registers the driver (GetInfo, then
   NotifyRegistrationStatus) and the driver's ResourceSlice for the node appears;
2. a pod with a ResourceClaim for one whole GPU is scheduled (real scheduler), the real
   kubelet calls NodePrepareResources: the CDI spec exists and names the GPU's
   ``/dev/nvidiaN``, the kubelet's pod-resources API lists the claim with the CDI id the
   driver answered, the claim is reserved for the pod, and the pod runs with the GPU's
   device node;
3. deleting the pod makes the kubelet call NodeUnprepareResources: the CDI file is gone;
4. ``sandbox fault unplug`` of a GPU held by a running pod updates the ResourceSlice
   within seconds (pool generation bumped); unprepare still cleans up afterwards.

containerd is 2.x (scripts/build-containerd) with CDI: the container sees the GPU's device
node and the driver's env (a whole GPU and a partition in detail: test_native_dra_cdi.py).
"""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from cluster import (
    DRIVER,
    GROUP,
    NS,
    VERSION,
    NativeCluster,
    component_log,
    custom_objects,
    default_service_account,
    driver_slices,
    ensure_device_classes,
    events,
    gpu_minor,
    phase,
    pod_manifest,
    read_claim,
    wait_until,
)

from sandbox.runtimes.native import kubelet_root, running

HINT = ("see state_dir/logs/dra-driver.log and kubelet.log (copied to pytest's "
        "native-logs-8gpu-2numa* dir); sandbox.runtimes.native.start_dra_driver starts the "
        "driver")


# -- helpers -----------------------------------------------------------------------------


def _kubelet_dra_lines(cluster: NativeCluster) -> str:
    text = (cluster.layout.logs / "kubelet.log").read_text(errors="replace")
    lines = [line for line in text.splitlines() if DRIVER in line or "DRA" in line]
    return "\n--- kubelet.log, DRA lines ---\n" + "\n".join(lines[-20:])


def _diagnose(cluster: NativeCluster) -> Callable[[], str]:
    return lambda: (component_log(cluster, "dra-driver", 30) + _kubelet_dra_lines(cluster)
                    + "\n" + HINT)


def _device_names(cluster: NativeCluster) -> set[str]:
    return {d["name"] for s in driver_slices(cluster) for d in s["spec"].get("devices", [])}


def _generation(cluster: NativeCluster) -> int:
    return max((int(s["spec"]["pool"]["generation"]) for s in driver_slices(cluster)), default=0)


def _gpus(cluster: NativeCluster) -> dict[str, dict[str, Any]]:
    """Profile device id (gpu0...) -> `sandbox fault list` info (pci_address, numa_node)."""
    devices = json.loads(cluster.sandbox_cli("fault", "list", "-o", "json"))[cluster.node.name]
    return {name: info for name, info in devices.items() if info["kind"] == "gpu"}


def _dra_name(pci: str) -> str:
    return "gpu-" + pci.replace(":", "-").replace(".", "-")


def _cdi_files(cluster: NativeCluster) -> list[Path]:
    return sorted(cluster.layout.cdi.glob("*.json"))


def _checkpoint(cluster: NativeCluster) -> dict[str, Any]:
    claims: dict[str, Any] = json.loads(
        (cluster.layout.dra / "checkpoint.json").read_text())["claims"]
    return claims


def _unprepared(cluster: NativeCluster, claimed: ClaimedPod) -> bool:
    """The driver's NodeUnprepareResources finished for ``claimed``: its CDI file is gone
    and its checkpoint entry too (removed in that order, so a crash between is redone)."""
    return not claimed.cdi_file.exists() and claimed.uid not in _checkpoint(cluster)


def _dynamic_resources(pod: str) -> list[Any]:
    """The kubelet's pod-resources List: DynamicResource entries of default/``pod``'s main."""
    from cluster import pod_resources
    from hwplugins.api import podresources_v1_pb2 as pr

    with pod_resources() as stub:
        reply = stub.List(pr.ListPodResourcesRequest(), timeout=10)
    found = [p for p in reply.pod_resources if (p.namespace, p.name) == (NS, pod)]
    if not found:
        return []
    (container,) = found[0].containers
    return list(container.dynamic_resources)


class ClaimedPod:
    """A ResourceClaim for the whole GPU at ``pci`` and a busybox pod using it."""

    def __init__(self, cluster: NativeCluster, name: str, pci: str, command: str) -> None:
        self.cluster, self.name, self.pci = cluster, name, pci
        expr = f'device.attributes["resource.kubernetes.io"].pciBusID == "{pci}"'
        objects = custom_objects(cluster)
        objects.create_namespaced_custom_object(GROUP, VERSION, NS, "resourceclaims", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.hwsandbox.dev",
                "selectors": [{"cel": {"expression": expr}}]}}]}},
        })  # fmt: skip
        self.uid: str = read_claim(cluster, name)["metadata"]["uid"]
        pod = pod_manifest(name, command, resources={"claims": [{"name": "gpu"}]})
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": name}]
        cluster.core.create_namespaced_pod(NS, pod)

    @property
    def cdi_file(self) -> Path:
        return self.cluster.layout.cdi / f"hwsandbox.dev-gpu_{self.uid}.json"

    def wait_running(self) -> None:
        c = self.cluster
        wait_until(f"pod {self.name} (claim for GPU {self.pci}) to run",
                   lambda: phase(c, self.name) != "Pending", 120,
                   describe=lambda: events(c, self.name) + _diagnose(c)())
        assert phase(c, self.name) == "Running", events(c, self.name) + _diagnose(c)()

    def delete_pod(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.cluster.core.delete_namespaced_pod(self.name, NS, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def delete(self) -> None:
        from kubernetes.client.exceptions import ApiException

        self.delete_pod()
        try:
            custom_objects(self.cluster).delete_namespaced_custom_object(
                GROUP, VERSION, NS, "resourceclaims", self.name)
        except ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def cluster(dra_cluster: NativeCluster) -> Iterator[NativeCluster]:
    """The DRA cluster with its DeviceClasses, the default service account and the driver's
    slice published; the driver must still run afterwards."""
    wait_until("the DRA driver's ResourceSlice for the node",
               lambda: bool(driver_slices(dra_cluster)), 60, describe=_diagnose(dra_cluster))
    ensure_device_classes(dra_cluster)
    wait_until("the default service account", lambda: default_service_account(dra_cluster))
    yield dra_cluster
    assert running(dra_cluster.layout, "dra-driver") is not None, (
        "the DRA driver died during the test" + _diagnose(dra_cluster)())


# -- 1. registration -----------------------------------------------------------------------


def test_real_kubelet_registers_the_driver_and_its_slice_appears(cluster: NativeCluster) -> None:
    registry = kubelet_root() / "plugins_registry"
    reg_sock = registry / f"{DRIVER}-reg.sock"
    dra_sock = kubelet_root() / "plugins" / DRIVER / "dra.sock"
    assert stat.S_ISSOCK(reg_sock.stat().st_mode), f"{reg_sock} is not a socket; {HINT}"
    assert stat.S_ISSOCK(dra_sock.stat().st_mode), f"{dra_sock} is not a socket; {HINT}"

    kubelet_log = cluster.layout.logs / "kubelet.log"
    # The plugin watcher saw the socket and ran GetInfo (OperationExecutor.RegisterPlugin);
    # the DRA handler validated it and dialled dra.sock ("Connection changed"), and opened
    # the health stream because GetInfo listed v1alpha1.DRAResourceHealth.
    wanted = {
        "plugin watcher": f'"Adding socket path or updating timestamp to desired state cache" '
                          f'path="{reg_sock}"',
        "RegisterPlugin": '"OperationExecutor.RegisterPlugin started" plugin={"SocketPath":'
                          f'"{reg_sock}"',
        "DRA connection": f'"Connection changed" logger="DRA registration handler" '
                          f'driverName="{DRIVER}" endpoint="{dra_sock}" connected=true',
        "health stream": '"Successfully started WatchResources health stream"',
    }

    def missing() -> list[str]:
        text = kubelet_log.read_text(errors="replace")
        return [what for what, line in wanted.items() if line not in text]

    # NotifyRegistrationStatus(plugin_registered=true) is what makes the driver log this,
    # and `up` returned only after it (a claim's pod that reached the kubelet before would
    # fail and wait out the kubelet's back-off: 90 s seen)
    stamps = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
              for line in component_log(cluster, "dra-driver", 10_000).splitlines()
              if line.endswith(" registered with the kubelet")]
    assert stamps, _diagnose(cluster)()
    assert stamps[0] <= cluster.up_returned, (stamps[0], cluster.up_returned)
    wait_until("the kubelet to register the DRA driver", lambda: not missing(), 60,
               describe=lambda: f"not in kubelet.log: {missing()}" + _diagnose(cluster)())
    assert "kubelet rejected the registration" not in component_log(cluster, "dra-driver",
                                                                    10_000)

    (slice_,) = driver_slices(cluster)  # 10 devices: one slice
    spec = slice_["spec"]
    assert spec["nodeName"] == cluster.node.name == "gpu-worker"
    assert spec["pool"]["name"] == cluster.node.name
    assert spec["pool"]["resourceSliceCount"] == 1
    gpus = _gpus(cluster)
    assert len(gpus) == 8
    by_name = {d["name"]: d for d in spec["devices"]}
    assert {n for n in by_name if n.startswith("gpu-")} == {
        _dra_name(g["pci_address"]) for g in gpus.values()}
    assert len([n for n in by_name if n.startswith("nic-")]) == 2
    assert len(by_name) == 10, sorted(by_name)
    for g in gpus.values():  # the profile's NUMA placement reaches the scheduler
        attrs = by_name[_dra_name(g["pci_address"])]["attributes"]
        assert attrs["resource.kubernetes.io/numaNode"] == {"int": int(g["numa_node"])}
        assert attrs["resource.kubernetes.io/pciBusID"] == {"string": g["pci_address"]}


# -- 2 + 3. prepare / unprepare by the real kubelet ------------------------------------------


def test_claimed_gpu_is_prepared_and_unprepared_by_the_real_kubelet(
        cluster: NativeCluster) -> None:
    gpus = _gpus(cluster)
    pci = gpus["gpu5"]["pci_address"]  # NUMA 1, minor 5: not the first device of anything
    device = _dra_name(pci)
    minor = gpu_minor(cluster, pci)
    command = ("ls /dev | grep -E '^nvidia' || echo no-nvidia-nodes; "
               "echo \"visible=$NVIDIA_VISIBLE_DEVICES\"; sleep 3600")
    claimed = ClaimedPod(cluster, "dra-gpu5", pci, command)
    try:
        claimed.wait_running()
        pod = cluster.core.read_namespaced_pod(claimed.name, NS)
        assert pod.spec.node_name == cluster.node.name

        # The scheduler allocated exactly that GPU and reserved the claim for the pod.
        status = read_claim(cluster, claimed.name)["status"]
        (result,) = status["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"], result["request"]) == (
            DRIVER, cluster.node.name, device, "gpu")
        assert [(r["resource"], r["name"], r["uid"]) for r in status["reservedFor"]] == [
            ("pods", claimed.name, pod.metadata.uid)]

        # NodePrepareResources from the kubelet (nobody else dials dra.sock): the CDI spec
        # and the checkpoint entry exist, and the kubelet recorded the CDI id we answered.
        assert claimed.cdi_file.exists(), f"no {claimed.cdi_file}: {_cdi_files(cluster)}"
        spec = json.loads(claimed.cdi_file.read_text())
        assert spec["kind"] == "hwsandbox.dev/gpu"
        (cdi_dev,) = spec["devices"]
        assert cdi_dev["name"] == f"{claimed.uid}-{device}"
        nodes = cdi_dev["containerEdits"]["deviceNodes"]
        assert nodes[0]["path"] == f"/dev/nvidia{minor}"
        assert minor == 5
        assert "/dev/nvidiactl" in [n["path"] for n in nodes]
        for n in nodes:  # hostPath: the node's real device nodes the runtime made
            host = Path(n["hostPath"])
            assert host == cluster.layout.dev / n["path"].removeprefix("/dev/")
            assert stat.S_ISCHR(host.stat().st_mode), host
        assert list(_checkpoint(cluster)) == [claimed.uid]

        cdi_id = f"hwsandbox.dev/gpu={claimed.uid}-{device}"
        (dyn,) = _dynamic_resources(claimed.name)
        assert (dyn.claim_name, dyn.claim_namespace) == (claimed.name, NS)
        (res,) = dyn.claim_resources
        assert (res.driver_name, res.pool_name, res.device_name) == (
            DRIVER, cluster.node.name, device)
        assert [d.name for d in res.cdi_devices] == [cdi_id]

        # containerd 2.x applies the CDI spec: the GPU's node and its env reach the
        # container (both claims' kinds in detail: test_native_dra_cdi.py).
        def log() -> str:
            return str(cluster.core.read_namespaced_pod_log(claimed.name, NS))

        wait_until("the pod's output", lambda: "visible=" in log(), 30)
        listed = log().split("visible=")[0].split()
        assert f"nvidia{minor}" in listed, log()
        assert not {f"nvidia{m}" for m in range(8) if m != minor} & set(listed), log()
        visible = dict(e.split("=", 1) for e in cdi_dev["containerEdits"]["env"])
        assert f"visible={visible['NVIDIA_VISIBLE_DEVICES']}\n" in log(), log()

        # 3. Pod gone -> NodeUnprepareResources -> the CDI file is removed.
        t0 = time.monotonic()
        claimed.delete_pod()
        # The driver removes the CDI file, then rewrites its checkpoint: wait for both.
        wait_until("NodeUnprepareResources to remove the claim's CDI file and entry",
                   lambda: _unprepared(cluster, claimed), 90,
                   describe=lambda: f"still {_cdi_files(cluster)}, checkpoint "
                   f"{list(_checkpoint(cluster))}" + _diagnose(cluster)())
        print(f"CDI file removed {time.monotonic() - t0:.1f}s after the pod's deletion")
        assert _checkpoint(cluster) == {}
        assert _cdi_files(cluster) == []
        wait_until("the claim to be released and deallocated",
                   lambda: not read_claim(cluster, claimed.name).get("status"), 60,
                   describe=lambda: str(read_claim(cluster, claimed.name).get("status")))
    finally:
        claimed.delete()


# -- 4. unplug ---------------------------------------------------------------------------------


def test_unplugging_a_claimed_gpu_updates_the_slice(cluster: NativeCluster) -> None:
    node = cluster.node.name
    pci = _gpus(cluster)["gpu6"]["pci_address"]
    device = _dra_name(pci)
    claimed = ClaimedPod(cluster, "dra-gpu6", pci, "sleep 3600")
    try:
        claimed.wait_running()
        assert claimed.cdi_file.exists()
        assert device in _device_names(cluster)
        before = _generation(cluster)

        cluster.sandbox_cli("fault", "unplug", node, "gpu6")
        t0 = time.monotonic()
        wait_until(f"{device} to leave the node's ResourceSlice", lambda: (
            device not in _device_names(cluster)), 5, describe=_diagnose(cluster))
        latency = time.monotonic() - t0
        assert _generation(cluster) > before
        print(f"ResourceSlice updated {latency:.2f}s after `sandbox fault unplug` returned")
        assert len([n for n in _device_names(cluster) if n.startswith("gpu-")]) == 7
        # The pod keeps running (nothing evicts it: the device simply left the pool) ...
        assert phase(cluster, claimed.name) == "Running"
        # ... and once it is deleted the kubelet's unprepare cleans up for a device gone.
        claimed.delete_pod()
        wait_until("NodeUnprepareResources for the unplugged GPU's claim",
                   lambda: _unprepared(cluster, claimed), 90, describe=_diagnose(cluster))
        assert _checkpoint(cluster) == {}

        generation = _generation(cluster)
        cluster.sandbox_cli("fault", "plug", node, "gpu6")
        wait_until(f"{device} back in the ResourceSlice",
                   lambda: device in _device_names(cluster), 5, describe=_diagnose(cluster))
        assert _generation(cluster) > generation
    finally:
        claimed.delete()
        cluster.sandbox_cli("fault", "plug", node, "gpu6")  # idempotent

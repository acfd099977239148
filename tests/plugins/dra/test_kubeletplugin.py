"""The driver's kubelet side on a LIVE tree, with a real control plane allocating claims.

profiles/mig-partitions.yaml's mig-worker is mounted over FUSE (faults and hotplug through
its control socket, as ``sandbox fault`` does); the driver is a separate process reading
only the mount; the kubelet is the harness's ``PluginWatcher`` (registration, then
NodePrepareResources / NodeUnprepareResources over the driver's unix socket); claims are
allocated by the real kube-scheduler.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hwplugins.api import drahealth_v1_pb2, drahealth_v1_pb2_grpc
from hwplugins.api import drahealth_v1alpha1_pb2 as health_pb
from hwplugins.api import drahealth_v1alpha1_pb2_grpc as health_grpc
from kubernetes import client

from sandbox.draconfig import driver_config
from sandbox.kubelet import Claim, PluginWatcher
from sandbox.profile import load_profile
from tests.plugins.dra.controlplane import ControlPlane, add_node, apply_file, control_plane
from tests.support.paths import REPO
from tests.support.thirdparty import LiveNode, live_node, short_dir

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.network]

_health_stub: Callable[[grpc.Channel], Any] = health_grpc.DRAResourceHealthStub
PROFILE = REPO / "profiles/mig-partitions.yaml"
NODE = "mig-worker"
DRIVER = "dra.hwsandbox.dev"
GROUP, VERSION, NS = "resource.k8s.io", "v1", "default"


@dataclass
class Setup:
    live: LiveNode
    cp: ControlPlane
    objects: client.CustomObjectsApi
    core: client.CoreV1Api
    watcher: PluginWatcher
    dirs: Path
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    log: str = ""

    def start_driver(self) -> None:
        with (self.dirs / "driver.log").open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)

    def stop_driver(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            assert self.proc.wait(15) == 0, self.driver_log()
        self.proc = None

    def driver_log(self) -> str:
        return (self.dirs / "driver.log").read_text(errors="replace")[-4000:]

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            assert self.proc.poll() is None, self.driver_log()
            value = check()
            if value:
                return value
            time.sleep(0.05)
        pytest.fail(f"timed out ({timeout}s) waiting for {what}\n{self.driver_log()}",
                    pytrace=False)  # fmt: skip

    def slices(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.objects.list_cluster_custom_object(
            GROUP, VERSION, "resourceslices", field_selector=f"spec.nodeName={NODE}")["items"]
        return items

    def device_names(self) -> set[str]:
        return {d["name"] for s in self.slices() for d in s["spec"].get("devices", [])}

    def generation(self) -> int:
        return max(int(s["spec"]["pool"]["generation"]) for s in self.slices())

    def allocate(self, name: str, pci: str) -> Claim:
        """A whole-GPU claim for the GPU at ``pci`` and a pod using it; the scheduler
        allocates it. Returns the claim as the kubelet names it."""
        expr = f'device.attributes["resource.kubernetes.io"].pciBusID == "{pci}"'
        self.objects.create_namespaced_custom_object(GROUP, VERSION, NS, "resourceclaims", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.hwsandbox.dev",
                "selectors": [{"cel": {"expression": expr}}]}}]}},
        })  # fmt: skip
        self.core.create_namespaced_pod(NS, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE},
                     "resourceClaims": [{"name": "c", "resourceClaimName": name}],
                     "containers": [{"name": "m", "image": "registry.invalid/never:pulled",
                                     "resources": {"claims": [{"name": "c"}]}}]},
        })  # fmt: skip

        def allocated() -> dict[str, Any] | None:
            claim: dict[str, Any] = self.objects.get_namespaced_custom_object(
                GROUP, VERSION, NS, "resourceclaims", name)
            return claim if (claim.get("status") or {}).get("allocation") else None

        claim = self.wait(f"claim {name} allocated", allocated)
        return Claim(NS, claim["metadata"]["uid"], name)


def _driver_argv(live: LiveNode, cp: ControlPlane, dirs: Path) -> list[str]:
    """The driver's command line on the live node, its dirs made below ``dirs``."""
    spec = load_profile(str(PROFILE)).cluster.node(NODE)
    assert spec is not None
    add_node(cp.api(), NODE)
    for d in ("plugins", "registry", "cdi"):
        (dirs / d).mkdir()
    (dirs / "config.json").write_text(json.dumps(driver_config(spec)))
    return [sys.executable, "-m", "hwplugins.dra", "--root", str(live.root),
            "--node-name", NODE, "--kubeconfig", str(cp.kubeconfig),
            "--config", str(dirs / "config.json"), "--plugins-dir", str(dirs / "plugins"),
            "--registry-dir", str(dirs / "registry"), "--cdi-dir", str(dirs / "cdi")]


@pytest.fixture
def setup() -> Iterator[Setup]:
    with live_node(str(PROFILE), NODE) as live, short_dir("dra-") as dirs, \
            control_plane(scheduler=True) as cp:  # fmt: skip
        api = cp.api()
        argv = _driver_argv(live, cp, dirs)
        apply_file(api, REPO / "examples/dra/deviceclasses.yaml")
        with PluginWatcher(dirs / "registry") as watcher:
            s = Setup(live, cp, client.CustomObjectsApi(api), client.CoreV1Api(api), watcher,
                      dirs, argv)  # fmt: skip
            s.start_driver()
            try:
                s.wait("slices published", s.slices)
                yield s
            finally:
                s.stop_driver()


def test_slices_wait_for_the_kubelets_registration() -> None:
    """A slice lets the scheduler allocate at once; a claim that reaches the kubelet before
    the driver does fails to prepare and is retried a minute later (seen in kind). So the
    driver publishes nothing until the kubelet has registered it, then at once."""
    with live_node(str(PROFILE), NODE) as live, short_dir("dra-") as dirs, \
            control_plane() as cp:  # fmt: skip
        api = cp.api()
        s = Setup(live, cp, client.CustomObjectsApi(api), client.CoreV1Api(api),
                  PluginWatcher(dirs / "registry"), dirs, _driver_argv(live, cp, dirs))
        s.start_driver()
        try:
            # logged where the pool is ready to publish: before this change, published there
            s.wait("the driver waiting for the kubelet", lambda: "waiting for the kubelet "
                   "to register the driver" in s.driver_log())
            time.sleep(1)  # a publish takes ~20 ms: any publish would show by now
            assert s.slices() == [], s.slices()
            with s.watcher:
                s.watcher.wait_registered(DRIVER, 15)
                s.wait("slices published", s.slices, timeout=15)
        finally:
            s.stop_driver()


def _gpus(live: LiveNode) -> dict[str, str]:
    """Profile device id (gpu0...) -> PCI address, from the control API."""
    with live.client() as c:
        return {k: v["pci_address"] for k, v in c.devices().items() if v["kind"] == "gpu"}


def test_prepare_writes_cdi_and_survives_a_driver_restart(setup: Setup) -> None:
    plugin = setup.watcher.wait_registered(DRIVER, 15)
    assert plugin.version == "v1.DRAPlugin"  # the first service we offer that it knows
    pci = _gpus(setup.live)["gpu0"]
    claim = setup.allocate("train", pci)
    response = setup.watcher.prepare(DRIVER, [claim])
    prepared = response[claim.uid]
    assert prepared.error == ""
    [dev] = prepared.devices
    gpu = "gpu-" + pci.replace(":", "-").replace(".", "-")
    assert (dev.pool_name, dev.device_name, list(dev.request_names)) == (NODE, gpu, ["gpu"])
    cdi_id = f"hwsandbox.dev/gpu={claim.uid}-{gpu}"
    assert list(dev.cdi_device_ids) == [cdi_id]
    spec_file = setup.dirs / "cdi" / f"hwsandbox.dev-gpu_{claim.uid}.json"
    spec = json.loads(spec_file.read_text())
    assert spec["kind"] == "hwsandbox.dev/gpu"
    assert spec["cdiVersion"]
    [cdi_dev] = spec["devices"]
    assert cdi_dev["name"] == f"{claim.uid}-{gpu}"
    info = (setup.live.root / "proc/driver/nvidia/gpus" / pci / "information").read_text()
    minor = next(line.split(":")[1].strip() for line in info.splitlines()
                 if line.startswith("Device Minor"))  # fmt: skip
    paths = [n["path"] for n in cdi_dev["containerEdits"]["deviceNodes"]]
    assert paths[0] == f"/dev/nvidia{minor}"
    assert "/dev/nvidiactl" in paths
    assert all((setup.live.root / p.lstrip("/")).exists() for p in paths)
    # Idempotent: the same answer again.
    assert list(setup.watcher.prepare(DRIVER, [claim])[claim.uid].devices[0].cdi_device_ids) \
        == [cdi_id]  # fmt: skip

    # Restart the driver with the claim prepared: nothing is lost. Wait for a registration
    # made after the restart (the watcher may not have seen the old socket go yet).
    seen = len(setup.watcher.events)
    setup.stop_driver()
    setup.start_driver()
    registered = setup.wait("re-registration", lambda: any(
        e.kind == "register" for e in setup.watcher.events[seen:]))  # fmt: skip
    assert registered
    setup.watcher.wait_registered(DRIVER, 15)
    checkpoint = json.loads((setup.dirs / "plugins" / DRIVER / "checkpoint.json").read_text())
    assert list(checkpoint["claims"]) == [claim.uid]
    again = setup.watcher.prepare(DRIVER, [claim])[claim.uid]
    assert list(again.devices[0].cdi_device_ids) == [cdi_id]
    assert spec_file.exists()
    assert setup.watcher.unprepare(DRIVER, [claim])[claim.uid].error == ""
    assert not spec_file.exists()
    checkpoint = json.loads((setup.dirs / "plugins" / DRIVER / "checkpoint.json").read_text())
    assert checkpoint["claims"] == {}
    assert setup.watcher.unprepare(DRIVER, [claim])[claim.uid].error == ""  # idempotent


def test_unplug_updates_the_slice_and_unprepare_still_works(setup: Setup) -> None:
    setup.watcher.wait_registered(DRIVER, 15)
    gpus = _gpus(setup.live)
    claim = setup.allocate("infer", gpus["gpu1"])
    assert setup.watcher.prepare(DRIVER, [claim])[claim.uid].error == ""
    gpu = "gpu-" + gpus["gpu1"].replace(":", "-").replace(".", "-")
    assert gpu in setup.device_names()
    before = setup.generation()
    with setup.live.client() as control:
        t0 = time.monotonic()
        control.unplug("gpu1")
        setup.wait(f"{gpu} gone from the slices", lambda: gpu not in setup.device_names()
                   and not any(n.startswith(gpu) for n in setup.device_names()), timeout=2)
        latency = time.monotonic() - t0
        assert setup.generation() > before
        print(f"slice update after unplug: {latency:.2f}s")
        # The claim's device left the node: unprepare still cleans up.
        assert setup.watcher.unprepare(DRIVER, [claim])[claim.uid].error == ""
        assert not list((setup.dirs / "cdi").iterdir())
        generation = setup.generation()
        control.plug("gpu1")
        setup.wait(f"{gpu} back", lambda: gpu in setup.device_names(), timeout=2)
        assert setup.generation() > generation
    # A claim for a device that is gone cannot be prepared: the kubelet gets the error.
    other = setup.allocate("late", gpus["gpu2"])
    with setup.live.client() as control:
        control.unplug("gpu2")
        setup.wait("gpu2 gone", lambda: not any(
            gpus["gpu2"].replace(":", "-").replace(".", "-") in n
            for n in setup.device_names()), timeout=5)  # fmt: skip
        error = setup.watcher.prepare(DRIVER, [other])[other.uid].error
        control.plug("gpu2")
    assert "not on this node" in error


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_health_stream_reports_faults(setup: Setup, version: str) -> None:
    """Both versions the kubelet may pick: a fault's reason and evidence in ``message``
    (the GPU's and its partitions'), HEALTHY with no message once healed, the declared
    timeout on every report."""
    pb, grpc_mod = ((drahealth_v1_pb2, drahealth_v1_pb2_grpc) if version == "v1"
                    else (health_pb, health_grpc))
    setup.watcher.wait_registered(DRIVER, 15)
    gpus = _gpus(setup.live)
    gpu = "gpu-" + gpus["gpu3"].replace(":", "-").replace(".", "-")
    endpoint = setup.dirs / "plugins" / DRIVER / "dra.sock"
    with grpc.insecure_channel(f"unix://{endpoint}") as channel:
        stream = grpc_mod.DRAResourceHealthStub(channel).NodeWatchResources(
            pb.NodeWatchResourcesRequest(), timeout=30)
        first = next(stream)
        health = {d.device.device_name: (d.health, d.message) for d in first.devices}
        assert health[gpu] == (pb.HEALTHY, "")
        assert {d.device.pool_name for d in first.devices} == {NODE}
        assert {d.health_check_timeout_seconds for d in first.devices} == {30}
        with setup.live.client() as control:
            control.health("gpu3", "unhealthy", "aer-fatal")
            for update in stream:
                health = {d.device.device_name: (d.health, d.message) for d in update.devices}
                if health[gpu][0] == pb.UNHEALTHY:
                    break
            # its partitions are as unhealthy as the GPU, with the GPU's message
            state, message = health[gpu]
            assert message.startswith("aer-fatal: "), message
            assert health[f"{gpu}-1g-10gb-0"] == (pb.UNHEALTHY, message)
            control.health("gpu3", "healthy")
            for update in stream:
                health = {d.device.device_name: (d.health, d.message) for d in update.devices}
                if health[gpu][0] == pb.HEALTHY:
                    break
            assert health[gpu] == health[f"{gpu}-1g-10gb-0"] == (pb.HEALTHY, "")
        stream.cancel()
    taints = setup.wait("taint cleared", lambda: [
        d for s in setup.slices() for d in s["spec"].get("devices", [])
        if d["name"] == gpu and "taints" not in d])  # fmt: skip
    assert taints

"""The reference DRA driver's ResourceSlices: built from rendered trees, judged by a REAL
kube-apiserver (v1.37, server-side validation on create) with its default feature gates:
DRAPartitionableDevices and DRAConsumableCapacity are beta/on, DRADeviceTaints GA.
Compatibility groups and optional node operations (alpha DRADeviceCompatibilityGroups,
DRAOptionalNodeOperations) get an apiserver of their own.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hwplugins.dra import TAINT_KEY, build_pool, discover, parse_config, resource_slices
from kubernetes import client
from kubernetes.client.rest import ApiException

from sandbox.draconfig import driver_config, node_slices
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.fakehw.tree import DeviceState, Health, Reason
from sandbox.profile import NodeSpec, load_profile
from sandbox.runtimes.native.common import bin_dir
from tests.plugins.dra.controlplane import HINT, ControlPlane, control_plane
from tests.support.paths import REPO

pytestmark = [pytest.mark.root, pytest.mark.network]

PROFILES = sorted((REPO / "profiles").glob("*.yaml")) + [
    REPO / "tests/data/dra-nic-gpu.yaml", REPO / "tests/data/dra-two-gpus.yaml"]
CASES = [(p, n.name) for p in PROFILES for n in load_profile(str(p)).cluster.nodes]
EXAMPLES = sorted((REPO / "examples" / "dra").glob("*.yaml"))
GROUP, VERSION = "resource.k8s.io", "v1"


def _node(profile: Path | str, name: str | None = None) -> NodeSpec:
    cluster = load_profile(str(REPO / profile)).cluster
    node = cluster.node(name) if name else cluster.nodes[0]
    assert node is not None
    return node


def _pool_slices(node: NodeSpec, states: dict[str, DeviceState] | None = None,
                 groups: bool = False, skip: tuple[str, ...] = (),
                 ) -> list[dict[str, Any]]:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hwsb-dra-") as tmp:
        render(build_tree(node, states), tmp, force=True)
        pool = build_pool(discover(tmp), parse_config(driver_config(node)), groups, skip)
    return resource_slices(pool, node.name)


def _devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def _without_time_added(spec: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    for dev in spec.get("devices", []):
        for taint in dev.get("taints", []):
            taint.pop("timeAdded", None)
    return spec


@pytest.fixture(scope="module")
def apiserver() -> Iterator[ControlPlane]:
    with control_plane() as cp:
        yield cp


def _create_all(cp: ControlPlane, slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    objects = client.CustomObjectsApi(cp.api())
    created = []
    try:
        for s in slices:
            try:
                created.append(objects.create_cluster_custom_object(
                    GROUP, VERSION, "resourceslices", s))  # fmt: skip
            except ApiException as exc:
                pytest.fail(f"kube-apiserver rejected {s['metadata']['name']}:\n{exc.body}\n"
                            f"{yaml.safe_dump(s)}", pytrace=False)  # fmt: skip
    finally:
        for s in slices:
            try:
                objects.delete_cluster_custom_object(GROUP, VERSION, "resourceslices",
                                                     s["metadata"]["name"])  # fmt: skip
            except ApiException as exc:
                if exc.status != 404:
                    raise
    return created


@pytest.mark.parametrize(("profile", "node"), CASES,
                         ids=[f"{p.stem}-{n}" for p, n in CASES])  # fmt: skip
def test_apiserver_accepts_every_profile(apiserver: ControlPlane, profile: Path,
                                         node: str) -> None:  # fmt: skip
    slices = node_slices(_node(profile, node))
    created = _create_all(apiserver, slices)
    for sent, got in zip(slices, created, strict=True):
        # Nothing silently dropped (a disabled feature gate drops its fields).
        assert _without_time_added(got["spec"]) == sent["spec"]


def test_unhealthy_devices_are_tainted_and_accepted(apiserver: ControlPlane) -> None:
    node = _node("tests/data/dra-nic-gpu.yaml")
    gpu = next(d.id for d in node.devices if d.kind == "gpu")
    nic = next(d.id for d in node.devices if d.kind == "nic")
    states = {gpu: DeviceState(Health.UNHEALTHY, Reason.AER_FATAL),
              nic: DeviceState(Health.UNHEALTHY, Reason.LINK_DOWN)}  # fmt: skip
    slices = _pool_slices(node, states)
    devices = _devices(slices)
    gpu_devices = [d for n, d in devices.items() if n.startswith("gpu-")]
    assert len(gpu_devices) > 1  # the whole GPU and its partitions
    for dev in gpu_devices:
        assert dev["taints"] == [{"key": TAINT_KEY, "value": "aer-fatal", "effect": "NoExecute"}]
    nic_dev = next(d for n, d in devices.items() if n.startswith("nic-"))
    assert nic_dev["taints"] == [{"key": TAINT_KEY, "value": "link-down", "effect": "NoSchedule"}]
    created = _create_all(apiserver, slices)
    got = _devices(created)
    assert got[nic_dev["name"]]["taints"][0]["timeAdded"]  # the server stamps it


def test_partitionable_gpus_share_counters() -> None:
    slices = _pool_slices(_node("profiles/mig-partitions.yaml"))
    counters = [s for s in slices if "sharedCounters" in s["spec"]]
    assert len(counters) == 1
    sets = {c["name"]: c["counters"] for c in counters[0]["spec"]["sharedCounters"]}
    assert len(sets) == 4
    full = {"memory-slices": {"value": "8"}, "compute-slices": {"value": "7"},
            "memory": {"value": "80Gi"}}  # fmt: skip
    assert all(c == full for c in sets.values())
    devices = _devices(slices)
    gpu = "gpu-0000-01-00-0"
    assert devices[gpu]["consumesCounters"] == [{"counterSet": gpu, "counters": full}]
    profiles: dict[str, int] = {}
    for dev in devices.values():
        attrs = dev["attributes"]
        if attrs["type"]["string"] == "gpu-partition" and attrs["parent"]["string"] == gpu:
            profiles[attrs["profile"]["string"]] = profiles.get(attrs["profile"]["string"], 0) + 1
    # instances per GPU: min(8 / memory slices, 7 / compute slices)
    assert profiles == {"1g.10gb": 7, "2g.20gb": 3, "3g.40gb": 2, "7g.80gb": 1}
    part = devices[f"{gpu}-3g-40gb-1"]
    assert part["consumesCounters"] == [{"counterSet": gpu, "counters": {
        "memory-slices": {"value": "4"}, "compute-slices": {"value": "3"},
        "memory": {"value": "40Gi"}}}]  # fmt: skip
    assert all(len(s["spec"].get("devices", [])) <= 64 for s in slices)
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}


def test_standard_attributes_and_nic_bandwidth() -> None:
    devices = _devices(_pool_slices(_node("tests/data/dra-nic-gpu.yaml")))
    nic = devices["nic-0000-01-00-0"]
    assert nic["allowMultipleAllocations"] is True
    assert nic["capacity"]["bandwidth"]["value"] == "10G"
    assert nic["capacity"]["bandwidth"]["requestPolicy"]["default"] == "1G"
    attrs = nic["attributes"]
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": "0000:01:00.0"}
    assert attrs["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert attrs["resource.kubernetes.io/numaNode"] == {"int": 0}


def test_alpha_fields_need_their_gates(apiserver: ControlPlane) -> None:
    """``--compatibility-groups`` and ``--skip-node-operations``: an apiserver with default
    gates silently DROPS ``compatibilityGroups`` and ``skipNodeOperations`` (why both are
    off by default); with DRADeviceCompatibilityGroups and DRAOptionalNodeOperations on,
    the slices come back exactly as sent."""
    node = _node("tests/data/dra-nic-gpu.yaml")
    slices = _pool_slices(node, groups=True, skip=("nic",))
    modes = {d["attributes"]["mode"]["string"] for d in _devices(slices).values()
             if "mode" in d["attributes"]}  # fmt: skip
    assert modes == {"mig", "vgpu"}
    skipping = [s for s in slices if s["spec"].get("skipNodeOperations")]
    assert [[d["name"] for d in s["spec"]["devices"]] for s in skipping] == [
        ["nic-0000-01-00-0"]]
    assert skipping[0]["spec"]["skipNodeOperations"] == ["*"]
    assert _devices(skipping)["nic-0000-01-00-0"]["attributes"]["controlPlaneOnly"] == {
        "bool": True}
    dropped = _create_all(apiserver, slices)
    assert not any("compatibilityGroups" in c for s in dropped for d in s["spec"].get(
        "devices", []) for c in d.get("consumesCounters", []))  # fmt: skip
    assert not any("skipNodeOperations" in s["spec"] for s in dropped)
    with control_plane({"DRADeviceCompatibilityGroups": True,
                        "DRAOptionalNodeOperations": True}) as alpha:  # fmt: skip
        kept = _create_all(alpha, slices)
    for sent, got in zip(slices, kept, strict=True):
        assert _without_time_added(got["spec"]) == sent["spec"]


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_examples_are_accepted(apiserver: ControlPlane, example: Path) -> None:
    """Every object of every example, created for real (server-side dry run for Pods)."""
    api = client.CustomObjectsApi(apiserver.api())
    core = client.CoreV1Api(apiserver.api())
    for doc in yaml.safe_load_all(example.read_text()):
        name = doc["metadata"]["name"]
        try:
            if doc["kind"] == "Pod":
                core.create_namespaced_pod("default", doc, dry_run="All")
                continue
            plural = {"DeviceClass": "deviceclasses", "ResourceClaim": "resourceclaims",
                      "ResourceClaimTemplate": "resourceclaimtemplates"}[doc["kind"]]  # fmt: skip
            if plural == "deviceclasses":
                api.create_cluster_custom_object(GROUP, VERSION, plural, doc)
                api.delete_cluster_custom_object(GROUP, VERSION, plural, name)
            else:
                api.create_namespaced_custom_object(GROUP, VERSION, "default", plural, doc)
                api.delete_namespaced_custom_object(GROUP, VERSION, "default", plural, name)
        except ApiException as exc:
            pytest.fail(f"{example.name}: {doc['kind']} {name} rejected:\n{exc.body}",
                        pytrace=False)  # fmt: skip


def test_cli_prints_slices_and_config() -> None:
    out = subprocess.run([sys.executable, "-m", "sandbox", "dra", "slices",
                          str(REPO / "profiles/mig-partitions.yaml")],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["ResourceSlice", "ResourceSlice"]
    out = subprocess.run([sys.executable, "-m", "sandbox", "dra", "config",
                          str(REPO / "profiles/mig-partitions.yaml"), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    config = parse_config(json.loads(out))
    model = config.model("10de:20b2")
    assert model.memory == 80 * 2**30
    assert model.partitions is not None
    assert [p.name for p in model.partitions.profiles] == ["1g.10gb", "2g.20gb", "3g.40gb",
                                                           "7g.80gb"]  # fmt: skip


def test_driver_manifest_is_accepted(apiserver: ControlPlane) -> None:
    kubectl = bin_dir() / "kubectl"
    if not kubectl.is_file():
        pytest.fail(f"missing {kubectl}: {HINT}", pytrace=False)
    manifest = REPO / "plugins/manifests/hw-sandbox-dra-driver.yaml"
    proc = subprocess.run([str(kubectl), f"--kubeconfig={apiserver.kubeconfig}", "apply",
                           "--dry-run=server", "-f", str(manifest)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "daemonset.apps/hw-sandbox-dra-driver created (server dry run)" in proc.stdout
    config = yaml.safe_load(next(d for d in yaml.safe_load_all(manifest.read_text())
                                 if d["kind"] == "ConfigMap")["data"]["config.yaml"])  # fmt: skip
    assert parse_config(config).models == {}


def test_compatibility_groups_of_the_config(tmp_path: Path) -> None:
    """``partitions.compatibilityGroups`` maps a mode to its groups ([] = none); bad ones
    are named, with no traceback, by the driver."""
    config = driver_config(_node("tests/data/dra-nic-gpu.yaml"))
    parts = config["models"]["10de:20b2"]["partitions"]
    parts["compatibilityGroups"] = {"vgpu": []}
    partitioning = parse_config(config).model("10de:20b2").partitions
    assert partitioning is not None
    assert partitioning.compatibility_groups("mig") == ("mig",)
    assert partitioning.compatibility_groups("vgpu") == ()
    parts["compatibilityGroups"] = {"mig": ["a", "b", "c"], "tpu": ["x"], "vgpu": ["Bad_"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "hwplugins.dra", "--root", str(tmp_path),
                           "--node-name", "n", "--config", str(tmp_path / "config.json"),
                           "--print-slices"], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    for where in ("compatibilityGroups['mig']: want at most 2 distinct names",
                  "compatibilityGroups['tpu']: not one of the modes",
                  "compatibilityGroups['vgpu']: want at most 2"):  # fmt: skip
        assert where in proc.stderr, proc.stderr

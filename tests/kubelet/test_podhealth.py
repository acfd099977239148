"""Per-pod device health without a cluster: the scenario form ``expect: {pod: ...,
device: ..., health: ...}`` (parsing, located errors, the check and its verdicts), the
mapping of a kubelet's resource ids (device plugin and DRA) onto the profile's device
ids, and how ``sandbox status`` shows the entries (table, JSON, picture). The API server
side is tests/plugins/dra/test_pod_health.py."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from sandbox.cli.status import pod_health_lines, pod_unhealthy, to_json, whole_device_names
from sandbox.draw import DeviceView, topology_svg
from sandbox.errors import ScenarioError
from sandbox.fakehw.control.scenario import (
    PodCheck,
    PodExpect,
    parse_scenario,
    parse_scenario_text,
    run_scenario,
)
from sandbox.podhealth import (
    PodDeviceHealth,
    device_owners,
    dra_owners,
    owner_of,
    pod_health,
)
from sandbox.profile import load_profile
from sandbox.runtimes.base import NodeStatus, SandboxStatus
from tests.support.paths import REPO

SVG = "{http://www.w3.org/2000/svg}"


class _Devices:
    """A control client with nothing to change: only expectations run."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        self.requests.append((op, fields))
        return {"changed": True, "state": {}}

    def devices(self) -> dict[str, dict[str, Any]]:
        return {"gpu3": {"state": {"health": "unhealthy", "plugged": True}}}


# -- the scenario form --------------------------------------------------------------------
def test_pod_expectation_parses_next_to_the_device_form() -> None:
    sc = parse_scenario({"steps": [
        {"at": 1, "do": "health", "device": "gpu3", "health": "unhealthy",
         "reason": "aer-fatal"},
        {"at": 6, "expect": {"pod": "default/train", "device": "gpu3", "health": "Unhealthy"}},
        {"at": 7, "expect": {"pod": "train", "device": "gpu3", "health": "Healthy",
                             "container": "main"}},
        {"at": 8, "expect": {"gpu3": {"plugged": True}}},
    ]})
    assert sc.steps[1].pod_expect == PodExpect("default", "train", "gpu3", "Unhealthy")
    assert sc.steps[1].expect is None
    assert sc.steps[2].pod_expect == PodExpect("default", "train", "gpu3", "Healthy", "main")
    assert sc.steps[3].pod_expect is None
    assert sc.steps[3].expect == {"gpu3": {"plugged": True}}
    ns = parse_scenario({"steps": [{"at": 0, "expect": {
        "pod": "ml/train", "device": "0000:82:00.0", "health": "Unknown"}}]})
    assert ns.steps[0].pod_expect == PodExpect("ml", "train", "0000:82:00.0", "Unknown")


POD_ERRORS = """\
steps:
  - {at: 1, expect: {pod: a/b/c, device: "", health: unhealthy, container: 3, colour: red}}
  - at: 2
    expect:
      pod: train
      health: Sick
"""


def test_pod_expectation_errors_are_located_and_all_reported() -> None:
    with pytest.raises(ScenarioError) as exc:
        parse_scenario_text(POD_ERRORS, source="s.yaml")
    assert exc.value.problems == [
        "s.yaml:2:79: steps[0].expect.colour: unknown field "
        "(expected pod, device, health, container)",
        "s.yaml:2:27: steps[0].expect.pod: expected NAMESPACE/NAME or NAME (namespace "
        "default), e.g. default/train",
        "s.yaml:2:42: steps[0].expect.device: expected a device id such as gpu3 (or the "
        "kubelet's resource id)",
        "s.yaml:2:54: steps[0].expect.health: expected one of Healthy, Unhealthy, Unknown "
        "(as the kubelet writes it)",
        "s.yaml:2:76: steps[0].expect.container: expected a container name",
        "s.yaml:5:7: steps[1].expect.device: expected a device id such as gpu3 (or the "
        "kubelet's resource id)",
        "s.yaml:6:15: steps[1].expect.health: expected one of Healthy, Unhealthy, Unknown "
        "(as the kubelet writes it)",
    ]


def test_a_pod_key_that_is_no_string_is_the_device_form() -> None:
    with pytest.raises(ScenarioError) as exc:
        parse_scenario({"steps": [{"at": 0, "expect": {"pod": {"plugged": True},
                                                       "gpu0": {"health": "Unhealthy"}}}]},
                       source="s.yaml")
    assert exc.value.problems == ["s.yaml: steps[0].expect.gpu0.health: expected healthy or "
                                  "unhealthy"]


# -- the check ----------------------------------------------------------------------------
SEEN: dict[tuple[str, str], list[tuple[str, str, str]]] = {
    # (namespace, pod) -> (container, device, health) of its status
    ("default", "train"): [("main", "gpu3", "Unhealthy"), ("main", "gpu1", "Healthy"),
                           ("side", "gpu1", "Unhealthy")],
    ("ml", "two"): [("main", "gpu0", "Unhealthy"), ("main", "gpu0", "Healthy")],
}


def _pod_health(namespace: str, pod: str, device: str, container: str | None
                ) -> list[tuple[str, str]]:
    return [(f"id-{dev}-{k}", health)
            for k, (c, dev, health) in enumerate(SEEN.get((namespace, pod), []))
            if dev == device and container in (None, c)]


def test_pod_checks_and_what_they_say() -> None:
    sc = parse_scenario({"steps": [
        {"at": 0, "expect": {"pod": "default/train", "device": "gpu3", "health": "Unhealthy"}},
        {"at": 0.01, "expect": {"pod": "train", "device": "gpu3", "health": "Unhealthy"}},
        {"at": 0.02, "expect": {"pod": "train", "device": "gpu1", "health": "Healthy"}},
        {"at": 0.03, "expect": {"pod": "train", "device": "gpu1", "health": "Healthy",
                                "container": "main"}},
        {"at": 0.04, "expect": {"pod": "default/train", "device": "gpu3", "health": "Healthy"}},
        {"at": 0.05, "expect": {"pod": "default/train", "device": "gpu7",
                                "health": "Unhealthy"}},
        {"at": 0.06, "expect": {"pod": "default/gone", "device": "gpu3", "health": "Healthy"}},
        {"at": 0.07, "expect": {"pod": "ml/two", "device": "gpu0", "health": "Unhealthy"}},
        {"at": 0.08, "expect": {"gpu3": {"health": "unhealthy"}}},
    ]})
    client = _Devices()
    result = run_scenario(sc, client, speed=100, pod_health=_pod_health)
    assert client.requests == []
    assert [c.ok for c in result.checks] == [True, True, False, True, False, False, False,
                                             False, True]
    assert all(isinstance(c, PodCheck) for c in result.checks[:8])
    lines = [str(c) for c in result.checks]
    assert lines[0] == "steps[0] at 0s: pod default/train gpu3 health Unhealthy: ok"
    assert lines[2] == ("steps[2] at 0.02s: pod default/train gpu1 health Healthy: FAILED, "
                        "got Healthy, Unhealthy (id-gpu1-1: Healthy, id-gpu1-2: Unhealthy)")
    assert lines[3] == ("steps[3] at 0.03s: pod default/train container main gpu1 health "
                        "Healthy: ok")
    assert lines[4] == ("steps[4] at 0.04s: pod default/train gpu3 health Healthy: FAILED, "
                        "got Unhealthy")
    assert lines[5] == ("steps[5] at 0.05s: pod default/train gpu7 health Unhealthy: FAILED, "
                        "no allocated device gpu7 in its status")
    assert lines[6].endswith("pod default/gone gpu3 health Healthy: FAILED, no allocated "
                             "device gpu3 in its status")
    assert len(result.failures) == 5
    assert not result.ok


def test_pod_expectations_need_an_api_server_before_anything_runs() -> None:
    text = ("steps:\n  - {at: 0, do: unplug, device: gpu3}\n"
            "  - {at: 1, expect: {pod: train, device: gpu3, health: Unhealthy}}\n")
    sc = parse_scenario_text(text, source="s.yaml")
    client = _Devices()
    with pytest.raises(ScenarioError) as exc:
        run_scenario(sc, client)
    assert exc.value.problems == [
        "s.yaml:3:5: steps[1].expect: pod default/train gpu3 health Unhealthy needs a "
        "Kubernetes API server (a sandbox of runtime native or kind)"]
    assert client.requests == []


def test_cli_refuses_pod_expectations_with_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("steps:\n  - {at: 0, expect: {pod: train, device: gpu3, "
                    "health: Unhealthy}}\n")
    done = subprocess.run([sys.executable, "-m", "sandbox", "fault", "--socket",
                           str(tmp_path / "none.sock"), "run", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert (f"{path}:2:5: pod default/train gpu3 health Unhealthy: a pod expectation asks "
            "the sandbox's Kubernetes API server; --socket has none") in done.stderr, done.stderr
    help_text = subprocess.run([sys.executable, "-m", "sandbox", "fault", "run", "--help"],
                               cwd=REPO, capture_output=True, text=True, check=True,
                               timeout=60).stdout  # fmt: skip
    assert "expect: {pod: default/train, device: gpu3, health: Unhealthy}" in help_text


# -- resource ids -> the profile's devices ------------------------------------------------
def test_resource_ids_map_onto_the_profile() -> None:
    cluster = load_profile(REPO / "profiles" / "workshop-mixed.yaml").cluster
    gpu = cluster.node("gpu-worker-0")
    net = cluster.node("net-worker")
    assert gpu is not None
    assert net is not None
    owners, dra = device_owners(gpu), dra_owners(gpu)
    gpu3 = next(d for d in gpu.devices if d.id == "gpu3")
    for rid in (gpu3.uuid, "0000:82:00.0", "nvidia3", "gpu3",
                "hwsandbox.dev/gpu=88af387d-1c2e-4f7a-9d1e-0b6a1c2d3e4f-gpu-0000-82-00-0",
                "hwsandbox.dev/gpu=88af387d-1c2e-4f7a-9d1e-0b6a1c2d3e4f-gpu-0000-82-00-0"
                "-1g-10gb-0",
                "gpu.hwsandbox.dev/gpu-worker-0/gpu-0000-82-00-0-1g-10gb-3",
                "gpu-0000-82-00-0"):
        assert owner_of(rid, owners, dra) == "gpu3", rid
    for rid in ("GPU-nope", "0000:99:00.0", "hwsandbox.dev/gpu=uid-gpu-0000-82-00-01",
                "hwsandbox.dev/gpu=uidgpu-0000-82-00-0", ""):
        assert owner_of(rid, owners, dra) == "", rid
    nic_owners, nic_dra = device_owners(net), dra_owners(net)
    assert owner_of("0000:01:00.3", nic_owners, nic_dra) == "nic0"  # a VF, device plugin
    assert owner_of("hwsandbox.dev/nic=u-vf-0000-01-00-3", nic_owners, nic_dra) == "nic0"
    assert owner_of("hwsandbox.dev/nic=u-nic-0000-01-00-1-share7", nic_owners,
                    nic_dra) == "nic0"  # fmt: skip
    fpga = load_profile(REPO / "profiles" / "fpga-dfl.yaml").cluster.nodes[0]
    f_owners, f_dra = device_owners(fpga), dra_owners(fpga)
    assert owner_of("dfl-port.1", f_owners, f_dra) == "fpga1"
    assert owner_of("hwsandbox.dev/fpga=u-fpga-port-1", f_owners, f_dra) == "fpga1"
    assert owner_of("hwsandbox.dev/fpga=u-fpga-port-10", f_owners, f_dra) == ""
    # the status table's names agree for whole devices
    assert whole_device_names(gpu)["nvidia3"] == "gpu3"


def _pod(name: str, node: str, statuses: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"namespace": "default", "name": name}, "spec": {"nodeName": node},
            "status": {"containerStatuses": statuses}}


def test_pod_health_of_pod_objects_and_how_status_shows_it() -> None:
    cluster = load_profile(REPO / "profiles" / "workshop-mixed.yaml").cluster
    spec = cluster.node("gpu-worker-0")
    assert spec is not None
    gpu3 = next(d for d in spec.devices if d.id == "gpu3")
    pods = [
        _pod("train", "gpu-worker-0", [{"name": "main", "allocatedResourcesStatus": [
            {"name": "nvidia.com/gpu", "resources": [
                {"resourceID": gpu3.uuid, "health": "Unhealthy"},
                {"resourceID": "0000:01:00.0", "health": "Healthy"}]},
            {"name": "claim:gpu/req", "resources": [
                {"resourceID": "hwsandbox.dev/gpu=abc-gpu-0000-81-00-0-1g-10gb-0",
                 "health": "Unknown", "message": "aer-fatal: TOTAL_ERR_FATAL 1"}]}]},
            {"name": "idle"}]),
        _pod("elsewhere", "gpu-worker-1", [{"name": "main", "allocatedResourcesStatus": [
            {"name": "nvidia.com/gpu",
             "resources": [{"resourceID": "x", "health": "Healthy"}]}]}]),
    ]
    got = pod_health(pods, spec, node="gpu-worker-0")
    assert got == [
        PodDeviceHealth("default", "train", "gpu-worker-0", "main", "claim:gpu/req",
                        "hwsandbox.dev/gpu=abc-gpu-0000-81-00-0-1g-10gb-0", "Unknown",
                        "aer-fatal: TOTAL_ERR_FATAL 1", "gpu2"),
        PodDeviceHealth("default", "train", "gpu-worker-0", "main", "nvidia.com/gpu",
                        "0000:01:00.0", "Healthy", "", "gpu0"),
        PodDeviceHealth("default", "train", "gpu-worker-0", "main", "nvidia.com/gpu",
                        gpu3.uuid, "Unhealthy", "", "gpu3"),
    ]
    lines = pod_health_lines(got)
    assert lines[0].startswith("  pods with unhealthy devices")
    table = lines[1].splitlines()
    assert table[0].split() == ["POD", "CONTAINER", "RESOURCE", "DEVICE", "HEALTH", "MESSAGE"]
    assert table[1].split()[:5] == ["default/train", "main", "claim:gpu/req", "gpu2",
                                    "Unknown"]
    assert table[1].endswith("aer-fatal: TOTAL_ERR_FATAL 1")
    assert table[2].split() == ["default/train", "main", "nvidia.com/gpu", "gpu3",
                                "Unhealthy", "-"]
    assert len(table) == 3  # the Healthy entry is not listed
    assert pod_health_lines([h for h in got if h.health == "Healthy"]) == [
        "  pods' devices: all 1 Healthy (1 pod(s), the kubelet's allocatedResourcesStatus)"]
    assert pod_health_lines([]) == []
    assert pod_unhealthy(got) == {"gpu3": "default/train"}

    status = SandboxStatus("s", "native", "p", [NodeStatus("gpu-worker-0", True),
                                                NodeStatus("gpu-worker-1", True)])
    data = to_json(status, {"gpu-worker-0": got})
    assert data["nodes"][0]["pod_health"][2] == {
        "namespace": "default", "pod": "train", "node": "gpu-worker-0", "container": "main",
        "resource": "nvidia.com/gpu", "resource_id": gpu3.uuid, "health": "Unhealthy",
        "message": "", "device": "gpu3"}
    assert data["nodes"][1]["pod_health"] is None
    assert to_json(status)["nodes"][0]["pod_health"] is None


def test_picture_marks_a_device_a_pod_sees_unhealthy() -> None:
    cluster = load_profile(REPO / "profiles" / "workshop-mixed.yaml").cluster
    plain = topology_svg(cluster.nodes)
    assert topology_svg(cluster.nodes, {"gpu-worker-0": {"gpu3": DeviceView()}}) == plain
    svg = topology_svg(cluster.nodes, {"gpu-worker-0": {
        "gpu3": DeviceView("unhealthy", "aer-fatal", "default/train",
                           pod_unhealthy="default/train")}})
    root = ET.fromstring(svg)
    marked = [g for g in root.iter(f"{SVG}g") if g.get("data-pod-unhealthy")]
    assert [(g.get("data-device"), g.get("data-pod-unhealthy")) for g in marked] == [
        ("gpu3", "default/train")]
    texts = [t.text for t in marked[0].iter(f"{SVG}text")]
    assert "!" in texts
    assert any("Unhealthy in the status of a pod" in (t.text or "")
               for t in root.iter(f"{SVG}text")), "the legend explains the mark"
    assert [c.get("class") for c in marked[0].iter(f"{SVG}circle")] == ["pod-unhealthy"]

"""The pod-resources client against a kubelet stand-in, and how `sandbox status` shows it.

The stand-in is a real gRPC server on a real unix socket, built from our own stubs and
answering as the kubelet does (server_v1.go): one ContainerDevices per device and NUMA
node, in no particular order; pods that hold nothing listed too; Get of an unknown pod
an UNKNOWN status "pod NAME in namespace NS not found". Its node is profiles/8gpu-2numa's
gpu-worker: 2 NUMA nodes, CPUs 0-15,32-47 on NUMA 0 and 16-31,48-63 on NUMA 1 (CPU 0
reserved), GPUs nvidia0-3 on NUMA 0 and nvidia4-7 on NUMA 1.
"""

from __future__ import annotations

import json
import random
import shutil
import socket as socketlib
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from hwplugins.api import podresources_v1_pb2 as pb
from hwplugins.api import podresources_v1_pb2_grpc as pb_grpc

from sandbox.cli.status import (
    allocation_lines,
    cpu_numa,
    held_cpus,
    mark_holders,
    only_pod,
    parse_pod,
    text,
)
from sandbox.draw import DeviceView, topology_svg
from sandbox.errors import KubeletError, SandboxError
from sandbox.podresources import (
    MAX_SOCKET_PATH,
    Allocatable,
    Allocation,
    Device,
    Memory,
    allocatable,
    get_pod,
    list_allocations,
    read_node,
    socket_for,
)
from sandbox.profile import load_profile
from sandbox.runtimes.base import (
    DeviceStatus,
    NodeStatus,
    ResourceStatus,
    SandboxStatus,
    add_pod_resources,
)
from sandbox.runtimes.kind import KindRuntime
from sandbox.runtimes.local import LocalRuntime
from sandbox.runtimes.native import NativeRuntime
from tests.support.paths import REPO as ROOT

SVG = "{http://www.w3.org/2000/svg}"
GiB = 2**30
GPU = "nvidia.com/gpu"
VF = "hw-sandbox.dev/nic-vf"
NUMA0 = [*range(0, 16), *range(32, 48)]
NUMA1 = [*range(16, 32), *range(48, 64)]


# -- the kubelet stand-in -----------------------------------------------------------------

@dataclass
class Held:
    """What one container holds, as the kubelet's managers know it."""

    name: str
    devices: dict[str, list[tuple[str, list[int]]]] = field(default_factory=dict)
    cpus: list[int] = field(default_factory=list)
    memory: list[tuple[str, int, list[int]]] = field(default_factory=list)


GPUS = [(f"nvidia{k}", [0 if k < 4 else 1]) for k in range(8)]
PODS: dict[tuple[str, str], list[Held]] = {
    ("default", "train"): [Held(
        "main", devices={GPU: [g for g in GPUS if g[1] == [1]]},
        cpus=[16, 17, 18, 19, 48, 49, 50, 51],
        memory=[("memory", 16 * GiB, [1]), ("hugepages-2Mi", GiB, [1])])],
    ("default", "web"): [Held("app", cpus=[2, 3])],
    ("ml", "mixed"): [Held("worker", devices={GPU: [GPUS[0]],
                                             VF: [("0000:3b:00.2", [0])]}, cpus=[4, 5]),
                      Held("sidecar")],
    ("kube-system", "coredns"): [Held("coredns")],  # a pod that holds nothing
}
ALLOCATABLE_MEMORY = [("memory", 250 * GiB, [0]), ("memory", 252 * GiB, [1]),
                      ("hugepages-2Mi", 2 * GiB, [0]), ("hugepages-2Mi", 2 * GiB, [1])]


def _devices(held: dict[str, list[tuple[str, list[int]]]]) -> list[pb.ContainerDevices]:
    """As the kubelet's containerDevicesFromResourceDeviceInstances: one entry per device
    and NUMA node (none without topology), in map order."""
    out = []
    for resource, devs in held.items():
        for dev_id, numa in devs:
            if not numa:
                out.append(pb.ContainerDevices(resource_name=resource, device_ids=[dev_id]))
            for n in numa:
                out.append(pb.ContainerDevices(
                    resource_name=resource, device_ids=[dev_id],
                    topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=n)])))
    random.shuffle(out)
    return out


def _memory(entries: list[tuple[str, int, list[int]]]) -> list[pb.ContainerMemory]:
    return [pb.ContainerMemory(memory_type=t, size=s,
                               topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=n) for n in numa]))
            for t, s, numa in entries]


def _pod(key: tuple[str, str]) -> pb.PodResources:
    return pb.PodResources(namespace=key[0], name=key[1], containers=[
        pb.ContainerResources(name=c.name, devices=_devices(c.devices), cpu_ids=c.cpus,
                              memory=_memory(c.memory)) for c in PODS[key]])


class Kubelet(pb_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self.get_enabled = True
        self.hang = threading.Event()  # set: every call waits until release is set
        self.release = threading.Event()

    def _wait(self) -> None:
        if self.hang.is_set():
            self.release.wait(30)

    def List(self, request: Any, context: Any) -> pb.ListPodResourcesResponse:
        self._wait()
        keys = list(PODS)
        random.shuffle(keys)
        return pb.ListPodResourcesResponse(pod_resources=[_pod(k) for k in keys])

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        self._wait()
        devices = {GPU: GPUS, VF: [("0000:3b:00.2", [0]), ("0000:3b:00.3", [0])],
                   "example.com/fpga": [("fpga0", [0, 1]), ("fpga1", [])]}
        return pb.AllocatableResourcesResponse(
            devices=_devices(devices), cpu_ids=random.sample(range(1, 64), 63),
            memory=_memory(ALLOCATABLE_MEMORY))

    def Get(self, request: Any, context: Any) -> pb.GetPodResourcesResponse:
        self._wait()
        if not self.get_enabled:  # Go's fmt.Errorf: codes.Unknown
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        key = (request.pod_namespace, request.pod_name)
        if key not in PODS:
            context.abort(grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace "
                          f"{request.pod_namespace} not found")
        return pb.GetPodResourcesResponse(pod_resources=_pod(key))


@dataclass
class Served:
    socket: Path
    kubelet: Kubelet


def serve(kubelet_root: Path) -> tuple[grpc.Server, Served]:
    sock = socket_for(kubelet_root)
    sock.parent.mkdir(parents=True, exist_ok=True)
    assert len(str(sock)) <= MAX_SOCKET_PATH, f"{sock}: use a shorter --basetemp"
    kubelet = Kubelet()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PodResourcesListerServicer_to_server(kubelet, server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    return server, Served(sock, kubelet)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    server, s = serve(tmp_path / "kubelet")
    try:
        yield s
    finally:
        s.kubelet.release.set()
        server.stop(0).wait()


TRAIN = Allocation("default", "train", "main", GPU, ("nvidia4", "nvidia5", "nvidia6", "nvidia7"),
                   (1,), (16, 17, 18, 19, 48, 49, 50, 51),
                   (Memory("hugepages-2Mi", GiB, (1,)), Memory("memory", 16 * GiB, (1,))))
WEB = Allocation("default", "web", "app", "cpu", (), (), (2, 3))
MIXED = [Allocation("ml", "mixed", "worker", VF, ("0000:3b:00.2",), (0,), (4, 5)),
         Allocation("ml", "mixed", "worker", GPU, ("nvidia0",), (0,))]


# -- the client ---------------------------------------------------------------------------

def test_list_groups_the_kubelets_entries_per_container_and_resource(served: Served) -> None:
    """Per-device entries in map order become one sorted row per (container, resource);
    the container's CPUs and memory on its first row; a CPU-only container gets a "cpu"
    row; containers holding nothing, none."""
    assert list_allocations(served.socket) == [TRAIN, WEB, *MIXED]


def test_to_dict_has_exactly_the_documented_keys(served: Served) -> None:
    rows = [a.to_dict() for a in list_allocations(served.socket)]
    assert {frozenset(r) for r in rows} == {frozenset(
        {"namespace", "pod", "container", "resource", "devices", "numa", "cpus", "memory"})}
    assert rows[0] == {
        "namespace": "default", "pod": "train", "container": "main", "resource": GPU,
        "devices": ["nvidia4", "nvidia5", "nvidia6", "nvidia7"], "numa": [1],
        "cpus": [16, 17, 18, 19, 48, 49, 50, 51],
        "memory": [{"type": "hugepages-2Mi", "size": GiB, "numa": [1]},
                   {"type": "memory", "size": 16 * GiB, "numa": [1]}]}
    assert json.loads(json.dumps(rows)) == rows


def test_allocatable_devices_cpus_and_memory(served: Served) -> None:
    can = allocatable(served.socket)
    assert can.cpus == tuple(range(1, 64))
    by = can.by_resource()
    assert [(d.id, d.numa) for d in by[GPU]] == [(f"nvidia{k}", (k // 4,)) for k in range(8)]
    # a device on two NUMA nodes is one device; one without topology has none
    assert by["example.com/fpga"] == (Device("example.com/fpga", "fpga0", (0, 1)),
                                      Device("example.com/fpga", "fpga1", ()))
    assert can.memory[0] == Memory("hugepages-2Mi", 2 * GiB, (0,))
    assert [m.type for m in can.memory] == ["hugepages-2Mi"] * 2 + ["memory"] * 2
    d = can.to_dict()
    assert set(d) == {"devices", "cpus", "memory"}
    assert d["devices"][VF] == [{"id": "0000:3b:00.2", "numa": [0]},
                                {"id": "0000:3b:00.3", "numa": [0]}]
    assert read_node(served.socket) == (list_allocations(served.socket), can)


def test_get_a_known_pod(served: Served) -> None:
    assert get_pod(served.socket, "default", "train") == [TRAIN]
    assert get_pod(served.socket, "ml", "mixed") == MIXED
    assert get_pod(served.socket, "kube-system", "coredns") == []  # known, holds nothing


def test_get_an_unknown_pod_names_it(served: Served) -> None:
    with pytest.raises(KubeletError) as err:
        get_pod(served.socket, "default", "nope")
    assert str(err.value).startswith(f"pod default/nope: the kubelet at {served.socket} does "
                                     "not know it (pod nope in namespace default not found)")
    assert "\n" not in str(err.value)


def test_get_switched_off_says_which_feature_gate(served: Served) -> None:
    served.kubelet.get_enabled = False
    with pytest.raises(KubeletError, match="feature gate KubeletPodResourcesGet"):
        get_pod(served.socket, "default", "train")


def test_missing_socket(tmp_path: Path) -> None:
    sock = socket_for(tmp_path)
    with pytest.raises(KubeletError) as err:
        list_allocations(sock)
    assert str(err.value) == f"{sock}: no such socket; is the node's kubelet running?"


def test_dead_socket_is_a_clear_error_at_once(tmp_path: Path) -> None:
    """A socket file nobody listens on (a kubelet that died): refused, not waited for."""
    sock = socket_for(tmp_path)
    sock.parent.mkdir()
    with socketlib.socket(socketlib.AF_UNIX) as s:
        s.bind(str(sock))
    started = time.monotonic()
    with pytest.raises(KubeletError) as err:
        list_allocations(sock)
    assert time.monotonic() - started < 4  # not the 5 s timeout
    message = str(err.value)
    assert message.startswith(f"{sock}: nothing answers there (")
    assert message.endswith("); is the node's kubelet running?")
    assert "\n" not in message


def test_not_a_socket(tmp_path: Path) -> None:
    sock = socket_for(tmp_path)
    sock.parent.mkdir()
    sock.write_text("")
    with pytest.raises(KubeletError, match="not a socket"):
        allocatable(sock)


def test_a_path_too_long_for_a_unix_socket(tmp_path: Path) -> None:
    sock = tmp_path / ("d" * 100) / "kubelet.sock"
    with pytest.raises(KubeletError) as err:
        list_allocations(sock)
    assert f"longer than a unix socket path can be ({MAX_SOCKET_PATH})" in str(err.value)
    assert "HWSANDBOX_STATE_DIR" in str(err.value)


def test_a_hung_kubelet_times_out(served: Served) -> None:
    served.kubelet.hang.set()
    with pytest.raises(KubeletError) as err:
        list_allocations(served.socket, timeout=0.3)
    assert str(err.value).startswith(
        f"{served.socket}: the kubelet did not answer List within 0.3 s")


def test_a_listener_that_never_speaks_grpc_times_out(tmp_path: Path) -> None:
    sock = socket_for(tmp_path)
    sock.parent.mkdir()
    with socketlib.socket(socketlib.AF_UNIX) as s:
        s.bind(str(sock))
        s.listen(8)  # connects succeed; no HTTP/2 settings ever come
        with pytest.raises(KubeletError, match="did not answer GetAllocatableResources within"):
            allocatable(sock, timeout=0.3)


# -- the runtimes' sockets ----------------------------------------------------------------

def test_where_each_runtime_finds_the_socket(tmp_path: Path) -> None:
    state = tmp_path / "sb"
    assert LocalRuntime().pod_resources_socket(state, "n") is None
    assert KindRuntime().pod_resources_socket(state, "gpu-worker") == (
        state / "nodes" / "gpu-worker" / "pod-resources" / "kubelet.sock")
    state.mkdir()
    (state / "sandbox.json").write_text(json.dumps({"kubelet_root": "/srv/kl"}))
    assert NativeRuntime().pod_resources_socket(state, "gpu-worker") == Path(
        "/srv/kl/pod-resources/kubelet.sock")


def test_add_pod_resources(served: Served, tmp_path: Path) -> None:
    node = NodeStatus("gpu-worker", True)
    add_pod_resources(node, None)  # no real kubelet: nothing asked, nothing noted
    assert (node.allocations, node.allocatable, node.notes) == ([], None, [])
    add_pod_resources(node, served.socket)
    assert node.allocations == [TRAIN, WEB, *MIXED]
    assert node.allocatable is not None
    assert node.allocatable.cpus == tuple(range(1, 64))
    missing = NodeStatus("other", True)
    add_pod_resources(missing, socket_for(tmp_path / "none"))
    assert missing.notes == [f"pod-resources: {socket_for(tmp_path / 'none')}: no such "
                             "socket; is the node's kubelet running?"]
    assert (missing.allocations, missing.allocatable) == ([], None)


# -- sandbox status -----------------------------------------------------------------------

def _status(node: NodeStatus) -> SandboxStatus:
    return SandboxStatus("demo", "native", "profiles/8gpu-2numa.yaml", [node])


def _node(allocations: list[Allocation], cpus: tuple[int, ...] = tuple(range(1, 64)),
          ) -> NodeStatus:  # fmt: skip
    return NodeStatus("gpu-worker", True,
                      resources=[ResourceStatus(GPU, 8, 8, {0: 4, 1: 4})],
                      allocations=allocations, allocatable=Allocatable(cpus=cpus))


NUMA_OF = {c: 0 for c in NUMA0} | {c: 1 for c in NUMA1}


def test_the_allocations_table() -> None:
    lines = "\n".join(allocation_lines(_node([TRAIN, WEB, *MIXED]), NUMA_OF)).splitlines()
    assert lines == [
        "  allocations (the kubelet's pod-resources API):",
        "  POD            CONTAINER  RESOURCE               DEVICES                          "
        "NUMA  CPUS                  MEMORY",
        "  default/train  main       nvidia.com/gpu         nvidia4,nvidia5,nvidia6,nvidia7  "
        "1     16-19,48-51 (NUMA 1)  hugepages-2Mi=1Gi@1, memory=16Gi@1",
        "  default/web    app        cpu                    -                                "
        "-     2-3 (NUMA 0)          -",
        "  ml/mixed       worker     hw-sandbox.dev/nic-vf  0000:3b:00.2                     "
        "0     4-5 (NUMA 0)          -",
        "  ml/mixed       worker     nvidia.com/gpu         nvidia0                          "
        "0     -                     -",
        "  exclusive CPUs: NUMA 0: 1-15,32-47 (31 allocatable, 4 held); "
        "NUMA 1: 16-31,48-63 (32 allocatable, 8 held)",
    ]


def test_the_table_without_numa_map_without_memory_and_empty() -> None:
    assert "\n".join(allocation_lines(_node([WEB]), {})).splitlines() == [
        "  allocations (the kubelet's pod-resources API):",
        "  POD          CONTAINER  RESOURCE  DEVICES  NUMA  CPUS",
        "  default/web  app        cpu       -        -     2-3",
        "  exclusive CPUs: 1-63 (63 allocatable, 2 held)",
    ]
    assert allocation_lines(_node([], cpus=()), NUMA_OF) == [
        "  (no pod holds devices or exclusive CPUs)",
        "  exclusive CPUs: none allocatable (the kubelet's CPU manager policy is not static)",
    ]
    assert allocation_lines(_node([]), NUMA_OF, pod="default/x")[0] == (
        "  (pod default/x holds no devices or exclusive CPUs on this node)")
    assert allocation_lines(NodeStatus("n", True), NUMA_OF) == []  # not asked


def test_a_missing_socket_is_a_note_in_the_table(tmp_path: Path) -> None:
    node = NodeStatus("gpu-worker", True)
    add_pod_resources(node, socket_for(tmp_path))
    out = text(_status(node))
    assert f"\n  ! pod-resources: {socket_for(tmp_path)}: no such socket; is the node's " \
           "kubelet running?\n" in out
    assert "allocations" not in out
    assert "exclusive CPUs" not in out
    assert _status(node).to_dict()["nodes"][0]["allocatable"] is None


def test_json_per_node(served: Served) -> None:
    node = NodeStatus("gpu-worker", True)
    add_pod_resources(node, served.socket)
    data = json.loads(json.dumps(_status(node).to_dict()))["nodes"][0]
    assert data["allocations"][1] == {
        "namespace": "default", "pod": "web", "container": "app", "resource": "cpu",
        "devices": [], "numa": [], "cpus": [2, 3], "memory": []}
    assert data["allocatable"]["cpus"] == list(range(1, 64))
    assert data["allocatable"]["devices"][GPU][7] == {"id": "nvidia7", "numa": [1]}


def test_the_profile_places_devices_and_cpus() -> None:
    """With the profile: the table's CPUs per NUMA node, devices' allocated_to, and the
    picture's held GPUs and CPUs."""
    cluster = load_profile(ROOT / "profiles" / "8gpu-2numa.yaml").cluster
    spec = cluster.node("gpu-worker")
    assert spec is not None
    assert cpu_numa(spec) == NUMA_OF
    gpus = [d for d in spec.devices if d.kind == "gpu"]
    node = _node([TRAIN, WEB, *MIXED])
    node.devices = [DeviceStatus(d.id, d.kind, d.model, d.numa_node, d.address, "healthy")
                    for d in spec.devices]
    status = _status(node)
    mark_holders(status, cluster)
    held = {d.id: d.allocated_to for d in node.devices if d.allocated_to}
    assert held == {**{g.id: "default/train/main" for g in gpus[4:]},
                    gpus[0].id: "ml/mixed/worker"}
    assert "16-19,48-51 (NUMA 1)" in text(status, cluster)
    views = {"gpu-worker": {d.id: DeviceView(d.health, d.reason, d.allocated_to)
                            for d in node.devices}}
    picture = ET.fromstring(topology_svg(cluster.nodes, views, cpus={
        "gpu-worker": held_cpus(node)}))
    cells = {int(r.get("data-cpu", "")): r.get("data-held")
             for r in picture.iter(f"{SVG}rect") if r.get("class") == "cpu-held"}
    assert cells == held_cpus(node) == {**dict.fromkeys(TRAIN.cpus, "default/train/main"),
                                        2: "default/web/app", 3: "default/web/app",
                                        4: "ml/mixed/worker", 5: "ml/mixed/worker"}
    numa1 = picture.find(f".//{SVG}g[@class='numa'][@data-numa='1']")
    assert numa1 is not None
    assert {int(r.get("data-cpu", "")) for r in numa1.iter(f"{SVG}rect")
            if r.get("data-cpu")} == set(TRAIN.cpus)
    badge = [t.text for t in picture.iter(f"{SVG}text")]
    assert badge.count("in use by default/train/main") == 4


def test_only_pod_asks_each_kubelet_with_get(served: Served,
                                             request: pytest.FixtureRequest) -> None:
    """--pod through the kind runtime's socket path (a plain path below the state dir,
    short enough for a unix socket: tmp_path is not)."""
    state = Path(tempfile.mkdtemp(prefix="sb", dir="/tmp")) / "sb"
    request.addfinalizer(lambda: shutil.rmtree(state.parent))
    here = KindRuntime().pod_resources_socket(state, "gpu-worker")
    assert here is not None
    here.parent.mkdir(parents=True)
    here.symlink_to(served.socket)
    other = NodeStatus("net-worker", True, allocatable=Allocatable())  # its kubelet is gone
    node = NodeStatus("gpu-worker", True, allocations=[WEB], allocatable=Allocatable())
    status = SandboxStatus("sb", "kind", "p.yaml", [node, other])
    only_pod(KindRuntime(), state, status, "default", "train")
    assert (node.allocations, other.allocations) == ([TRAIN], [])
    with pytest.raises(SandboxError) as err:
        only_pod(KindRuntime(), state, status, "default", "nope")
    assert "gpu-worker: pod default/nope: the kubelet at" in str(err.value)
    assert "; net-worker: " in str(err.value)
    assert "no such socket" in str(err.value)
    local = SandboxStatus("sb", "local", "p.yaml", [NodeStatus("n", True)])
    with pytest.raises(SandboxError, match="the local runtime runs none"):
        only_pod(LocalRuntime(), state, local, "default", "train")


def test_parse_pod() -> None:
    assert parse_pod("ml/mixed") == ("ml", "mixed")
    assert parse_pod("train") == ("default", "train")
    for bad in ("a/b/c", "ns/", ""):
        with pytest.raises(SandboxError, match="expected NAMESPACE/NAME"):
            parse_pod(bad)

"""The real kubelet allocates against the emulated machine (issue 22), on the native runtime.

profiles/8gpu-2numa.yaml on this small host: 2 sockets, 2 NUMA nodes, 64 CPUs, 512Gi and
8 H100 (4 per NUMA node), single-numa-node, the static CPU manager reserving CPU 0. The
kubelet runs in a mount namespace where the node's tree is the machine
(``sandbox.runtimes.kubeletns``); containerd runs runc through the cpuset mapper
(``sandbox.runtimes.cpumap``), so pods pinned to emulated CPUs run on the host's. Variants
of the profile (written next to the test's temp files) change one kubelet setting each.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import (
    PROFILE,
    NativeCluster,
    container_devices,
    events,
    nvidia_minors,
    phase,
    pod_log,
    pod_manifest,
    pod_resources,
    running_pod,
    wait_counts,
    wait_until,
)
from conftest import Sandboxes

from sandbox.profile.cpulist import parse_cpulist
from sandbox.runtimes.native.common import DEVICE_PLUGINS_DIR
from sandbox.supervisor import Proc

GPU = "nvidia.com/gpu"
GUARANTEED = {"limits": {"cpu": "8", "memory": "256Mi", GPU: "2"}}


def variant(tmp_path_factory: pytest.TempPathFactory, name: str, **kubelet: Any) -> Path:
    """profiles/8gpu-2numa.yaml with ``kubelet`` settings changed, as a file of its own."""
    doc = yaml.safe_load(PROFILE.read_text())
    doc["nodes"][0]["kubelet"].update(kubelet)
    path = tmp_path_factory.getbasetemp() / "profiles" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    if not path.exists():
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cpu_numa(cluster: NativeCluster) -> dict[int, int]:
    return {c.id: c.numa_node for c in cluster.node.cpus}


def gpu_numa(cluster: NativeCluster) -> dict[str, int]:
    return {d.uuid: d.numa_node for d in cluster.node.devices if d.kind == "gpu"}


def pid_of(cluster: NativeCluster, name: str) -> int:
    proc = Proc.load(cluster.layout.run / f"{name}.pid")
    assert proc is not None, f"{name} is not running"
    assert proc.running(), f"{name} is not running"
    return proc.pid


def listed(pod: str) -> Any:
    """pod-resources List: default/``pod``'s one container."""
    from hwplugins.api import podresources_v1_pb2 as pr

    with pod_resources() as stub:
        reply = stub.List(pr.ListPodResourcesRequest(), timeout=10)
    (found,) = [p for p in reply.pod_resources if (p.namespace, p.name) == ("default", pod)]
    (container,) = found.containers
    return container


def allocatable_cpus() -> list[int]:
    from hwplugins.api import podresources_v1_pb2 as pr

    with pod_resources() as stub:
        reply = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=10)
    return sorted(reply.cpu_ids)


def cpu_state(cluster: NativeCluster) -> dict[str, Any]:
    from sandbox.runtimes.native import kubelet_root

    state: dict[str, Any] = json.loads((kubelet_root() / "cpu_manager_state").read_text())
    return state


def rejected(cluster: NativeCluster, name: str, gpus: int) -> str:
    """Create a pod asking for ``gpus`` GPUs; its status reason once the kubelet decided."""
    cluster.core.create_namespaced_pod("default", pod_manifest(
        name, "sleep 3600", resources={"limits": {GPU: str(gpus)}}))
    try:
        wait_until(f"pod {name} decided", lambda: phase(cluster, name) != "Pending", 60,
                   describe=lambda: events(cluster, name))
        status = cluster.core.read_namespaced_pod(name, "default").status
        return f"{status.phase}/{status.reason}"
    finally:
        cluster.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


# -- the machine the kubelet sees ------------------------------------------------------------

def test_kubelet_sees_the_emulated_machine(native_cluster: NativeCluster) -> None:
    capacity = native_cluster.core.read_node(native_cluster.node.name).status.capacity
    assert (capacity["cpu"], capacity["memory"]) == ("64", "512Gi"), capacity
    log = (native_cluster.layout.logs / "kubelet.log").read_text(errors="replace")
    assert "unknown to cadvisor" not in log
    assert "NumCores:64 NumPhysicalCores:16 NumSockets:2" in log
    assert "Distances:[10 21]" in log
    assert "Distances:[21 10]" in log
    # the kubelet's namespace has the tree's CPUs; the host and containerd keep the real ones
    real = Path("/sys/devices/system/cpu/online").read_text()
    assert real != "0-63\n"
    kubelet = pid_of(native_cluster, "kubelet")
    assert Path(f"/proc/{kubelet}/root/sys/devices/system/cpu/online").read_text() == "0-63\n"
    assert "Node 1 MemTotal" in Path(
        f"/proc/{kubelet}/root/sys/devices/system/node/node1/meminfo").read_text()
    containerd = pid_of(native_cluster, "containerd")
    assert Path(f"/proc/{containerd}/root/sys/devices/system/cpu/online").read_text() == real


def test_four_gpus_come_from_one_numa_node(native_cluster: NativeCluster) -> None:
    minors, numa = nvidia_minors(native_cluster), gpu_numa(native_cluster)
    with running_pod(native_cluster, "four-gpus", "ls /dev; sleep 3600",
                     resources={"limits": {GPU: "4"}}):
        given = container_devices("four-gpus", GPU)
        wait_until("the pod's listing", lambda: "nvidia" in pod_log(native_cluster, "four-gpus"),
                   30)
        listing = pod_log(native_cluster, "four-gpus").split()
    assert len(given) == 4, given
    (node,) = {numa[u] for u in given}
    assert all(ids == [node] for ids in given.values()), given
    # the container has the /dev/nvidiaN of that NUMA node's GPUs, no other
    assert sorted(n for n in listing if re.fullmatch(r"nvidia\d+", n)) == sorted(
        f"nvidia{minors[u]}" for u in given)


def test_five_gpus_fail_admission_under_single_numa_node(native_cluster: NativeCluster) -> None:
    assert rejected(native_cluster, "five-gpus", 5) == "Failed/TopologyAffinityError"


def test_two_pods_never_share_a_gpu_and_a_ninth_stays_pending(
        native_cluster: NativeCluster) -> None:
    with running_pod(native_cluster, "first-four", "sleep 3600",
                     resources={"limits": {GPU: "4"}}), \
            running_pod(native_cluster, "second-four", "sleep 3600",
                        resources={"limits": {GPU: "4"}}):
        first = container_devices("first-four", GPU)
        second = container_devices("second-four", GPU)
        assert len(first) == len(second) == 4
        assert not set(first) & set(second)
        assert {gpu_numa(native_cluster)[u] for u in first} != {
            gpu_numa(native_cluster)[u] for u in second}
        # every GPU is held: one more stays Pending, unschedulable for want of GPUs
        native_cluster.core.create_namespaced_pod("default", pod_manifest(
            "ninth", "sleep 3600", resources={"limits": {GPU: "1"}}))
        try:
            wait_until("the scheduler's verdict", lambda: "Insufficient nvidia.com/gpu" in
                       events(native_cluster, "ninth"), 60,
                       describe=lambda: events(native_cluster, "ninth"))
            assert phase(native_cluster, "ninth") == "Pending"
        finally:
            native_cluster.core.delete_namespaced_pod("ninth", "default",
                                                      grace_period_seconds=0)


# -- the static CPU manager ------------------------------------------------------------------

def test_guaranteed_pod_gets_cpus_and_gpus_of_one_numa_node(
        native_cluster: NativeCluster) -> None:
    allocatable = allocatable_cpus()
    assert allocatable == list(range(1, 64))  # all but reservedSystemCPUs "0"
    # the CPUs of an earlier test's pod on this cluster are back in the shared pool (the
    # kubelet releases them after the pod is gone, on its next reconcile)
    wait_until("no CPU held exclusively", lambda: not cpu_state(native_cluster).get("entries"),
               60, describe=lambda: str(cpu_state(native_cluster)))
    free_before = parse_cpulist(cpu_state(native_cluster)["defaultCpuSet"])
    with running_pod(native_cluster, "pinned", "grep Cpus_allowed_list /proc/self/status; "
                     "sleep 3600", resources=GUARANTEED):
        container = listed("pinned")
        cpus = sorted(container.cpu_ids)
        gpus = container_devices("pinned", GPU)
        assert (len(cpus), len(gpus)) == (8, 2), (cpus, gpus)
        numas = {cpu_numa(native_cluster)[c] for c in cpus} | {
            gpu_numa(native_cluster)[u] for u in gpus}
        assert len(numas) == 1, (cpus, gpus)
        # the kubelet's own record: the container's exclusive CPUs, gone from the free set
        state = cpu_state(native_cluster)
        pod = native_cluster.core.read_namespaced_pod("pinned", "default")
        assert parse_cpulist(state["entries"][pod.metadata.uid]["main"]) == cpus
        free = parse_cpulist(state["defaultCpuSet"])
        assert len(free) == len(free_before) - 8
        assert not set(free) & set(cpus)
        # pod-resources' allocatable CPUs are the node's, not the free ones (the kubelet's
        # GetAllocatableCPUs: every CPU but the reserved)
        assert allocatable_cpus() == allocatable
        # the container runs on the host's CPUs (the mapper); containerd keeps the
        # emulated ids the kubelet chose
        wait_until("the container's status line", lambda: "Cpus_allowed_list" in pod_log(
            native_cluster, "pinned"), 30)
        real = set(parse_cpulist(Path("/sys/devices/system/cpu/online").read_text()))
        (line,) = [w for w in pod_log(native_cluster, "pinned").splitlines()
                   if "Cpus_allowed_list" in w]
        assert set(parse_cpulist(line.split(":")[1])) <= real, line
        cid = pod.status.container_statuses[0].container_id.removeprefix("containerd://")
        spec = json.loads(native_cluster.ctr("containers", "info", cid))["Spec"]
        assert parse_cpulist(spec["linux"]["resources"]["cpu"]["cpus"]) == cpus

        # a kubelet restart keeps the allocation (its checkpoints) and the machine
        native_cluster.runtime.restart_kubelet(native_cluster.state_dir, native_cluster.node.name)
        # (List shows the pods the kubelet has synced again since its start)
        wait_until("the pod in pod-resources again", lambda: _lists("pinned"), 60)
        again = listed("pinned")
        assert sorted(again.cpu_ids) == cpus
        assert container_devices("pinned", GPU) == gpus
        capacity = native_cluster.core.read_node(native_cluster.node.name).status.capacity
        assert capacity["cpu"] == "64"
        assert parse_cpulist(cpu_state(native_cluster)["entries"][pod.metadata.uid]["main"]) \
            == cpus


def _lists(pod: str) -> bool:
    try:
        listed(pod)
    except Exception:  # noqa: BLE001 - the socket is being remade, the pod not synced yet
        return False
    return True


def test_status_shows_what_the_kubelet_decided(native_cluster: NativeCluster) -> None:
    with running_pod(native_cluster, "shown", "sleep 3600", resources=GUARANTEED):
        container = listed("shown")
        doc = json.loads(native_cluster.sandbox_cli("status", "-o", "json"))
        (node,) = doc["nodes"]
        rows = [a for a in node["allocations"] if a["pod"] == "shown"]
        by_resource = {a["resource"]: a for a in rows}
        assert sorted(by_resource[GPU]["devices"]) == sorted(container_devices("shown", GPU))
        assert sorted(by_resource[GPU]["cpus"] or by_resource.get("cpu", {}).get("cpus", [])) \
            == sorted(container.cpu_ids)
        one = native_cluster.sandbox_cli("status", "--pod", "default/shown")
        assert "shown" in one
        # the table names the GPUs as the profile does (gpu5), -o json as the plugin (UUIDs)
        names = {d.uuid: d.id for d in native_cluster.node.devices}
        assert all(re.search(rf"\b{names[u]}\b", one) for u in container_devices("shown", GPU))
        table = native_cluster.sandbox_cli("status")
        assert "shown" in table


# -- the device plugin API on the real kubelet ------------------------------------------------

def _plugin_log(cluster: NativeCluster) -> str:
    return (cluster.layout.logs / "deviceplugin.log").read_text(errors="replace")


def test_preferred_allocation_is_what_the_kubelet_allocates(
        sandboxes: Sandboxes, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under topology policy none nothing overrides the plugin's choice."""
    cluster = sandboxes.get(variant(tmp_path_factory, "policy-none",
                                    topologyManagerPolicy="none"))
    with running_pod(cluster, "preferred", "sleep 3600", resources={"limits": {GPU: "3"}}):
        given = container_devices("preferred", GPU)
    answers = re.findall(rf"{re.escape(GPU)}: GetPreferredAllocation size 3 -> (\S+)",
                         _plugin_log(cluster))
    assert answers, _plugin_log(cluster)[-2000:]
    assert set(answers[-1].split(",")) == set(given)


def test_best_effort_admits_five_gpus_from_both_numa_nodes(
        sandboxes: Sandboxes, tmp_path_factory: pytest.TempPathFactory) -> None:
    cluster = sandboxes.get(variant(tmp_path_factory, "best-effort",
                                    topologyManagerPolicy="best-effort"))
    with running_pod(cluster, "five-best-effort", "sleep 3600",
                     resources={"limits": {GPU: "5"}}):
        given = container_devices("five-best-effort", GPU)
    assert len(given) == 5
    assert {gpu_numa(cluster)[u] for u in given} == {0, 1}


def test_restricted_rejects_only_what_could_have_been_narrower(
        sandboxes: Sandboxes, tmp_path_factory: pytest.TempPathFactory) -> None:
    """restricted admits a pod only on a preferred hint: the fewest NUMA nodes the request
    could ever fit (counting every device, free or not). 5 GPUs need both nodes anyway, so
    they are admitted. With 3 GPUs held on each node, 2 GPUs could have come from one node
    but now cannot: rejected (best-effort would run it across both)."""
    cluster = sandboxes.get(variant(tmp_path_factory, "restricted",
                                    topologyManagerPolicy="restricted"))
    with running_pod(cluster, "five-restricted", "sleep 3600",
                     resources={"limits": {GPU: "5"}}):
        assert {gpu_numa(cluster)[u] for u in container_devices("five-restricted", GPU)} \
            == {0, 1}
    with running_pod(cluster, "three-a", "sleep 3600", resources={"limits": {GPU: "3"}}), \
            running_pod(cluster, "three-b", "sleep 3600", resources={"limits": {GPU: "3"}}):
        held = [{gpu_numa(cluster)[u] for u in container_devices(p, GPU)}
                for p in ("three-a", "three-b")]
        assert sorted(map(sorted, held)) == [[0], [1]], held
        assert rejected(cluster, "two-split", 2) == "Failed/TopologyAffinityError"


def test_memory_manager_static_takes_one_numa_node(
        sandboxes: Sandboxes, tmp_path_factory: pytest.TempPathFactory) -> None:
    cluster = sandboxes.get(variant(
        tmp_path_factory, "memory-static", memoryManagerPolicy="Static",
        reservedMemory=[{"numaNode": 0, "memory": "512Mi"}]))
    with running_pod(cluster, "numa-memory", "sleep 3600",
                     resources={"limits": {"cpu": "2", "memory": "1Gi", GPU: "1"}}):
        container = listed("numa-memory")
    memory = [m for m in container.memory if m.memory_type == "memory"]
    assert [m.size for m in memory] == [1 << 30], container.memory
    nodes = [n.ID for n in memory[0].topology.nodes]
    assert len(nodes) == 1, nodes
    assert {cpu_numa(cluster)[c] for c in container.cpu_ids} == set(nodes)


def test_pre_start_container_is_called_before_the_container_starts(
        sandboxes: Sandboxes, tmp_path_factory: pytest.TempPathFactory) -> None:
    cluster = sandboxes.get(variant(tmp_path_factory, "pre-start"),
                            plugin_options=("--pre-start-required",))
    with running_pod(cluster, "pre-started", "sleep 3600", resources={"limits": {GPU: "1"}}):
        (uuid,) = container_devices("pre-started", GPU)
        pod = cluster.core.read_namespaced_pod("pre-started", "default")
        started = pod.status.container_statuses[0].state.running.started_at.timestamp()
    calls = [line for line in _plugin_log(cluster).splitlines()
             if f"{GPU}: PreStartContainer {uuid}" in line]
    assert calls, _plugin_log(cluster)[-2000:]
    # the log line's own time (hwplugins logs "%(asctime)s") is not after the start
    stamp = time.mktime(time.strptime(calls[-1][:19], "%Y-%m-%d %H:%M:%S"))
    assert stamp <= started + 1, (calls[-1], started)


def test_a_kubelet_root_elsewhere_still_serves_device_plugins(
        sandboxes: Sandboxes, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HWSANDBOX_KUBELET_ROOT moves the kubelet's --root-dir (pod-resources, plugins
    registry, pods), but its device manager serves /var/lib/kubelet/device-plugins
    whatever the root: our plugin registers there and the GPUs are advertised."""
    root = Path("/var/lib/hwsb-e2e-kubelet")
    sandboxes.release()
    had_default = DEVICE_PLUGINS_DIR.parent.exists()
    monkeypatch.setenv("HWSANDBOX_KUBELET_ROOT", str(root))
    try:
        cluster = sandboxes.get(variant(tmp_path_factory, "kubelet-root"))
        wait_counts(cluster, GPU, (8, 8))
        assert (root / "pod-resources" / "kubelet.sock").is_socket()
    finally:
        sandboxes.release()
    assert not root.exists()
    # the kubelet made /var/lib/kubelet/device-plugins for its socket: gone with the rest
    assert DEVICE_PLUGINS_DIR.parent.exists() == had_default

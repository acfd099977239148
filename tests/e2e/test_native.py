"""A real kubelet, scheduler and API server accept the sandbox's node (native runtime)."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
from pathlib import Path

import grpc
import pytest
from cluster import (
    NativeCluster,
    allocatable_devices,
    container_devices,
    default_service_account,
    events,
    footprint,
    phase,
    pod_manifest,
    resource_counts,
    running_pod,
    start_pod,
    wait_counts,
    wait_until,
)
from conftest import Sandboxes

from sandbox.fakehw.devnodes import HARMLESS
from sandbox.runtimes.native import kubelet_root, mounts_below

GPU = "nvidia.com/gpu"


def test_node_is_ready(native_cluster: NativeCluster) -> None:
    status = native_cluster.runtime.status(native_cluster.state_dir)
    (node,) = status.nodes
    assert node.name == native_cluster.node.name == "gpu-worker"
    assert node.ready, node.notes
    assert node.notes == []
    labels = native_cluster.core.read_node(node.name).metadata.labels
    assert labels["hwsandbox.dev/profile"] == "8gpu-2numa"


def test_busybox_pod_runs_to_completion(native_cluster: NativeCluster) -> None:
    wait_until("the default service account", lambda: default_service_account(native_cluster))
    core = native_cluster.core
    core.create_namespaced_pod("default", pod_manifest("hello", "echo hello from $(hostname)"))
    try:
        wait_until("pod hello to finish",
                   lambda: phase(native_cluster, "hello") in ("Succeeded", "Failed"),
                   describe=lambda: events(native_cluster, "hello"))
        pod = core.read_namespaced_pod("hello", "default")
        assert pod.spec.node_name == native_cluster.node.name  # the scheduler placed it
        assert pod.status.phase == "Succeeded", pod.status
        assert pod.status.pod_ip.startswith("10.244.0.")  # CNI bridge + host-local
        log = core.read_namespaced_pod_log("hello", "default")  # API server -> kubelet
        assert log == "hello from hello\n"
    finally:
        core.delete_namespaced_pod("hello", "default", grace_period_seconds=0)


def _gpus(cluster: NativeCluster) -> tuple[int, int]:
    return resource_counts(cluster, GPU)


def test_kubelet_advertises_the_profiles_gpus(native_cluster: NativeCluster) -> None:
    """The reference device plugin, reading the FUSE tree, registers with the real kubelet."""
    wait_until("nvidia.com/gpu 8/8 on the node", lambda: _gpus(native_cluster) == (8, 8),
               describe=lambda: f"capacity/allocatable {_gpus(native_cluster)}")


def test_two_gpu_pod_sees_two_device_nodes(native_cluster: NativeCluster) -> None:
    wait_until("nvidia.com/gpu 8/8 on the node", lambda: _gpus(native_cluster) == (8, 8))
    wait_until("the default service account", lambda: default_service_account(native_cluster))
    core = native_cluster.core
    command = ("ls /dev | grep -E '^nvidia[0-9]+$'; echo \"visible=$NVIDIA_VISIBLE_DEVICES\"; "
               "for n in /dev/nvidia[0-9]*; do stat -c 'node=%n|%F|%t:%T' \"$n\"; done")
    core.create_namespaced_pod("default", pod_manifest(
        "gpu2", command, resources={"limits": {"nvidia.com/gpu": "2"}}))
    try:
        wait_until("pod gpu2 to finish",
                   lambda: phase(native_cluster, "gpu2") in ("Succeeded", "Failed"),
                   describe=lambda: events(native_cluster, "gpu2"))
        assert phase(native_cluster, "gpu2") == "Succeeded", events(native_cluster, "gpu2")
        lines = core.read_namespaced_pod_log("gpu2", "default").splitlines()
        nodes = [line for line in lines if line.startswith("nvidia")]
        assert len(nodes) == 2, lines
        (visible,) = [line for line in lines if line.startswith("visible=")]
        uuids = visible.removeprefix("visible=").split(",")
        assert len(uuids) == 2, lines
        assert all(u.startswith("GPU-") for u in uuids), lines
        # issue 21: the container's nodes are the node's 1:3 stand-ins, never 195:N
        stats = [line.split("|") for line in lines if line.startswith("node=")]
        assert len(stats) == 2, lines
        assert all(kind == "character special file" and numbers == "1:3"
                   for _name, kind, numbers in stats), stats
    finally:
        core.delete_namespaced_pod("gpu2", "default", grace_period_seconds=0)


def test_node_device_nodes_are_stand_ins(native_cluster: NativeCluster) -> None:
    """Issue 21: the node's real device nodes (``state_dir/dev``, what containerd and the
    pods see) are character devices 1:3 or a harmless memory device, mode <= 0660, owned
    by root: no number the profile chose (the GPUs' 195:N) exists as a real node."""
    dev = native_cluster.layout.dev
    seen: dict[str, tuple[int, int]] = {}
    for path in dev.rglob("*"):
        info = path.lstat()
        assert not stat.S_ISBLK(info.st_mode), f"{path}: a real block device"
        if stat.S_ISCHR(info.st_mode):
            seen[str(path.relative_to(dev))] = (os.major(info.st_rdev), os.minor(info.st_rdev))
            assert (os.major(info.st_rdev), os.minor(info.st_rdev)) in HARMLESS, (path, seen)
            assert stat.S_IMODE(info.st_mode) & ~0o660 == 0, (path, oct(info.st_mode))
            assert info.st_uid == 0, (path, info.st_uid)
    gpus = sorted(n for n in seen if re.fullmatch(r"nvidia\d+", n))
    assert gpus == [f"nvidia{i}" for i in range(8)], sorted(seen)
    assert all(seen[g] == (1, 3) for g in gpus), seen


def test_restart_kubelet_recreates_its_socket(native_cluster: NativeCluster) -> None:
    """On start the kubelet deletes plugin sockets and recreates kubelet.sock."""
    plugins_dir = kubelet_root() / "device-plugins"
    kubelet_sock = plugins_dir / "kubelet.sock"
    stale = plugins_dir / "hw-sandbox-e2e.sock"
    def identity() -> tuple[int, int]:  # inode numbers alone get reused
        try:
            st = kubelet_sock.stat()
        except FileNotFoundError:
            return 0, 0
        return st.st_ino, st.st_ctime_ns

    before = identity()
    with socket.socket(socket.AF_UNIX) as plugin:
        plugin.bind(str(stale))
        native_cluster.runtime.restart_kubelet(native_cluster.state_dir, native_cluster.node.name)
        wait_until("a new kubelet.sock",
                   lambda: identity() not in (before, (0, 0)))
    assert not stale.exists(), "the restarted kubelet kept a plugin socket"
    wait_until("the node to be Ready again", lambda: native_cluster.runtime.status(
        native_cluster.state_dir).nodes[0].ready)
    # Plugins notice their socket is gone and register again.
    wait_until("nvidia.com/gpu 8/8 after the restart", lambda: _gpus(native_cluster) == (8, 8),
               describe=lambda: f"capacity/allocatable {_gpus(native_cluster)}")


# -- what the kubelet reports, through the pod-resources API ------------------------------


def _gpu_table(cluster: NativeCluster) -> dict[str, tuple[str, int]]:
    """GPU UUID (the plugin's device id) -> (device name, NUMA node), from the live node:
    `sandbox fault list` names and places the devices, the fake
    /proc/driver/nvidia/gpus/<bdf>/information gives each one's UUID."""
    devices = json.loads(cluster.sandbox_cli("fault", "list", "-o", "json"))[cluster.node.name]
    table = {}
    for name, info in devices.items():
        if info["kind"] != "gpu":
            continue
        text = (cluster.state_dir / "node-root" / "proc" / "driver" / "nvidia" / "gpus"
                / info["pci_address"] / "information").read_text()
        match = re.search(r"^GPU UUID:\s*(\S+)", text, re.M)
        assert match, text
        table[match.group(1)] = (name, int(info["numa_node"]))
    # profiles/8gpu-2numa.yaml: four H100 per NUMA node
    assert sorted(table.values()) == [(f"gpu{i}", 0 if i < 4 else 1) for i in range(8)]
    return table


def test_pod_resources_api_lists_the_gpus_with_numa_ids(native_cluster: NativeCluster) -> None:
    """The kubelet's own pod-resources API, dialled with our protos, reports the 2-GPU pod's
    devices and every allocatable GPU with the NUMA node the profile gives it.

    The kubelet passes the plugin's NUMA ids through unchanged; its cadvisor knows both
    NUMA nodes (the emulated machine: tests/e2e/test_native_topology.py).
    """
    table = _gpu_table(native_cluster)
    wait_counts(native_cluster, GPU, (8, 8))
    assert allocatable_devices(GPU) == {uuid: [numa] for uuid, (_, numa) in table.items()}

    with running_pod(native_cluster, "gpu2-hold", "sleep 3600",
                     resources={"limits": {GPU: "2"}}):
        given = container_devices("gpu2-hold", GPU)
    assert len(given) == 2, given
    for uuid, ids in given.items():
        assert ids == [table[uuid][1]], (uuid, table[uuid], ids)
    # single-numa-node policy: both from one NUMA node of the profile's
    (numa,) = {n for (n,) in given.values()}
    assert numa in (0, 1), numa


# -- faults through the CLI ----------------------------------------------------------------


def _registrations_since(cluster: NativeCluster, offset: int) -> int:
    with (cluster.layout.logs / "kubelet.log").open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    return text.count(f'"Got registration request from device plugin with resource" '
                      f'resourceName="{GPU}"')


def _allocatable_now() -> set[str]:
    """GPU ids in GetAllocatableResources; none while the kubelet's socket is not up."""
    try:
        return set(allocatable_devices(GPU))
    except grpc.RpcError:
        return set()


def test_faults_through_the_cli_reach_the_node_status(native_cluster: NativeCluster) -> None:
    """`sandbox fault` on the native sandbox: health, kubelet restart, unplug.

    A fault is hardware state, so it survives a kubelet restart: the plugin re-registers
    with the new kubelet (seen in the kubelet's log and through the new kubelet's
    pod-resources API) and reports the unhealthy GPU again (allocatable stays 7); healing
    it brings allocatable back to 8.
    """
    node = native_cluster.node.name
    table = _gpu_table(native_cluster)
    uuid_of = {name: uuid for uuid, (name, _) in table.items()}
    wait_counts(native_cluster, GPU, (8, 8))
    try:
        native_cluster.sandbox_cli("fault", "health", node, "gpu3", "unhealthy")
        wait_counts(native_cluster, GPU, (8, 7))

        log_size = (native_cluster.layout.logs / "kubelet.log").stat().st_size
        out = native_cluster.sandbox_cli("fault", "restart-kubelet", node)
        lines = out.strip().splitlines()
        assert lines[0] == f"{node}: kubelet restarted", out
        # the CLI waited until the plugin's socket was back in device-plugins/
        assert "1 plugin registration(s) back after" in lines[1], out
        wait_until("the plugin to register with the restarted kubelet",
                   lambda: _registrations_since(native_cluster, log_size) >= 1, 60)
        wait_until("7 healthy GPUs in the new kubelet's allocatable devices",
                   lambda: len(_allocatable_now()) == 7, 60,
                   describe=lambda: str(sorted(_allocatable_now())))
        assert uuid_of["gpu3"] not in allocatable_devices(GPU)
        wait_counts(native_cluster, GPU, (8, 7))

        native_cluster.sandbox_cli("fault", "health", node, "gpu3", "healthy")
        wait_counts(native_cluster, GPU, (8, 8))

        native_cluster.sandbox_cli("fault", "unplug", node, "gpu5")
        wait_counts(native_cluster, GPU, (7, 7))
        assert uuid_of["gpu5"] not in allocatable_devices(GPU)
        native_cluster.sandbox_cli("fault", "plug", node, "gpu5")
        wait_counts(native_cluster, GPU, (8, 8))
    finally:  # leave the hardware as the profile says for whatever runs next
        native_cluster.sandbox_cli("fault", "health", node, "gpu3", "healthy")
        native_cluster.sandbox_cli("fault", "plug", node, "gpu5")


def _listening_unix_paths(pid: int) -> set[str]:
    """The filesystem paths of the unix sockets process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()  # Num RefCount Protocol Flags Type St Inode [Path]
        listening = int(fields[3], 16) & 0x10000  # __SO_ACCEPTCON
        if len(fields) == 8 and fields[6] in inodes and listening and fields[7][0] != "@":
            paths.add(fields[7])
    return paths


def test_our_processes_listen_only_in_our_dirs(native_cluster: NativeCluster) -> None:
    """Every unix socket a process of the cluster listens on is in its state dir or the
    kubelet's own root (device-plugins/, pod-resources/, plugins_registry/): none in a
    host-wide place such as containerd 2's default NRI socket /var/run/nri/nri.sock."""
    places = (native_cluster.state_dir, kubelet_root())
    seen: dict[str, int] = {}
    for pid in footprint(native_cluster).processes:
        for path in _listening_unix_paths(pid):
            seen[path] = pid
    assert any(p.endswith("containerd.sock") for p in seen), seen  # it looked at containerd
    outside = {path: pid for path, pid in seen.items()
               if not any(Path(path).is_relative_to(top) for top in places)}
    assert not outside, f"listening outside {[str(p) for p in places]}: {outside}"


# -- down ------------------------------------------------------------------------------------


@pytest.mark.takes_cluster_down
def test_down_leaves_nothing_behind(native_cluster: NativeCluster, sandboxes: Sandboxes) -> None:
    """With a pod running (containerd tasks, shims, kubelet volume mounts, a netns), `down`
    leaves no process, mount, device node, containerd socket or state dir of the cluster.

    Runs after every other test on native_cluster (tests/e2e/conftest.py).
    """
    layout = native_cluster.layout
    # the pods of the tests before (deleted with no grace period) gone from containerd
    wait_until("no containerd task", lambda: not footprint(native_cluster).tasks, 60,
               describe=lambda: str(footprint(native_cluster).tasks))
    start_pod(native_cluster, "sleeper", "sleep 3600", resources={"limits": {GPU: "1"}})
    before = footprint(native_cluster)
    assert before.tasks, "no containerd task is running: nothing to check"
    assert len(before.tasks) == 2, before.tasks  # the pod sandbox (pause) + main
    assert mounts_below(kubelet_root() / "pods"), "the pod has no volume mounted"
    assert str(layout.state / "node-root") in mounts_below(layout.state)
    assert (layout.dev / "nvidia0").exists()
    assert layout.containerd_sock.exists()
    sandboxes.down()  # with the pod still running
    assert before.leftovers() == []

"""A real kubelet, scheduler and API server accept the sandbox's node (native runtime)."""

from __future__ import annotations

import socket
from typing import Any

from conftest import NativeCluster, wait_until

from sandbox.runtimes.native import BUSYBOX_REF, kubelet_root


def _pod(name: str, command: str, **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": BUSYBOX_REF,
                "imagePullPolicy": "Never",  # no registry: the image was imported locally
                "command": ["sh", "-c", command],
                **container,
            }],
        },
    }


def _phase(cluster: NativeCluster, name: str) -> str:
    return str(cluster.core.read_namespaced_pod(name, "default").status.phase)


def _events(cluster: NativeCluster, pod: str) -> str:
    events = cluster.core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={pod}").items
    return "; ".join(f"{e.reason}: {e.message}" for e in events)


def _default_service_account(cluster: NativeCluster) -> bool:
    names = [sa.metadata.name for sa in
             cluster.core.list_namespaced_service_account("default").items]
    return "default" in names


def test_node_is_ready(native_cluster: NativeCluster) -> None:
    status = native_cluster.runtime.status(native_cluster.state_dir)
    (node,) = status.nodes
    assert node.name == native_cluster.node.name == "gpu-worker"
    assert node.ready, node.notes
    assert node.notes == []
    labels = native_cluster.core.read_node(node.name).metadata.labels
    assert labels["hwsandbox.dev/profile"] == "8gpu-2numa"


def test_busybox_pod_runs_to_completion(native_cluster: NativeCluster) -> None:
    wait_until("the default service account", lambda: _default_service_account(native_cluster))
    core = native_cluster.core
    core.create_namespaced_pod("default", _pod("hello", "echo hello from $(hostname)"))
    try:
        wait_until("pod hello to finish",
                   lambda: _phase(native_cluster, "hello") in ("Succeeded", "Failed"),
                   describe=lambda: _events(native_cluster, "hello"))
        pod = core.read_namespaced_pod("hello", "default")
        assert pod.spec.node_name == native_cluster.node.name  # the scheduler placed it
        assert pod.status.phase == "Succeeded", pod.status
        assert pod.status.pod_ip.startswith("10.244.0.")  # CNI bridge + host-local
        log = core.read_namespaced_pod_log("hello", "default")  # API server -> kubelet
        assert log == "hello from hello\n"
    finally:
        core.delete_namespaced_pod("hello", "default", grace_period_seconds=0)


def _gpus(cluster: NativeCluster) -> tuple[int, int]:
    (node,) = cluster.runtime.status(cluster.state_dir).nodes
    gpu = next((r for r in node.resources if r.resource == "nvidia.com/gpu"), None)
    return (gpu.capacity, gpu.allocatable) if gpu else (0, 0)


def test_kubelet_advertises_the_profiles_gpus(native_cluster: NativeCluster) -> None:
    """The reference device plugin, reading the FUSE tree, registers with the real kubelet."""
    wait_until("nvidia.com/gpu 8/8 on the node", lambda: _gpus(native_cluster) == (8, 8),
               describe=lambda: f"capacity/allocatable {_gpus(native_cluster)}")


def test_two_gpu_pod_sees_two_device_nodes(native_cluster: NativeCluster) -> None:
    wait_until("nvidia.com/gpu 8/8 on the node", lambda: _gpus(native_cluster) == (8, 8))
    wait_until("the default service account", lambda: _default_service_account(native_cluster))
    core = native_cluster.core
    command = "ls /dev | grep -E '^nvidia[0-9]+$'; echo \"visible=$NVIDIA_VISIBLE_DEVICES\""
    core.create_namespaced_pod("default", _pod(
        "gpu2", command, resources={"limits": {"nvidia.com/gpu": "2"}}))
    try:
        wait_until("pod gpu2 to finish",
                   lambda: _phase(native_cluster, "gpu2") in ("Succeeded", "Failed"),
                   describe=lambda: _events(native_cluster, "gpu2"))
        assert _phase(native_cluster, "gpu2") == "Succeeded", _events(native_cluster, "gpu2")
        lines = core.read_namespaced_pod_log("gpu2", "default").splitlines()
        nodes = [line for line in lines if line.startswith("nvidia")]
        assert len(nodes) == 2, lines
        (visible,) = [line for line in lines if line.startswith("visible=")]
        uuids = visible.removeprefix("visible=").split(",")
        assert len(uuids) == 2, lines
        assert all(u.startswith("GPU-") for u in uuids), lines
    finally:
        core.delete_namespaced_pod("gpu2", "default", grace_period_seconds=0)


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

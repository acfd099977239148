"""NVIDIA's device plugin v0.18.0, UNMODIFIED, with the real kubelet (native runtime),
through our NVML (docs/nvml.md), instead of our reference plugin.

``profiles/8gpu-2numa.yaml`` comes up without the reference plugin. NVIDIA's plugin runs
on the host in a private mount namespace where the node's FUSE tree is bound over /sys,
/dev and /proc/driver (tests/support/thirdparty.py); it registers through the real
/var/lib/kubelet/device-plugins/kubelet.sock, loads our libnvidia-ml.so.1
(LD_LIBRARY_PATH) and reads the tree through it (HWSANDBOX_NVML_ROOT). The kubelet
advertises 8/8 nvidia.com/gpu on the node object, a 2-GPU pod runs with those GPUs'
/dev/nvidiaN and NVIDIA_VISIBLE_DEVICES, and `sandbox fault health ... --reason aer-fatal`
takes the node's allocatable to 7 through the plugin's own Xid health check.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import (
    WITHIN,
    NativeCluster,
    check_two_gpu_pod,
    resource_health,
    running_pod,
    wait_counts,
    wait_health,
    wait_until,
)

from tests.support.nvidia import nvidia_binary, nvml_library
from tests.support.thirdparty import Bind, in_private_mounts, require_private_mounts, running_plugin

GPU = "nvidia.com/gpu"


@pytest.fixture
def nvidia_plugin(nvidia_cluster: NativeCluster, tmp_path: Path) -> Iterator[Path]:
    binary = nvidia_binary("nvidia-device-plugin")
    lib = nvml_library()
    require_private_mounts()
    root = nvidia_cluster.state_dir / "node-root"
    argv = in_private_mounts(
        ["env", f"LD_LIBRARY_PATH={lib.parent}", f"HWSANDBOX_NVML_ROOT={root}",
         str(binary), "--pass-device-specs"],
        [Bind(str(root / "sys"), "/sys"), Bind(str(root / "dev"), "/dev"),
         Bind(str(root / "proc" / "driver"), "/proc/driver")],
    )  # fmt: skip
    log = tmp_path / "nvidia-device-plugin.log"
    try:
        with running_plugin(argv, log):
            yield log
    finally:
        print(log.read_text(errors="replace")[-3000:])


def test_nvidia_plugin_serves_the_real_kubelet(nvidia_cluster: NativeCluster,
                                               nvidia_plugin: Path) -> None:  # fmt: skip
    wait_counts(nvidia_cluster, GPU, (8, 8))
    check_two_gpu_pod(nvidia_cluster, "nv2")

    nvidia_cluster.sandbox_cli("fault", "health", nvidia_cluster.node.name, "gpu3",
                               "unhealthy", "--reason", "aer-fatal")  # fmt: skip
    wait_counts(nvidia_cluster, GPU, (8, 7))
    assert "XidCriticalError: Xid=48" in nvidia_plugin.read_text()
    nvidia_cluster.sandbox_cli("fault", "health", nvidia_cluster.node.name, "gpu3", "healthy")


def test_nvidia_plugin_reports_a_faulted_gpu_in_the_pod(nvidia_cluster: NativeCluster,
                                                        nvidia_plugin: Path) -> None:
    """Issue 29: NVIDIA's Xid health check reaches the pod: one of a 2-GPU pod's GPUs
    faulted (aer-fatal: Xid 48 from our NVML's event set) is ``Unhealthy`` in its
    allocatedResourcesStatus within 5 s, the other ``Healthy``. NVIDIA's plugin never
    marks a device healthy again ("there is no way to recover from the Unhealthy state",
    its ListAndWatch): after the recovery the pod still shows Unhealthy, as on real
    hardware, until the plugin restarts (docs/health.md)."""
    wait_counts(nvidia_cluster, GPU, (8, 8))
    node = nvidia_cluster.node.name
    ids = {d.uuid: d.id for d in nvidia_cluster.node.devices if d.gpu is not None}
    with running_pod(nvidia_cluster, "nv-health", "sleep 3600",
                     resources={"limits": {GPU: "2"}}):
        wait_until("nv-health's GPUs in allocatedResourcesStatus",
                   lambda: len(resource_health(nvidia_cluster, "nv-health").get(GPU, {})) == 2,
                   30, describe=lambda: str(resource_health(nvidia_cluster, "nv-health")))
        sick_uuid, well_uuid = sorted(resource_health(nvidia_cluster, "nv-health")[GPU])
        start = time.monotonic()
        nvidia_cluster.sandbox_cli("fault", "health", node, ids[sick_uuid], "unhealthy",
                                   "--reason", "aer-fatal")
        try:
            took = wait_health(nvidia_cluster, "nv-health",
                               {sick_uuid: "Unhealthy", well_uuid: "Healthy"}, GPU, since=start)
            print(f"NVIDIA plugin: fault -> Unhealthy in the pod: {took:.2f}s")
        finally:
            nvidia_cluster.sandbox_cli("fault", "health", node, ids[sick_uuid], "healthy")
        time.sleep(WITHIN)
        assert resource_health(nvidia_cluster, "nv-health")[GPU][sick_uuid][0] == "Unhealthy"

"""NVIDIA's device plugin v0.18.0, UNMODIFIED, with its MIG strategies on the real kubelet
(native runtime), through our NVML (docs/nvml.md).

The plugin runs on the host in a private mount namespace where the node's FUSE tree is
bound over /sys, /dev and /proc/driver (its MIG capabilities), as in test_native_nvidia.py
(a pod cannot mount over /proc/driver, so MIG needs the plugin outside a pod).

- ``mixed`` on ``profiles/mig-partitions.yaml`` (4 A100 80GB, each 3g.40gb + 2g.20gb + 2 x
  1g.10gb): the node object shows one resource per MIG profile with the counts the
  profile's partitions imply, and a pod asking for one 1g.10gb runs with that MIG device in
  NVIDIA_VISIBLE_DEVICES and its parent GPU's /dev/nvidiaN and nvidia-caps nodes.
- ``single`` on ``profiles/mig-single.yaml`` (2 x 3g.40gb on each of 4 A100s): the 8 MIG
  devices are ``nvidia.com/gpu``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import (
    NativeCluster,
    container_devices,
    events,
    pod_log,
    resource_counts,
    running_pod,
    wait_counts,
    wait_until,
)

from tests.support.nvidia import nvidia_binary, nvml_library
from tests.support.thirdparty import Bind, in_private_mounts, require_private_mounts, running_plugin

STATE = "proc/driver/nvidia/hwsandbox/nvml"


def migs(cluster: NativeCluster) -> list[tuple[str, str, str]]:
    """(profile name, MIG UUID, parent bus id) of every MIG device the tree's state says."""
    state = (cluster.state_dir / "node-root" / STATE).read_text()
    return [(m["name"], m["uuid"], bdf) for bdf, m in (
        (line.split()[1], dict(kv.split("=", 1) for kv in line.split()[2:]))
        for line in state.splitlines() if line.startswith("mig "))]  # fmt: skip


def plugin(cluster: NativeCluster, log: Path, strategy: str) -> Iterator[Path]:
    binary = nvidia_binary("nvidia-device-plugin")
    lib = nvml_library()
    require_private_mounts()
    root = cluster.state_dir / "node-root"
    argv = in_private_mounts(
        ["env", f"LD_LIBRARY_PATH={lib.parent}", f"HWSANDBOX_NVML_ROOT={root}",
         f"HWSANDBOX_NVML_WATCH={cluster.state_dir / 'node' / 'control.sock'}",
         str(binary), "--pass-device-specs", "--mig-strategy", strategy],
        [Bind(str(root / "sys"), "/sys"), Bind(str(root / "dev"), "/dev"),
         Bind(str(root / "proc" / "driver"), "/proc/driver")],
    )  # fmt: skip
    try:
        with running_plugin(argv, log):
            yield log
    finally:
        print(log.read_text(errors="replace")[-3000:])


@pytest.fixture
def mixed_plugin(mig_cluster: NativeCluster, tmp_path: Path) -> Iterator[Path]:
    yield from plugin(mig_cluster, tmp_path / "nvidia-device-plugin.log", "mixed")


@pytest.fixture
def single_plugin(mig_single_cluster: NativeCluster, tmp_path: Path) -> Iterator[Path]:
    yield from plugin(mig_single_cluster, tmp_path / "nvidia-device-plugin.log", "single")


def test_mixed_strategy_one_resource_per_mig_profile(mig_cluster: NativeCluster,
                                                     mixed_plugin: Path) -> None:  # fmt: skip
    devices = migs(mig_cluster)
    want = {f"nvidia.com/mig-{name}": sum(1 for n, _, _ in devices if n == name)
            for name, _, _ in devices}  # fmt: skip
    assert want == {"nvidia.com/mig-3g.40gb": 4, "nvidia.com/mig-2g.20gb": 4,
                    "nvidia.com/mig-1g.10gb": 8}  # fmt: skip
    for resource, count in want.items():
        wait_counts(mig_cluster, resource, (count, count))
    assert resource_counts(mig_cluster, "nvidia.com/gpu") == (0, 0)

    resource = "nvidia.com/mig-1g.10gb"
    command = 'echo "visible=$NVIDIA_VISIBLE_DEVICES"; ls /dev /dev/nvidia-caps; sleep 3600'
    with running_pod(mig_cluster, "mig1g", command, resources={"limits": {resource: "1"}}):
        (given,) = container_devices("mig1g", resource)
        assert given in {u for n, u, _ in devices if n == "1g.10gb"}, given
        wait_until("the pod's listing", lambda: "visible=" in pod_log(mig_cluster, "mig1g"),
                   60, describe=lambda: f"events {events(mig_cluster, 'mig1g')}")
        listing = pod_log(mig_cluster, "mig1g").split()
    assert f"visible={given}" in listing, listing
    # the parent GPU's node and the instance's access nodes (docs/nvml.md, MIG)
    assert len([w for w in listing if re.fullmatch(r"nvidia\d+", w)]) == 1, listing
    assert len([w for w in listing if re.fullmatch(r"nvidia-cap\d+", w)]) == 2, listing


def test_single_strategy_mig_devices_are_gpus(mig_single_cluster: NativeCluster,
                                             single_plugin: Path) -> None:  # fmt: skip
    devices = migs(mig_single_cluster)
    assert {n for n, _, _ in devices} == {"3g.40gb"}
    assert len(devices) == 8
    wait_counts(mig_single_cluster, "nvidia.com/gpu", (8, 8))
    assert not [r for r in (mig_single_cluster.core.read_node(
        mig_single_cluster.node.name).status.capacity or {}) if r.startswith("nvidia.com/mig-")]

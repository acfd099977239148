"""Devices without NUMA affinity (``numaNode: none``, sysfs numa_node -1) as the plugins
see them in a rendered tree: the device plugin's ListAndWatch sends them with no
TopologyInfo (the kubelet's device-plugin API: topology nil), and the DRA driver
publishes no ``numaNode`` attribute. Real gRPC with the kubelet stand-in."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hwplugins.dra import build_pool, discover, parse_config, resource_slices

from sandbox.draconfig import driver_config
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.kubelet import DeviceManager
from sandbox.profile import load_profile_text

pytestmark = [pytest.mark.root]

GPU = "nvidia.com/gpu"
PROFILE = """\
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: noaff}
nodes:
  - name: box
    cpu: {sockets: 2, coresPerSocket: 2}
    devices:
      - {type: gpu, vendor: nvidia, model: l40s, count: 2, numaNode: none}
      - {type: gpu, vendor: nvidia, model: l40s, numaNode: 1}
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    node = load_profile_text(PROFILE, "t.yaml").cluster.nodes[0]
    render(build_tree(node), tmp_path / "root")
    return tmp_path / "root"


@pytest.fixture
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dpn-", dir="/tmp"))  # unix sockets: short paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_device_plugin_lists_them_without_topology(root: Path, sockdir: Path) -> None:
    with DeviceManager(sockdir) as dm:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hwplugins.deviceplugin", "--root", str(root),
             "--kubelet-dir", str(dm.directory), "--interval", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            dm.wait_registered(GPU, timeout=10)
            snap = dm.wait_for(lambda s: s.capacity(GPU) == 3, 10, "3 GPUs")
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0, out.decode(errors="replace")
    devices = snap.resources[GPU].devices
    assert sorted(d.numa_nodes for d in devices) == [(), (), (1,)]
    by_numa = snap.resources[GPU].by_numa()
    assert (len(by_numa[None]), len(by_numa[1])) == (2, 1)


def test_dra_driver_publishes_no_numa_attribute(root: Path) -> None:
    node = load_profile_text(PROFILE, "t.yaml").cluster.nodes[0]
    pool = build_pool(discover(root), parse_config(driver_config(node)), False, ())
    devices = [d for s in resource_slices(pool, node.name) for d in s["spec"]["devices"]]
    numa = sorted(str(d["attributes"].get("resource.kubernetes.io/numaNode")) for d in devices)
    assert numa == ["None", "None", "{'int': 1}"]

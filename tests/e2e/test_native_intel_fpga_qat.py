"""Intel's FPGA and QAT device plugins v0.36.0, UNMODIFIED, against the real kubelet.

Each runs on its own cluster of the native runtime, started without our reference plugin
(which would serve FPGA ports too), so the plugin under test is the only one registered:

- ``profiles/fpga-dfl.yaml`` (node fpga-worker, two Intel PAC N3000 on DFL): the FPGA
  plugin in ``-mode region`` (``fpga.intel.com/region-<interface id>`` per FME) and in
  ``-mode af`` (``fpga.intel.com/af-...`` per port); a pod asking for one AF gets that
  port's ``/dev/dfl-port.N``. A region-mode pod is not started: its Allocate answers a CDI
  device whose spec runs Intel's createRuntime hook (/opt/intel/fpga-sw/
  intel-fpga-crihook, shipped by the plugin's init container), which is not here.
- ``profiles/qat-vfio.yaml`` (node qat-worker, four QAT 4xxx VFs on vfio-pci): the QAT
  plugin (``-dpdk-driver vfio-pci``) offers ``qat.intel.com/generic``; a pod asking for
  one gets ``/dev/vfio/<its IOMMU group>`` and ``/dev/vfio/vfio``.

Each plugin runs in a private mount namespace with the node's FUSE tree bound over /sys
and /dev (tests/support/thirdparty.py); the kubelet's directory is the host's. The device nodes a
container gets come from state_dir/dev through containerd's /dev overlay.
"""

from __future__ import annotations

import base64
import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import (
    REPO,
    NativeCluster,
    container_devices,
    events,
    log_tail,
    pod_log,
    resource_counts,
    running_pod,
    wait_counts,
    wait_until,
)
from conftest import Sandboxes

from tests.support.thirdparty import (
    Bind,
    Tmpfs,
    in_private_mounts,
    plugin_binary,
    require_private_mounts,
    running_plugin,
)

FPGA_PROFILE = REPO / "profiles" / "fpga-dfl.yaml"
QAT_PROFILE = REPO / "profiles" / "qat-vfio.yaml"
QAT_GENERIC = "qat.intel.com/generic"


@pytest.fixture
def fpga_cluster(sandboxes: Sandboxes) -> NativeCluster:
    return sandboxes.get(FPGA_PROFILE, reference_plugin=False)


@pytest.fixture
def qat_cluster(sandboxes: Sandboxes) -> NativeCluster:
    return sandboxes.get(QAT_PROFILE, reference_plugin=False)


@contextlib.contextmanager
def _plugin(cluster: NativeCluster, name: str, args: list[str], log: Path
            ) -> Iterator[subprocess.Popen[bytes]]:
    """``name`` from scripts/build-plugins on the node's /sys and /dev; stopped on exit.
    /run is a private tmpfs: the FPGA plugin writes its region-mode CDI spec there."""
    binary = plugin_binary(name)
    require_private_mounts()
    root = cluster.state_dir / "node-root"
    argv = in_private_mounts(
        [str(binary), "-v", "3", *args],
        [Tmpfs("/run"), Bind(str(root / "sys"), "/sys"), Bind(str(root / "dev"), "/dev")],
        unset_env=["NODE_NAME"],  # the FPGA plugin would look for a mode annotation
    )
    with running_plugin(argv, log) as proc:
        yield proc


def _listing(cluster: NativeCluster, pod: str) -> list[str]:
    """The pod's output once it printed its END marker."""
    wait_until(f"{pod}'s listing", lambda: "END" in pod_log(cluster, pod), 30,
               describe=lambda: f"log {pod_log(cluster, pod)!r}; events {events(cluster, pod)}")
    return pod_log(cluster, pod).split("END")[0].split()


# FPGA --------------------------------------------------------------------------------------


def _fpga_ids(cluster: NativeCluster) -> tuple[str, dict[str, str]]:
    """(the FMEs' interface id, port -> afu_id) from the node's tree."""
    region_dir = cluster.state_dir / "node-root" / "sys" / "class" / "fpga_region"
    ifaces, afus = set(), {}
    for region in region_dir.iterdir():
        for compat in region.glob("dfl-fme.*/dfl-fme-region.*/fpga_region/region*/compat_id"):
            ifaces.add(compat.read_text().strip())
        for port in region.glob("dfl-port.*"):
            afus[port.name] = (port / "afu_id").read_text().strip()
    (iface,) = ifaces  # both N3000 carry the same FIM
    return iface, afus


def test_intel_fpga_plugin_region_mode_on_the_real_kubelet(
    fpga_cluster: NativeCluster, tmp_path: Path
) -> None:
    iface, _ = _fpga_ids(fpga_cluster)
    resource = f"fpga.intel.com/region-{iface}"
    assert resource_counts(fpga_cluster, resource) == (0, 0), "another plugin serves it"
    log = tmp_path / "fpga-region.log"
    with _plugin(fpga_cluster, "intel-fpga-plugin", ["-mode", "region"], log) as proc:
        try:
            wait_counts(fpga_cluster, resource, (2, 2))  # one per FME
        except BaseException:
            print(log_tail(log))
            raise
        assert proc.poll() is None, log_tail(log)
    assert "started in region mode" in log.read_text()


def test_intel_fpga_plugin_af_mode_on_the_real_kubelet(
    fpga_cluster: NativeCluster, tmp_path: Path
) -> None:
    iface, afus = _fpga_ids(fpga_cluster)
    (afu,) = set(afus.values())
    b64 = base64.urlsafe_b64encode(bytes.fromhex(iface + afu)).rstrip(b"=").decode()
    resource = f"fpga.intel.com/af-{iface[:3]}.{afu[:3]}.{b64}"
    log = tmp_path / "fpga-af.log"
    with _plugin(fpga_cluster, "intel-fpga-plugin", ["-mode", "af"], log) as proc:
        try:
            wait_counts(fpga_cluster, resource, (2, 2))  # one per port
        except BaseException:
            print(log_tail(log))
            raise
        command = "ls /dev; echo END; sleep 3600"
        with running_pod(fpga_cluster, "fpga-af", command,
                         resources={"limits": {resource: "1"}}):
            (port,) = container_devices("fpga-af", resource)
            listing = _listing(fpga_cluster, "fpga-af")
        assert proc.poll() is None, log_tail(log)
    assert port in afus
    assert [n for n in listing if n.startswith("dfl-")] == [port], listing


# QAT ---------------------------------------------------------------------------------------


def test_intel_qat_plugin_on_the_real_kubelet(qat_cluster: NativeCluster, tmp_path: Path) -> None:
    devices = qat_cluster.state_dir / "node-root" / "sys" / "bus" / "pci" / "devices"
    groups = {d.name: (d / "iommu_group").resolve().name for d in devices.iterdir()
              if (d / "device").read_text().strip() == "0x4941"}  # fmt: skip
    assert len(groups) == 4
    assert resource_counts(qat_cluster, QAT_GENERIC) == (0, 0), "another plugin serves it"
    log = tmp_path / "qat.log"
    with _plugin(qat_cluster, "intel-qat-plugin", ["-dpdk-driver", "vfio-pci"], log) as proc:
        try:
            wait_counts(qat_cluster, QAT_GENERIC, (4, 4))
        except BaseException:
            print(log_tail(log))
            raise
        command = "ls /dev/vfio; env | grep ^QAT; echo END; sleep 3600"
        with running_pod(qat_cluster, "qat", command,
                         resources={"limits": {QAT_GENERIC: "1"}}):
            (bdf,) = container_devices("qat", QAT_GENERIC)
            listing = _listing(qat_cluster, "qat")
        assert proc.poll() is None, log_tail(log)
    assert sorted(n for n in listing if "=" not in n) == sorted([groups[bdf], "vfio"]), listing
    assert [n for n in listing if "=" in n] == [f"QAT0={bdf}"], listing

"""NVIDIA's own device plugin and gpu-feature-discovery (github.com/NVIDIA/k8s-device-plugin
v0.18.0, UNMODIFIED, built with cgo by scripts/build-plugins) on a live fake node, through
our NVML (sandbox/nvml, docs/nvml.md) and the kubelet harness.

The plugin dlopens libnvidia-ml.so.1: LD_LIBRARY_PATH points at ours and
HWSANDBOX_NVML_ROOT at the node's live FUSE mount. It reads NUMA nodes from
/sys/bus/pci/devices/<bus id>/numa_node, checks /dev/nvidia* exist and registers through the
constant /var/lib/kubelet/device-plugins, so it runs in a private mount namespace with the
tree's sys and dev and the harness directory bound there (tests/support/thirdparty.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandbox.kubelet import DeviceManager, Snapshot
from tests.support.nvidia import nvidia_binary, nvml_env
from tests.support.thirdparty import (
    KUBELET_PLUGIN_DIR,
    Bind,
    LiveNode,
    Tmpfs,
    in_private_mounts,
    live_node,
    require_private_mounts,
    running_plugin,
    short_dir,
)

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.network]

GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class TreeGpu:
    bdf: str
    uuid: str
    minor: int
    numa_node: int


def tree_gpus(root: Path) -> dict[str, TreeGpu]:
    """UUID -> what the node's tree says about that GPU (the driver's information file and
    the PCI device directory)."""
    out = {}
    for info in sorted((root / "proc/driver/nvidia/gpus").glob("*/information")):
        fields = dict(re.split(r":\s*", line.strip(), maxsplit=1)
                      for line in info.read_text().splitlines() if ":" in line)  # fmt: skip
        bdf = info.parent.name
        numa = int((root / "sys/bus/pci/devices" / bdf / "numa_node").read_text())
        out[fields["GPU UUID"]] = TreeGpu(bdf, fields["GPU UUID"], int(fields["Device Minor"]),
                                          numa)  # fmt: skip
    return out


@dataclass(frozen=True)
class PluginNode:
    live: LiveNode
    dm: DeviceManager
    log: Path
    nvml_log: Path

    def wait(self, predicate: object, what: str, timeout: float = 30) -> Snapshot:
        try:
            return self.dm.wait_for(predicate, timeout, what)  # type: ignore[arg-type]
        except Exception:
            print(self.log.read_text(errors="replace")[-5000:])
            raise


def _run_plugin(profile: str, node: str, *flags: str) -> Iterator[PluginNode]:
    """The plugin against ``node``; its /sys, /dev and /proc/driver (MIG capabilities) are
    the tree's."""
    binary = nvidia_binary("nvidia-device-plugin")
    require_private_mounts()
    with live_node(profile, node) as live, short_dir("nv-") as base:
        with DeviceManager(base / "dp") as dm:
            cmd = in_private_mounts(
                [str(binary), "--pass-device-specs", *flags],
                [Tmpfs("/var/lib"), Bind(str(dm.directory), KUBELET_PLUGIN_DIR),
                 Bind(str(live.root / "sys"), "/sys"), Bind(str(live.root / "dev"), "/dev"),
                 Bind(str(live.root / "proc/driver"), "/proc/driver")],
            )  # fmt: skip
            log, nvml_log = base / "plugin.log", base / "nvml.log"
            with running_plugin(cmd, log, env=nvml_env(live, nvml_log)):
                yield PluginNode(live, dm, log, nvml_log)


@pytest.fixture
def h100_node() -> Iterator[PluginNode]:
    yield from _run_plugin("8gpu-2numa.yaml", "gpu-worker")


def test_nvidia_plugin_lists_the_profiles_gpus_and_allocates(h100_node: PluginNode) -> None:
    gpus = tree_gpus(h100_node.live.root)
    assert len(gpus) == 8
    snap = h100_node.wait(lambda s: s.capacity(GPU) == 8, "8 nvidia.com/gpu")
    state = snap.resources[GPU]
    assert state.allocatable == 8
    assert {d.id: d.numa_nodes for d in state.devices} == {
        u: (g.numa_node,) for u, g in gpus.items()
    }
    assert {g.numa_node for g in gpus.values()} == {0, 1}
    assert state.options["get_preferred_allocation_available"]

    alloc = h100_node.dm.allocate(GPU, 2)
    assert len(alloc.device_ids) == 2
    assert alloc.envs["NVIDIA_VISIBLE_DEVICES"].split(",") == list(alloc.device_ids)
    # Its preferred allocation keeps the pair on one NUMA node.
    assert len({gpus[u].numa_node for u in alloc.device_ids}) == 1
    per_gpu = sorted(c for c, _, _ in alloc.devices if re.fullmatch(r"/dev/nvidia\d+", c))
    assert per_gpu == sorted(f"/dev/nvidia{gpus[u].minor}" for u in alloc.device_ids)
    assert {c for c, _, _ in alloc.devices} - set(per_gpu) == {
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}  # fmt: skip
    assert all(c == h and perm == "rw" for c, h, perm in alloc.devices)
    # Every NVML call the plugin made on this path is implemented (our NVML logs the others)
    log = h100_node.nvml_log.read_text() if h100_node.nvml_log.exists() else ""
    assert "unimplemented" not in log, log


def test_nvidia_plugin_sees_faults_through_xid_events(h100_node: PluginNode) -> None:
    """aer-fatal on gpu3 reaches the plugin's own health check as Xid 48 (within 5 s of the
    fault); an unplugged GPU as Xid 79 (and NVML_ERROR_GPU_IS_LOST for queries). Exactly
    those go unhealthy."""
    gpus = tree_gpus(h100_node.live.root)
    by_bdf = {g.bdf: u for u, g in gpus.items()}
    h100_node.wait(lambda s: s.capacity(GPU) == 8, "8 nvidia.com/gpu")
    with h100_node.live.client() as client:
        devices = client.devices()
        faulted = time.monotonic()
        client.health("gpu3", "unhealthy", "aer-fatal")
    gpu3 = by_bdf[devices["gpu3"]["pci_address"]]
    # issue 12's acceptance: within 5 s of the fault call. A functional deadline, not a
    # speed target (benchmarks/bench_nvml.py measures it: 51 ms median).
    snap = h100_node.wait(lambda s: s.allocatable(GPU) == 7, "gpu3 unhealthy within 5 s",
                          timeout=faulted + 5 - time.monotonic())  # fmt: skip
    assert {d.id for d in snap.resources[GPU].devices if d.health != "Healthy"} == {gpu3}
    assert snap.capacity(GPU) == 8
    log = h100_node.log.read_text()
    assert f"XidCriticalError: Xid=48 on Device={gpu3}" in log

    with h100_node.live.client() as client:
        client.unplug("gpu6")
    gpu6 = by_bdf[devices["gpu6"]["pci_address"]]
    snap = h100_node.wait(lambda s: s.allocatable(GPU) == 6, "gpu6 lost")
    assert {d.id for d in snap.resources[GPU].devices if d.health != "Healthy"} == {gpu3, gpu6}
    assert f"XidCriticalError: Xid=79 on Device={gpu6}" in h100_node.log.read_text()


# each A100 80GB in the balanced layout (docs/nvml.md): 3g.40gb + 2g.20gb + 2 x 1g.10gb
MIG_EXPECTED = {"nvidia.com/mig-3g.40gb": 4, "nvidia.com/mig-2g.20gb": 4,
                "nvidia.com/mig-1g.10gb": 8}  # fmt: skip


@pytest.fixture
def mig_node() -> Iterator[PluginNode]:
    yield from _run_plugin("mig-partitions.yaml", "mig-worker", "--mig-strategy", "mixed")


def test_nvidia_plugin_mixed_mig_strategy_advertises_each_profile(mig_node: PluginNode) -> None:
    """mig-partitions: four A100 80GB in MIG mode; one resource per MIG profile in use."""
    state = (mig_node.live.root / "proc/driver/nvidia/hwsandbox/nvml").read_text()
    migs = re.findall(r"^mig \S+ .* name=(\S+) uuid=(\S+)$", state, re.MULTILINE)
    assert {f"nvidia.com/mig-{n}": sum(1 for m, _ in migs if m == n)
            for n, _ in migs} == MIG_EXPECTED  # fmt: skip
    snap = mig_node.wait(lambda s: all(s.capacity(r) == c for r, c in MIG_EXPECTED.items()),
                         "MIG resources")  # fmt: skip
    assert snap.capacity(GPU) == 0
    uuids = {u for _, u in migs}
    for resource in MIG_EXPECTED:
        assert {d.id for d in snap.resources[resource].devices} <= uuids
    alloc = mig_node.dm.allocate("nvidia.com/mig-3g.40gb", 1)
    assert alloc.envs["NVIDIA_VISIBLE_DEVICES"] == alloc.device_ids[0]
    # the parent GPU's node and the instance's two nvidia-caps access nodes
    nodes = sorted(c for c, _, _ in alloc.devices)
    assert sum(1 for c in nodes if c.startswith("/dev/nvidia-caps/nvidia-cap")) == 2, nodes
    log = mig_node.nvml_log.read_text() if mig_node.nvml_log.exists() else ""
    assert "unimplemented" not in log, log


@pytest.fixture
def workshop_node() -> Iterator[PluginNode]:
    yield from _run_plugin("workshop-mixed.yaml", "gpu-worker-0")


def test_nvidia_plugin_on_l40s_and_a_t4_that_starts_broken(workshop_node: PluginNode) -> None:
    """workshop-mixed: 4 L40S and a T4 whose profile says unhealthy (aer-fatal) from the
    start. The fault is already there when the plugin registers for events: it is
    delivered by the first wait, so the T4 is the one unhealthy device."""
    gpus = tree_gpus(workshop_node.live.root)
    with workshop_node.live.client() as client:
        devices = client.devices()
    t4 = {g.bdf: u for u, g in gpus.items()}[next(
        d["pci_address"] for d in devices.values() if d.get("model") == "t4")]
    snap = workshop_node.wait(lambda s: s.capacity(GPU) == 5 and s.allocatable(GPU) == 4,
                              "5 GPUs, the T4 unhealthy")  # fmt: skip
    assert {d.id for d in snap.resources[GPU].devices if d.health != "Healthy"} == {t4}
    assert {d.id: d.numa_nodes for d in snap.resources[GPU].devices} == {
        u: (g.numa_node,) for u, g in gpus.items()}  # fmt: skip


@pytest.fixture
def single_mig_node() -> Iterator[PluginNode]:
    """profiles/mig-single.yaml: mig-partitions with one partition profile, 3g.40gb, so
    every A100 holds 2 x 3g.40gb, all MIG devices alike, which the plugin's `single`
    strategy requires."""
    yield from _run_plugin("mig-single.yaml", "mig-worker", "--mig-strategy", "single")


def test_nvidia_plugin_single_mig_strategy(single_mig_node: PluginNode) -> None:
    snap = single_mig_node.wait(lambda s: s.capacity(GPU) == 8, "8 MIG devices as nvidia.com/gpu")
    state = (single_mig_node.live.root / "proc/driver/nvidia/hwsandbox/nvml").read_text()
    uuids = set(re.findall(r"^mig .* uuid=(\S+)$", state, re.MULTILINE))
    assert {d.id for d in snap.resources[GPU].devices} == uuids
    assert len(uuids) == 8
    assert set(re.findall(r"^mig .* name=(\S+) ", state, re.MULTILINE)) == {"3g.40gb"}

"""Real third-party device plugins, UNMODIFIED, against our tree and the kubelet harness.

Each plugin is built from its released Go module by scripts/build-plugins (cached outside
the repository; the first build takes a minute or more) and configured only through its
own flags and environment. Where a plugin hard-codes /sys, /dev or the kubelet's
/var/lib/kubelet/device-plugins, it runs in a private mount namespace with the live FUSE
tree and the harness directory bind-mounted over those paths (tests/support/thirdparty.py); the
host's own /sys and /dev are never touched.

    plugin                       module@version                                  here
    sample-device-plugin         k8s.io/kubernetes@v1.37.2 test/images/...        conformance
    Intel GPU plugin             github.com/intel/intel-device-plugins-for-kubernetes
                                 @v0.36.0 cmd/gpu_plugin                          intel-flex-sriov
    squat generic-device-plugin  not served by the Go module proxy reachable here (no
                                 semver release; pseudo-versions refused): not run
    ROCm k8s-device-plugin       same (its v1.x.y.z tags are not semver), and it needs cgo
                                 with libdrm/libdrm_amdgpu/hwloc: not run
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandbox.kubelet import DeviceManager
from tests.support.thirdparty import (
    KUBELET_PLUGIN_DIR,
    Bind,
    LiveNode,
    Tmpfs,
    in_private_mounts,
    live_node,
    plugin_binary,
    require_private_mounts,
    running_plugin,
    short_dir,
)

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.network]

INTEL_GPU = "gpu.intel.com/i915"


# kubernetes sample-device-plugin -----------------------------------------------------------


def test_sample_device_plugin_passes_kubelet_check() -> None:
    """`sandbox kubelet check` grades the upstream sample plugin: every check passes.

    The plugin dials the constant /var/lib/kubelet/device-plugins/kubelet.sock and watches
    that directory for the kubelet's restart, so the harness directory is bound there;
    PLUGIN_SOCK_DIR (which `check` sets for plugins that read it) is dropped so its socket
    lands in the same directory. Its Allocate writes /tmp/Dev-N: /tmp is a private tmpfs.
    After a kubelet restart it waits 10 s (its own poll interval) before serving and
    registering again, hence --restart-within 20.
    """
    binary = plugin_binary("sample-device-plugin")
    require_private_mounts()
    mounts: list[Bind | Tmpfs] = [Tmpfs("/var/lib"), Bind("{kubelet_dir}", KUBELET_PLUGIN_DIR)]
    if not str(binary).startswith("/tmp/"):
        mounts.append(Tmpfs("/tmp"))
    cmd = in_private_mounts([str(binary)], mounts, unset_env=["PLUGIN_SOCK_DIR"])
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "kubelet", "check", "--timeout", "20",
         "--restart-within", "20", "--", *cmd],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    status = {line.split()[1]: line.split()[0] for line in out.splitlines() if line[:4] in
              ("PASS", "FAIL", "NOT-")}  # fmt: skip
    assert status == {
        "registers": "PASS",
        "serves-before-register": "PASS",
        "registration-accepted": "PASS",
        "options": "PASS",
        "list-and-watch": "PASS",
        "allocate": "PASS",
        "health-update": "NOT-RUN",  # the sample plugin has no health source
        "restart": "PASS",
        "still-running": "PASS",
    }, out
    assert "Register for example.com/resource" in out
    assert "2 devices, 2 healthy" in out  # Dev-1 and Dev-2
    assert "result: PASSED" in out


# Intel GPU plugin ------------------------------------------------------------------------------


@dataclass(frozen=True)
class IntelNode:
    live: LiveNode
    dm: DeviceManager
    log: Path


@pytest.fixture
def intel_node() -> Iterator[IntelNode]:
    binary = plugin_binary("intel-gpu-plugin")
    require_private_mounts()
    with live_node("intel-flex-sriov.yaml", "flex-worker") as live, short_dir("ki-") as base:
        with DeviceManager(base / "dp") as dm:
            # The plugin reads /sys/class/drm and /dev/dri and registers through the
            # constant kubelet socket; Allocate writes CDI specs to /var/run/cdi (-> /run).
            cmd = in_private_mounts(
                [str(binary), "-v", "2"],
                [Tmpfs("/var/lib"), Bind(str(dm.directory), KUBELET_PLUGIN_DIR), Tmpfs("/run"),
                 Bind(str(live.root / "sys"), "/sys"), Bind(str(live.root / "dev"), "/dev")],
            )  # fmt: skip
            log = base / "plugin.log"
            with running_plugin(cmd, log):
                yield IntelNode(live, dm, log)


@dataclass(frozen=True)
class Card:
    bdf: str
    numa_node: int
    dev_nodes: tuple[str, ...]  # /dev/dri/cardN, /dev/dri/renderD...


def _cards(node: IntelNode) -> dict[str, Card]:
    """What the tree shows the plugin: card name -> Card, for each DRM card it should offer
    (a PF with SR-IOV VFs enabled is hidden; its VFs are offered)."""
    drm = node.live.root / "sys/class/drm"
    out = {}
    for card in sorted(drm.glob("card*")):
        if not card.name.removeprefix("card").isdigit():
            continue
        pci = (card / "device").resolve()
        numvfs = pci / "sriov_numvfs"
        if numvfs.exists() and int(numvfs.read_text()) > 0:
            continue
        nodes = sorted(f"/dev/dri/{e.name}" for e in (pci / "drm").iterdir())
        out[card.name] = Card(pci.name, int((pci / "numa_node").read_text()), tuple(nodes))
    return out


def _wait_cards(node: IntelNode, count: int, timeout: float = 20) -> Any:
    try:
        return node.dm.wait_for(lambda s: s.capacity(INTEL_GPU) == count, timeout,
                                f"{count} {INTEL_GPU} devices")  # fmt: skip
    except Exception:
        print(node.log.read_text(errors="replace")[-4000:])
        raise


def test_intel_gpu_plugin_offers_one_device_per_card(intel_node: IntelNode) -> None:
    cards = _cards(intel_node)
    # Two Flex 170: card0 plain, card1 a PF with 4 VFs enabled (card2..card5).
    assert sorted(cards) == ["card0", "card2", "card3", "card4", "card5"]
    snap = _wait_cards(intel_node, len(cards))
    state = snap.resources[INTEL_GPU]
    assert state.allocatable == 5
    assert {d.id for d in state.devices} == {f"{c}-0" for c in cards}  # shared-dev-num 1
    for d in state.devices:
        assert d.numa_nodes == (cards[d.id.removesuffix("-0")].numa_node,)
    assert state.options["get_preferred_allocation_available"]

    alloc = intel_node.dm.allocate(INTEL_GPU, 1)
    (dev_id,) = alloc.device_ids
    card = dev_id.removesuffix("-0")
    assert sorted(c for c, _, _ in alloc.devices) == list(cards[card].dev_nodes)
    assert all(c == h and perm == "rw" for c, h, perm in alloc.devices)
    bdf = cards[card].bdf
    assert sorted(c for c, _, _ in alloc.mounts) == [
        f"/dev/dri/by-path/pci-{bdf}-card",
        f"/dev/dri/by-path/pci-{bdf}-render",
    ]
    assert alloc.cdi_devices == (f"intel.cdi.k8s.io/gpu={card}",)


def test_intel_gpu_plugin_sees_unplug_and_reregisters(intel_node: IntelNode) -> None:
    _wait_cards(intel_node, 5)
    with intel_node.live.client() as client:
        client.unplug("gpu0")  # card0 leaves /sys/class/drm and /dev/dri
    snap = _wait_cards(intel_node, 4)  # the plugin rescans every 5 s
    assert "card0-0" not in {d.id for d in snap.resources[INTEL_GPU].devices}
    intel_node.dm.restart()
    started = time.monotonic()
    snap = _wait_cards(intel_node, 4, timeout=10)
    assert snap.resources[INTEL_GPU].connected
    assert time.monotonic() - started < 10
    assert len(intel_node.dm.events_of("register", INTEL_GPU)) == 2

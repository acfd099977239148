"""Real third-party device plugins, UNMODIFIED, against the real kubelet (native runtime).

Both run on the ``intel-flex-sriov`` cluster (node flex-worker, started without our own
reference plugin) and register through the real
``/var/lib/kubelet/device-plugins/kubelet.sock``:

- kubernetes' sample-device-plugin (built by scripts/build-k8s next to the kubelet): two
  fixed devices, reads no hardware. It runs in a private mount namespace with its own
  tmpfs on /tmp, because its Allocate writes /tmp/Dev-N; no pod asks it for a device here.
- Intel's GPU plugin v0.36.0 (scripts/build-plugins), which reads /sys/class/drm and
  /dev/dri: in a private mount namespace the node's FUSE tree is bound over /sys and /dev
  (tests/support/thirdparty.py), everything else, the kubelet's directory included, is the host's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from cluster import (
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

from sandbox.runtimes.native import BUILD_HINT, bin_dir
from tests.support.thirdparty import (
    Bind,
    Tmpfs,
    in_private_mounts,
    plugin_binary,
    require_private_mounts,
    running_plugin,
)

SAMPLE = "example.com/resource"
INTEL_GPU = "gpu.intel.com/i915"


def test_sample_device_plugin_registers_with_the_real_kubelet(
    intel_cluster: NativeCluster, tmp_path: Path
) -> None:
    """The upstream conformance plugin's two devices appear in the node's status; when it
    stops, the kubelet marks them unhealthy (capacity stays for the 5-minute grace)."""
    binary = bin_dir() / "sample-device-plugin"
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} is missing ({BUILD_HINT})", pytrace=False)
    require_private_mounts()
    mounts: list[Bind | Tmpfs] = []
    if not str(binary).startswith("/tmp/"):
        mounts.append(Tmpfs("/tmp"))  # its Allocate writes /tmp/Dev-N
    # PLUGIN_SOCK_DIR unset: the plugin's default, the real kubelet's device-plugins dir
    argv = in_private_mounts([str(binary)], mounts, unset_env=["PLUGIN_SOCK_DIR"])
    log = tmp_path / "sample-device-plugin.log"
    with running_plugin(argv, log) as proc:
        try:
            wait_counts(intel_cluster, SAMPLE, (2, 2))
        except BaseException:
            print(log_tail(log))
            raise
        assert proc.poll() is None, "the plugin exited"
    assert "Device Plugin registered with the Kubelet" in log.read_text()
    wait_counts(intel_cluster, SAMPLE, (2, 0))


def _offered_cards(cluster: NativeCluster) -> set[str]:
    """Cards the plugin should offer: every DRM card but a PF with VFs enabled."""
    drm = cluster.state_dir / "node-root" / "sys" / "class" / "drm"
    cards = set()
    for card in drm.glob("card*"):
        if not card.name.removeprefix("card").isdigit():
            continue
        numvfs = card / "device" / "sriov_numvfs"
        if numvfs.exists() and int(numvfs.read_text()) > 0:
            continue
        cards.add(card.name)
    return cards


def test_intel_gpu_plugin_on_the_real_kubelet(
    intel_cluster: NativeCluster, tmp_path: Path
) -> None:
    """Intel's plugin reads the fake /sys and /dev, the kubelet advertises one
    gpu.intel.com/i915 per offered card, and a pod asking for one runs with that card's
    /dev/dri nodes (device nodes from state_dir/dev through containerd's /dev overlay)."""
    binary = plugin_binary("intel-gpu-plugin")
    require_private_mounts()
    cards = _offered_cards(intel_cluster)
    # two Flex 170: card0 plain, card1 a PF with 4 VFs enabled (card2..card5)
    assert cards == {"card0", "card2", "card3", "card4", "card5"}
    assert resource_counts(intel_cluster, INTEL_GPU) == (0, 0), "another plugin serves it"
    root = intel_cluster.state_dir / "node-root"
    argv = in_private_mounts(
        [str(binary), "-v", "2"],
        # Allocate answers CDI names and writes their specs to /var/run/cdi (-> /run): a
        # private tmpfs, with /run/cdi bound to a dir containerd scans (cdi_spec_dirs), else
        # containerd 2 fails the container ("unresolvable CDI devices intel.cdi.k8s.io/...")
        [Tmpfs("/run"), Bind(str(intel_cluster.layout.cdi_plugins), "/run/cdi"),
         Bind(str(root / "sys"), "/sys"), Bind(str(root / "dev"), "/dev")],
    )
    log = tmp_path / "intel-gpu-plugin.log"
    with running_plugin(argv, log) as proc:
        try:
            wait_counts(intel_cluster, INTEL_GPU, (len(cards), len(cards)))
        except BaseException:
            print(log_tail(log))
            raise
        command = "ls /dev/dri; ls /dev/dri/by-path; sleep 3600"
        with running_pod(intel_cluster, "i915", command,
                         resources={"limits": {INTEL_GPU: "1"}}):
            (device_id,) = container_devices("i915", INTEL_GPU)
            wait_until("the pod's listing",
                       lambda: "-render" in pod_log(intel_cluster, "i915"),
                       30, describe=lambda: f"log {pod_log(intel_cluster, 'i915')!r}; "
                                            f"events {events(intel_cluster, 'i915')}")
            listing = pod_log(intel_cluster, "i915").split()
        assert proc.poll() is None, log_tail(log)
    card = device_id.removesuffix("-0")  # the plugin's ids: cardN-<share index>
    assert card in cards
    assert [n for n in listing if re.fullmatch(r"card\d+", n)] == [card], listing
    assert len([n for n in listing if n.startswith("renderD")]) == 1, listing
    bdf = (root / "sys" / "class" / "drm" / card / "device").resolve().name
    assert f"pci-{bdf}-card" in listing, listing
    assert f"pci-{bdf}-render" in listing, listing

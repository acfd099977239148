"""Optional nvidia-drm DRM nodes for NVIDIA GPUs (a GPU entry's ``drm: true``; off by
default, as on most datacenter nodes): ``class/drm/cardN`` and ``renderD*`` below the GPU's
PCI function, ``/dev/dri``, the ``nvidia_drm`` module; hwloc shows them, and the plugins
that look at DRM nodes for AMD and Intel GPUs do not take them for one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.fakehw.tree import CharDevice, DeviceState, File, Symlink, Tree
from sandbox.profile import load_profile, load_profile_text
from sandbox.profile.spec import NodeSpec
from tests.support.paths import REPO
from tests.support.readers import lstopo, parents

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.network]

PROFILE = """
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: drm}
nodes:
  - name: n
    cpu: {sockets: 2, coresPerSocket: 2}
    devices:
      - {type: gpu, vendor: nvidia, model: l40s, count: 2, drm: true}
      - {type: gpu, vendor: amd, model: mi210, numaNode: 1}
      - {type: gpu, vendor: nvidia, model: t4, numaNode: 1}
"""


def node() -> NodeSpec:
    return load_profile_text(PROFILE).cluster.nodes[0]


def target(tree: Tree, link: str) -> str:
    entry = tree.get(link)
    assert isinstance(entry, Symlink), link
    return os.path.normpath(os.path.join(os.path.dirname(link), entry.target))


def test_drm_index_follows_probe_order_over_every_drm_driver() -> None:
    n = node()
    by_id = {d.id: d for d in n.devices}
    assert [(i, by_id[i].address) for i in ("gpu0", "gpu1", "gpu2", "gpu3")] == [
        ("gpu0", "0000:01:00.0"), ("gpu1", "0000:02:00.0"), ("gpu2", "0000:81:00.0"),
        ("gpu3", "0000:82:00.0")]
    gpus = {i: by_id[i].gpu for i in by_id}
    assert {i: (g.minor, g.drm_index) for i, g in gpus.items() if g is not None} == {
        "gpu0": (0, 0), "gpu1": (1, 1),  # NVIDIA with nvidia-drm: card0, card1
        "gpu2": (2, 2),  # the AMD GPU's card2 comes after them
        "gpu3": (2, -1),  # /dev/nvidia2, no DRM nodes (drm off)
    }


def test_nvidia_drm_nodes_sit_below_the_gpu() -> None:
    n = node()
    tree = build_tree(n)
    for k, gpu in enumerate(("gpu0", "gpu1")):
        d = n.device(gpu)
        assert d is not None
        fn = d.functions[0].path
        for name, minor in ((f"card{k}", k), (f"renderD{128 + k}", 128 + k)):
            sysdir = f"{fn}/drm/{name}"
            assert target(tree, f"sys/class/drm/{name}") == sysdir
            assert target(tree, f"{sysdir}/device") == fn
            assert target(tree, f"sys/dev/char/226:{minor}") == sysdir
            dev = tree.get(f"dev/dri/{name}")
            assert isinstance(dev, CharDevice)
            assert (dev.major, dev.minor) == (226, minor)
        assert target(tree, f"dev/dri/by-path/pci-{d.address}-card") == f"dev/dri/card{k}"
        assert tree.devices[gpu].dev_nodes == (
            f"dev/nvidia{k}", f"dev/dri/card{k}", f"dev/dri/renderD{128 + k}")
        # nvidia is still the PCI driver; nvidia-drm is a DRM driver on top of it.
        assert target(tree, f"{fn}/driver") == "sys/bus/pci/drivers/nvidia"
    t4 = n.device("gpu3")
    assert t4 is not None
    assert tree.get(f"{t4.functions[0].path}/drm") is None
    assert tree.devices["gpu3"].dev_nodes == ("dev/nvidia2",)
    modeset = tree.get("sys/module/nvidia_drm/parameters/modeset")
    assert isinstance(modeset, File)
    initstate = tree.get("sys/module/nvidia_drm/initstate")
    assert isinstance(initstate, File)
    assert initstate.data == b"live\n"
    # The AMD card after the NVIDIA ones, and KFD names its render node.
    assert target(tree, "sys/class/drm/card2").startswith(n.devices[2].functions[0].path)
    amd = tree.get("sys/devices/virtual/kfd/kfd/topology/nodes/2/properties")
    assert isinstance(amd, File)
    assert b"drm_render_minor 130\n" in amd.data


def test_off_by_default_and_gone_when_unplugged() -> None:
    demo = load_profile(REPO / "profiles/8gpu-2numa.yaml").cluster.nodes[0]
    assert build_tree(demo).get("sys/class/drm") is None
    assert build_tree(demo).get("sys/module/nvidia_drm") is None
    n = node()
    gone = build_tree(n, {"gpu0": DeviceState(plugged=False)})
    for path in ("sys/class/drm/card0", "sys/class/drm/renderD128", "dev/dri/card0",
                 "dev/dri/renderD128", "sys/dev/char/226:0",
                 "dev/dri/by-path/pci-0000:01:00.0-card"):
        assert gone.get(path) is None, path
    assert gone.get("sys/class/drm/card1") is not None  # no renumbering
    assert build_tree(n, {"gpu0": DeviceState()}).digest() == build_tree(n).digest()


def test_hwloc_shows_the_drm_os_devices(tmp_path: Path) -> None:
    n = node()
    render(build_tree(n), tmp_path / "root")
    xml = lstopo(tmp_path / "root", "--filter", "io:all", "--filter", "osdev:all")
    up = parents(xml)
    osdevs = {o.get("name"): up[o].get("pci_busid")
              for o in xml.iter("object") if o.get("type") == "OSDev"}
    assert osdevs["card0"] == osdevs["renderD128"] == "0000:01:00.0"
    assert osdevs["card1"] == osdevs["renderD129"] == "0000:02:00.0"
    assert osdevs["card2"] == osdevs["renderD130"] == "0000:81:00.0"
    assert not any(name.startswith(("card", "renderD")) and bus == "0000:82:00.0"
                   for name, bus in osdevs.items())


def test_our_plugins_do_not_mistake_nvidia_drm_for_a_drm_gpu(tmp_path: Path) -> None:
    """The device plugin offers each NVIDIA GPU as nvidia.com/gpu with /dev/nvidiaN, the
    AMD one as amd.com/gpu with its DRM nodes; the DRA driver lists four GPUs. The Intel
    GPU plugin takes a card only when ``device/vendor`` is 0x8086 (checked here as the
    fact it reads; it runs against intel-flex-sriov in test_thirdparty_plugins)."""
    from hwplugins.deviceplugin.discovery import discover as plugin_discover
    from hwplugins.dra.discovery import discover as dra_discover

    n = node()
    root = tmp_path / "root"
    render(build_tree(n), root)
    offered = plugin_discover(root)
    assert sorted(d.resource for d in offered) == ["amd.com/gpu"] + ["nvidia.com/gpu"] * 3
    for d in offered:
        nodes = [p for p in d.dev_nodes if "/dri/" in p]
        if d.resource == "nvidia.com/gpu":
            assert not nodes, d
        else:
            assert nodes == ["/dev/dri/card2", "/dev/dri/renderD130"]
    assert len([d for d in dra_discover(root) if d.name.startswith("gpu-")]) == 4
    vendors = {c.name: (c / "device/vendor").read_text()
               for c in (root / "sys/class/drm").glob("card*")}
    assert vendors == {"card0": "0x10de\n", "card1": "0x10de\n", "card2": "0x1002\n"}


MIXED = """
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: drm-intel}
nodes:
  - name: n
    devices:
      - {type: gpu, vendor: nvidia, model: l40s, drm: true}
      - {type: gpu, vendor: intel, model: flex-170}
"""


def test_intel_gpu_plugin_offers_the_intel_card_only(tmp_path: Path) -> None:
    """Intel's GPU plugin (v0.36.0, unmodified) scans /sys/class/drm: of card0 (an NVIDIA
    L40S with nvidia-drm) and card1 (an Intel Flex 170) it offers card1 alone."""
    from sandbox.kubelet import DeviceManager
    from tests.support.thirdparty import (
        KUBELET_PLUGIN_DIR,
        Bind,
        Tmpfs,
        in_private_mounts,
        live_node,
        plugin_binary,
        require_private_mounts,
        running_plugin,
        short_dir,
    )

    binary = plugin_binary("intel-gpu-plugin")
    require_private_mounts()
    profile = tmp_path / "drm-intel.yaml"
    profile.write_text(MIXED)
    resource = "gpu.intel.com/i915"
    with live_node(str(profile), "n") as live, short_dir("kd-") as base, \
            DeviceManager(base / "dp") as dm:
        assert (live.root / "sys/class/drm/card0/device/vendor").read_text() == "0x10de\n"
        assert (live.root / "sys/class/drm/card1/device/vendor").read_text() == "0x8086\n"
        cmd = in_private_mounts(
            [str(binary), "-v", "2"],
            [Tmpfs("/var/lib"), Bind(str(dm.directory), KUBELET_PLUGIN_DIR), Tmpfs("/run"),
             Bind(str(live.root / "sys"), "/sys"), Bind(str(live.root / "dev"), "/dev")],
        )
        log = base / "plugin.log"
        with running_plugin(cmd, log):
            try:
                snap = dm.wait_for(lambda s: s.capacity(resource) >= 1, 30, f"{resource}")
            except Exception:
                print(log.read_text(errors="replace")[-4000:])
                raise
            assert {d.id for d in snap.resources[resource].devices} == {"card1-0"}
            assert not [r for r in snap.resources if "nvidia" in r]

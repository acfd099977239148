"""Network interface names as udev's net_id builtin (systemd's predictable path names)
gives them: ``en…`` for Ethernet, ``ib…`` for IPoIB, read back by hwloc from the tree."""

from __future__ import annotations

from pathlib import Path

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.fakehw.tree import File
from sandbox.profile import load_profile_text
from sandbox.profile.spec import NodeSpec
from tests.support.readers import lstopo, parents

PROFILE = """
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: names}
nodes:
  - name: n
    cpu: {sockets: 2, coresPerSocket: 2}
    devices:
      - {type: nic, vendor: mellanox, model: connectx-7, linkLayer: infiniband}
      - {type: nic, vendor: mellanox, model: connectx-7, linkLayer: infiniband, ports: 2,
         numaNode: 1}
      - {type: nic, vendor: mellanox, model: connectx-6, ports: 2}
      - {type: nic, vendor: intel, model: x710, pciAddresses: ["0001:01:00.0"]}
"""


def node() -> NodeSpec:
    return load_profile_text(PROFILE).cluster.nodes[0]


def test_ipoib_ports_get_ib_names_ethernet_ports_en_names() -> None:
    n = node()
    names = {d.id: (d.nic.netdevs if d.nic else ()) for d in n.devices}
    # A single-function IB card: no f0 (udev adds it only on a multi-function slot).
    assert names["nic0"] == ("ibp1s0",)
    assert names["nic1"] == ("ibp129s0f0", "ibp129s0f1")
    assert names["nic2"] == ("enp2s0f0", "enp2s0f1")
    assert names["nic3"] == ("enP1p1s0f0",)
    tree = build_tree(n)
    for ifname in ("ibp1s0", "ibp129s0f0", "ibp129s0f1", "enp2s0f0", "enP1p1s0f0"):
        assert tree.get(f"sys/class/net/{ifname}") is not None, ifname
    ib_type = tree.get(f"{n.devices[0].functions[0].path}/net/ibp1s0/type")
    assert isinstance(ib_type, File)
    assert ib_type.data == b"32\n"  # ARPHRD_INFINIBAND


def test_hwloc_shows_the_ib_names_below_their_functions(tmp_path: Path) -> None:
    n = node()
    render(build_tree(n), tmp_path / "root")
    xml = lstopo(tmp_path / "root", "--filter", "io:all", "--filter", "osdev:all")
    up = parents(xml)
    osdevs = {o.get("name"): up[o].get("pci_busid")
              for o in xml.iter("object") if o.get("type") == "OSDev"}
    for d in n.devices:
        assert d.nic is not None
        for p, f in enumerate(d.functions):
            assert osdevs.get(d.nic.netdevs[p]) == f.address

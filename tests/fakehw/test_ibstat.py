"""``ibstat`` (infiniband-diags, through libibumad) reads the fake RDMA devices back: every
CA and port a profile declares, PFs and SR-IOV VFs, with the port state following faults.

libibumad hardcodes /sys, so ibstat runs unmodified in a private mount namespace whose /sys,
/dev and /proc are a fake root: a rendered tree, and a live FUSE mount for the faults.
Parametrized over every node with RDMA of every profile in profiles/; every expected value
comes from the profile. A missing ibstat FAILS with the apt-get line (never skips).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import load_profile
from sandbox.profile.spec import DeviceSpec, NodeSpec
from tests.support.paths import REPO
from tests.support.readers import IbCa, ibstat
from tests.support.thirdparty import live_node, require_private_mounts

pytestmark = [pytest.mark.root]

PROFILES = sorted(REPO.glob("profiles/*.yaml"))
CASES = [
    pytest.param((path, node.name), id=f"{path.stem}/{node.name}")
    for path in PROFILES
    for node in load_profile(path).cluster.nodes
    if any(d.nic is not None and d.nic.rdma for d in node.devices)
]
LINK_LAYER = {"infiniband": "InfiniBand", "ethernet": "Ethernet"}


def rdma_nics(node: NodeSpec) -> list[DeviceSpec]:
    return [d for d in node.devices if d.nic is not None and d.nic.rdma]


def guid(colons: str) -> str:
    """A profile's ``aa:bb:…`` GUID as ibstat prints it."""
    return "0x" + colons.replace(":", "")


def vf_cas(root: Path, d: DeviceSpec, cas: dict[str, IbCa]) -> list[str]:
    """The CAs ibstat shows for ``d``'s VFs: those whose PCI function's ``physfn`` is one of
    ``d``'s physical functions."""
    pfs = {f.address for f in d.functions}
    out = []
    for name in cas:
        physfn = root / f"sys/class/infiniband/{name}/device/physfn"
        if physfn.is_symlink() and physfn.resolve().name in pfs:
            out.append(name)
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Path, str], Path]:
    return {}


def render_once(cache: dict[tuple[Path, str], Path], tmp: pytest.TempPathFactory,
                path: Path, name: str) -> tuple[NodeSpec, Path]:
    node = load_profile(path).cluster.node(name)
    assert node is not None
    if (path, name) not in cache:
        root = tmp.mktemp(f"{path.stem}-{name}")
        render(build_tree(node), root, force=True)
        cache[(path, name)] = root
    return node, cache[(path, name)]


@pytest.mark.parametrize("case", CASES)
def test_ibstat_lists_every_ca_and_port(
    case: tuple[Path, str], rendered: dict[tuple[Path, str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    node, root = render_once(rendered, tmp_path_factory, *case)
    cas = ibstat(root)
    expected = 0
    for d in rdma_nics(node):
        nic = d.nic
        assert nic is not None
        vfs = vf_cas(root, d, cas)
        # mlx5 gives every enabled VF its own RDMA device; other vendors' VFs have none.
        assert len(vfs) == (nic.num_vfs * nic.ports if d.vendor == "mellanox" else 0), vfs
        expected += len(nic.rdma_devs) + len(vfs)
        for p, name in enumerate(nic.rdma_devs):
            assert name in cas, f"{name} missing from ibstat: {sorted(cas)}"
            assert cas[name].fields["Node GUID"] == guid(nic.node_guids[p])
            assert cas[name].fields["System image GUID"] == guid(nic.node_guids[p])
        for name in [*nic.rdma_devs, *vfs]:
            ca = cas[name]
            if d.vendor == "mellanox":
                device_id = nic.vf_device_id if name in vfs else d.functions[0].device_id
                assert ca.fields["CA type"] == f"MT{device_id}"
            assert ca.fields["Number of ports"] == "1"
            assert list(ca.ports) == [1]
            port = ca.ports[1]
            assert port["State"] == "Active"
            assert port["Physical state"] == "LinkUp"
            assert port["Rate"] == str(nic.speed // 1000)
            assert port["Link layer"] == LINK_LAYER[nic.link_layer]
            assert port["Port GUID"] == ca.fields["Node GUID"]
            if nic.link_layer == "infiniband":
                assert port["SM lid"] == "1"
                assert port["Base lid"] != "0"
            else:
                assert (port["Base lid"], port["SM lid"]) == ("0", "0")
    assert len(cas) == expected, sorted(cas)


def test_pkey_table_has_the_default_key_first(
    rendered: dict[tuple[Path, str], Path], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """libibumad reads every ``pkeys/N``: 128 on an InfiniBand port, one on RoCE; 0xffff first."""
    node, root = render_once(rendered, tmp_path_factory, REPO / "profiles/sriov-rdma.yaml",
                             "net-worker")
    seen = set()
    for d in rdma_nics(node):
        assert d.nic is not None
        for name in d.nic.rdma_devs:
            pkeys = root / f"sys/class/infiniband/{name}/ports/1/pkeys"
            size = 128 if d.nic.link_layer == "infiniband" else 1
            assert sorted(int(p.name) for p in pkeys.iterdir()) == list(range(size))
            assert (pkeys / "0").read_text() == "0xffff\n"
            assert {(pkeys / str(i)).read_text() for i in range(1, size)} <= {"0x0000\n"}
            seen.add(d.nic.link_layer)
    assert seen == {"infiniband", "ethernet"}


def ib_nic(node: NodeSpec) -> DeviceSpec:
    return next(d for d in rdma_nics(node) if d.nic is not None
                and d.nic.link_layer == "infiniband")


def test_ibstat_follows_faults_on_a_live_tree() -> None:
    """port-down disables the IB port, link-down leaves it polling, healthy brings it back;
    set-vfs adds and removes the VFs' CAs. Read by ibstat through the live FUSE mount."""
    require_private_mounts()
    node = load_profile(REPO / "profiles/sriov-rdma.yaml").cluster.node("net-worker")
    assert node is not None
    ib = ib_nic(node)
    assert ib.nic is not None
    name = ib.nic.rdma_devs[0]
    roce = next(d for d in rdma_nics(node) if d.vendor == "mellanox" and d.nic is not None
                and d.nic.num_vfs)
    assert roce.nic is not None
    with live_node("sriov-rdma.yaml", "net-worker") as live, live.client() as client:
        before = ibstat(live.root)
        assert before[name].ports[1]["State"] == "Active"
        client.health(ib.id, "unhealthy", "port-down")
        port = ibstat(live.root, name)[name].ports[1]
        assert (port["State"], port["Physical state"]) == ("Down", "Disabled")
        client.health(ib.id, "unhealthy", "link-down")
        port = ibstat(live.root, name)[name].ports[1]
        assert (port["State"], port["Physical state"]) == ("Down", "Polling")
        client.health(ib.id, "healthy")
        port = ibstat(live.root, name)[name].ports[1]
        assert (port["State"], port["Physical state"]) == ("Active", "LinkUp")
        # The other CAs never changed.
        after = ibstat(live.root)
        assert {n: c.ports for n, c in after.items()} == {n: c.ports for n, c in before.items()}

        client.set_vfs(roce.id, 1)
        cas = ibstat(live.root)
        vfs = vf_cas(live.root, roce, cas)
        assert len(vfs) == roce.nic.ports
        assert len(cas) == len(before) - (roce.nic.num_vfs - 1) * roce.nic.ports
        client.set_vfs(roce.id, 0)
        assert not vf_cas(live.root, roce, ibstat(live.root))


"""The reference device plugin, run as a real process against the kubelet harness.

Real gRPC over unix sockets in tmp_path; the hardware is tests/support/sysfs_fixture.py's tree.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hwplugins.deviceplugin import Rule, discover, pack

from sandbox.kubelet import DeviceManager, Policy, TopologyAffinityError
from tests.support.sysfs_fixture import FakeGpu, remove_gpu, set_aer_fatal, write_nvidia_tree

pytestmark = [pytest.mark.root]

GPU = "nvidia.com/gpu"


class Node:
    def __init__(self, root: Path, gpus: list[FakeGpu], dm: DeviceManager) -> None:
        self.root, self.gpus, self.dm = root, gpus, dm


def _start_plugin(root: Path, kubelet_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "hwplugins.deviceplugin", "--root", str(root),
         "--kubelet-dir", str(kubelet_dir), "--interval", "0.2", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _stop_plugin(proc: subprocess.Popen[bytes]) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail("plugin ignored SIGTERM for 10 s:\n" + out.decode(errors="replace"))
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"plugin did not exit cleanly:\n{text}"
    return text


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """Unix socket paths must stay short (grpcio: 105 bytes); pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(tmp_path: Path, sockdir: Path, request: pytest.FixtureRequest) -> Iterator[Node]:
    root = tmp_path / "root"
    gpus = write_nvidia_tree(root, gpus=8, numa_nodes=2)
    extra = getattr(request, "param", ())
    with DeviceManager(sockdir) as dm:
        proc = _start_plugin(root, dm.directory, *extra)
        try:
            dm.wait_registered(GPU, timeout=10)
            yield Node(root, gpus, dm)
        finally:
            _stop_plugin(proc)


def test_lists_every_gpu_split_by_numa(node: Node) -> None:
    state = node.dm.snapshot().resources[GPU]
    assert (state.capacity, state.allocatable) == (8, 8)
    by_numa = state.by_numa()
    assert set(by_numa) == {0, 1}
    assert sorted(by_numa[0]) == sorted(g.uuid for g in node.gpus if g.numa_node == 0)
    assert len(by_numa[1]) == 4
    assert state.options == {
        "pre_start_required": False,
        "get_preferred_allocation_available": True,
    }


def test_removed_device_drops_capacity(node: Node) -> None:
    remove_gpu(node.root, node.gpus[7])
    snap = node.dm.wait_for(lambda s: s.capacity(GPU) == 7, 5, "capacity 7")
    assert node.gpus[7].uuid not in {d.id for d in snap.resources[GPU].devices}


def test_aer_fatal_makes_device_unhealthy_not_gone(node: Node) -> None:
    set_aer_fatal(node.gpus[2], 1)
    snap = node.dm.wait_for(lambda s: s.allocatable(GPU) == 7, 5, "allocatable 7")
    assert snap.capacity(GPU) == 8
    sick = [d for d in snap.resources[GPU].devices if d.health == "Unhealthy"]
    assert [d.id for d in sick] == [node.gpus[2].uuid]
    set_aer_fatal(node.gpus[2], 0)
    node.dm.wait_for(lambda s: s.allocatable(GPU) == 8, 5, "recovery")


def test_reregisters_after_kubelet_restart(node: Node) -> None:
    node.dm.restart()
    assert node.dm.snapshot().capacity(GPU) == 0  # forgotten until the plugin returns
    snap = node.dm.wait_registered(GPU, timeout=2)
    assert snap.capacity(GPU) == 8
    kinds = [e.kind for e in node.dm.events if e.resource == GPU]
    assert kinds.count("register") == 2
    # The kubelet's order: Register, dial-back, options, then ListAndWatch.
    after = kinds[len(kinds) - 1 - kinds[::-1].index("register") :]
    assert after[:4] == ["register", "dial", "options", "list-and-watch"]


def test_single_numa_node_allocation_stays_on_one_node(node: Node) -> None:
    alloc = node.dm.allocate(GPU, 4, Policy.SINGLE_NUMA_NODE)
    assert len(alloc.device_ids) == 4
    assert len(alloc.numa_nodes) == 1
    assert alloc.affinity == alloc.numa_nodes
    minors = sorted(g.minor for g in node.gpus if g.uuid in alloc.device_ids)
    paths = [c for c, _, _ in alloc.devices]
    assert paths[:4] == [f"/dev/nvidia{m}" for m in minors]
    assert "/dev/nvidiactl" in paths
    assert all(c == h for c, h, _ in alloc.devices)
    assert alloc.envs["NVIDIA_VISIBLE_DEVICES"].split(",") == list(alloc.device_ids)
    assert alloc.cdi_devices == tuple(f"nvidia.com/gpu={i}" for i in alloc.device_ids)
    # The other node still fits 4.
    second = node.dm.allocate(GPU, 4, Policy.SINGLE_NUMA_NODE)
    assert second.numa_nodes.isdisjoint(alloc.numa_nodes)


def test_single_numa_node_rejects_what_no_node_holds(node: Node) -> None:
    with pytest.raises(TopologyAffinityError, match="single-numa-node"):
        node.dm.allocate(GPU, 5, Policy.SINGLE_NUMA_NODE)
    both = node.dm.allocate(GPU, 5, Policy.RESTRICTED)  # two nodes is the minimum: preferred
    assert both.numa_nodes == {0, 1}


def test_plugin_packs_preferred_allocation_onto_one_node(node: Node) -> None:
    first = node.dm.allocate(GPU, 1, Policy.NONE)  # leaves 3 + 4 free
    alloc = node.dm.allocate(GPU, 3, Policy.NONE)
    asked = node.dm.events_of("preferred-allocation", GPU)
    assert asked, "GetPreferredAllocation was offered but never called"
    assert len(alloc.numa_nodes) == 1
    assert alloc.numa_nodes == first.numa_nodes  # best fit: the node with exactly 3 left


@pytest.mark.parametrize("node", [("--pre-start-required",)], indirect=True)
def test_pre_start_container_when_required(node: Node) -> None:
    assert node.dm.snapshot().resources[GPU].options["pre_start_required"]
    alloc = node.dm.allocate(GPU, 2, Policy.BEST_EFFORT)
    assert alloc.pre_started
    assert node.dm.events_of("pre-start", GPU)[-1].detail == ",".join(alloc.device_ids)


def test_list_mode_prints_devices(tmp_path: Path) -> None:
    write_nvidia_tree(tmp_path, gpus=2)
    out = subprocess.run(
        [sys.executable, "-m", "hwplugins.deviceplugin", "--root", str(tmp_path), "--list"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    devices = json.loads(out)
    assert [d["resource"] for d in devices] == [GPU, GPU]


def test_discovery_without_proc_info_numbers_gpus_by_order(tmp_path: Path) -> None:
    gpus = write_nvidia_tree(tmp_path, gpus=3)
    for g in gpus:
        (tmp_path / "proc/driver/nvidia/gpus" / g.bdf / "information").unlink()
    found = discover(tmp_path)
    assert [d.id for d in found] == [g.bdf for g in gpus]
    assert [d.dev_nodes[0] for d in found] == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2"]


def test_config_rule_renames_resource(tmp_path: Path) -> None:
    write_nvidia_tree(tmp_path, gpus=1)
    rules = (Rule("nvidia-gpu", "example.com/gpu", vendor=0x10DE, pci_class="0x0302"),)
    assert [d.resource for d in discover(tmp_path, rules)] == ["example.com/gpu"]


@pytest.mark.parametrize(
    ("available", "must", "size", "expected"),
    [
        (["a0", "a1", "b0", "b1", "b2"], [], 2, ["a0", "a1"]),  # smallest node that fits
        (["a0", "a1", "b0", "b1", "b2"], [], 3, ["b0", "b1", "b2"]),
        (["a0", "a1", "b0", "b1", "b2"], ["a1"], 2, ["a1", "a0"]),  # fill must's node first
        (["a0", "b0", "b1", "b2"], [], 4, ["b0", "b1", "b2", "a0"]),  # drain the fullest
        (["a0", "x"], [], 2, ["a0", "x"]),  # no-NUMA devices last
    ],
)
def test_pack(available: list[str], must: list[str], size: int, expected: list[str]) -> None:
    numa = {d: (0 if d.startswith("a") else 1 if d.startswith("b") else None) for d in available}
    assert pack(available, must, size, numa) == expected


def test_unknown_device_id_is_rejected(node: Node) -> None:
    import grpc
    from hwplugins.api import deviceplugin_v1beta1_pb2 as pb
    from hwplugins.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc

    endpoint = node.dm.directory / node.dm.snapshot().resources[GPU].endpoint
    with grpc.insecure_channel(f"unix://{endpoint}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        request = pb.AllocateRequest(container_requests=[{"devices_ids": ["nope"]}])
        with pytest.raises(grpc.RpcError) as err:
            stub.Allocate(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nope" in (err.value.details() or "")


def _pci(root: Path, bdf: str, attrs: dict[str, str], links: dict[str, str] | None = None) -> Path:
    real = root / "sys/devices/pci0000:00" / bdf
    real.mkdir(parents=True)
    for name, value in attrs.items():
        (real / name).parent.mkdir(parents=True, exist_ok=True)
        (real / name).write_text(value + "\n")
    for name, target in (links or {}).items():
        (real / name).symlink_to(target)
    bus = root / "sys/bus/pci/devices"
    bus.mkdir(parents=True, exist_ok=True)
    (bus / bdf).symlink_to(f"../../../devices/pci0000:00/{bdf}")
    return real


def _dev(root: Path, *names: str) -> None:
    for name in names:
        (root / "dev" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "dev" / name).write_text("")


def test_discovers_amd_intel_vf_and_fpga(tmp_path: Path) -> None:
    amd = _pci(tmp_path, "0000:c1:00.0", {"vendor": "0x1002", "class": "0x038000",
                                           "numa_node": "1"})  # fmt: skip
    (amd / "drm/card1").mkdir(parents=True)
    (amd / "drm/renderD129").mkdir()
    intel = _pci(tmp_path, "0000:03:00.0", {"vendor": "0x8086", "class": "0x030000",
                                             "numa_node": "-1"},
                 {"driver": "../../../bus/pci/drivers/xe"})  # fmt: skip
    (intel / "drm/card0").mkdir(parents=True)
    (intel / "drm/renderD128").mkdir()
    hidden = _pci(tmp_path, "0000:04:00.0", {"vendor": "0x8086", "class": "0x030000",
                                              "sriov_numvfs": "2"})  # fmt: skip
    (hidden / "drm/card2").mkdir(parents=True)
    _pci(tmp_path, "0000:17:00.0", {"vendor": "0x15b3", "class": "0x020000"})  # a PF: ignored
    _pci(tmp_path, "0000:17:00.2",
         {"vendor": "0x15b3", "class": "0x020000", "numa_node": "0",
          "net/ens1f0v0/operstate": "down", "infiniband/mlx5_2/ports/1/state": "4: ACTIVE",
          "infiniband_verbs/uverbs2/ibdev": "mlx5_2"},
         {"physfn": "../0000:17:00.0"})  # fmt: skip
    _pci(tmp_path, "0000:5e:00.0",
         {"vendor": "0x8086", "class": "0x120000", "numa_node": "0",
          "fpga_region/region0/dfl-port.0/afu_id": "d8424dc4a4a3c413f89e433683f9040b"})  # fmt: skip
    _dev(tmp_path, "dri/card0", "dri/renderD128", "dri/card1", "dri/renderD129", "kfd",
         "infiniband/uverbs2", "infiniband/rdma_cm", "dfl-port.0")  # fmt: skip

    found = {d.resource: d for d in discover(tmp_path)}
    assert sorted(found) == ["amd.com/gpu", "gpu.intel.com/xe", "sandbox.io/fpga-port",
                             "sandbox.io/sriov-vf"]  # fmt: skip
    a = found["amd.com/gpu"]
    assert (a.id, a.numa_node, a.health) == ("0000:c1:00.0", 1, "Healthy")
    assert a.dev_nodes == ("/dev/dri/card1", "/dev/dri/renderD129", "/dev/kfd")
    assert a.env == (("AMD_VISIBLE_DEVICES", "0000:c1:00.0"),)
    i = found["gpu.intel.com/xe"]
    assert (i.id, i.numa_node, i.cdi_name) == ("card0", None, "intel.com/gpu=card0")
    v = found["sandbox.io/sriov-vf"]
    assert v.health == "Unhealthy"
    assert v.reason == "ens1f0v0 operstate down"
    assert v.dev_nodes == ("/dev/infiniband/uverbs2", "/dev/infiniband/rdma_cm")
    assert v.env == (("PCIDEVICE_SANDBOX_IO_SRIOV_VF", "0000:17:00.2"),)
    f = found["sandbox.io/fpga-port"]
    assert (f.id, f.dev_nodes, f.health) == ("dfl-port.0", ("/dev/dfl-port.0",), "Healthy")


def test_infiniband_port_down_is_unhealthy(tmp_path: Path) -> None:
    _pci(tmp_path, "0000:17:00.2",
         {"vendor": "0x15b3", "class": "0x020700", "infiniband/mlx5_2/ports/1/state": "1: DOWN"},
         {"physfn": "../0000:17:00.0"})  # fmt: skip
    (dev,) = discover(tmp_path)
    assert (dev.health, dev.reason) == ("Unhealthy", "mlx5_2 port 1 state 1: DOWN")


def test_char_device_nodes_count_as_present(tmp_path: Path) -> None:
    gpus = write_nvidia_tree(tmp_path, gpus=1)
    node = tmp_path / "dev/nvidia0"
    node.unlink()
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, 0))  # as root, like the real node
    (dev,) = discover(tmp_path)
    assert (dev.id, dev.health) == (gpus[0].uuid, "Healthy")
    node.unlink()
    (dev,) = discover(tmp_path)
    assert (dev.health, dev.reason) == ("Unhealthy", "/dev/nvidia0 missing")


def test_cdi_specs_resolve_every_name_allocate_gives(tmp_path: Path, sockdir: Path) -> None:
    """--cdi-dir: the CDI names of Allocate resolve in the specs the plugin keeps there
    (what containerd 2.x reads from /var/run/cdi), with the same device nodes as the
    DeviceSpecs; an unplugged GPU leaves them; a stopped plugin takes them away."""
    root, cdi = tmp_path / "root", tmp_path / "cdi"
    gpus = write_nvidia_tree(root, gpus=8, numa_nodes=2)
    with DeviceManager(sockdir) as dm:
        proc = _start_plugin(root, dm.directory, "--cdi-dir", str(cdi))
        try:
            dm.wait_registered(GPU, timeout=10)
            spec_file = cdi / "hwsandbox-deviceplugin-nvidia.com-gpu.json"
            spec = json.loads(spec_file.read_text())
            assert (spec["cdiVersion"], spec["kind"]) == ("0.6.0", "nvidia.com/gpu")
            named = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]]
                     for d in spec["devices"]}
            assert sorted(named) == sorted(g.uuid for g in gpus)
            alloc = dm.allocate(GPU, 2)
            for name in alloc.cdi_devices:
                kind, _, device = name.partition("=")
                assert kind == spec["kind"]
                assert set(named[device]) <= {c for c, _, _ in alloc.devices}, named[device]
            remove_gpu(root, gpus[7])
            dm.wait_for(lambda s: s.capacity(GPU) == 7, 5, "capacity 7")
            after = json.loads(spec_file.read_text())
            assert gpus[7].uuid not in {d["name"] for d in after["devices"]}
            assert [p.name for p in cdi.iterdir()] == [spec_file.name]  # no temporary left
        finally:
            _stop_plugin(proc)
    assert list(cdi.iterdir()) == []

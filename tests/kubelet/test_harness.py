"""The kubelet harness (sandbox.kubelet): registration rules, restart, topology, conformance.

Plugins here are real processes or real in-process gRPC servers on unix sockets.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from hwplugins.api import deviceplugin_v1beta1_pb2 as dp
from hwplugins.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from hwplugins.api import dra_v1beta1_pb2 as dra
from hwplugins.api import dra_v1beta1_pb2_grpc as dra_grpc
from hwplugins.api import pluginregistration_v1_pb2 as reg
from hwplugins.api import pluginregistration_v1_pb2_grpc as reg_grpc

from sandbox.kubelet import (
    Claim,
    DeviceManager,
    Hint,
    PluginWatcher,
    Policy,
    TopologyAffinityError,
    check,
    is_extended_resource_name,
)
from sandbox.kubelet.conformance import FaultResult
from sandbox.kubelet.topology import admit, device_hints
from tests.support.sysfs_fixture import set_aer_fatal, write_nvidia_tree

pytestmark = [pytest.mark.root]

PLUGIN = [sys.executable, "-m", "hwplugins.deviceplugin"]


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """Unix socket paths must stay short (grpcio: 105 bytes); pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("nvidia.com/gpu", True),
        ("gpu.intel.com/i915", True),
        ("example.com/a_b-c.d", True),
        ("gpu", False),  # not domain-prefixed: a native resource
        ("kubernetes.io/gpu", False),
        ("node.kubernetes.io/gpu", False),
        ("requests.example.com/gpu", False),
        ("Example.com/gpu", False),
        ("example.com/-gpu", False),
        ("example.com/a/b", False),
    ],
)
def test_extended_resource_names(name: str, ok: bool) -> None:
    assert is_extended_resource_name(name) is ok


@pytest.mark.parametrize(
    ("version", "resource", "message"),
    [
        ("v1alpha", "example.com/x", "requested API version 'v1alpha' is not supported"),
        ("v1beta1", "kubernetes.io/x", "the ResourceName 'kubernetes.io/x' is invalid"),
    ],
)
def test_register_is_validated(sockdir: Path, version: str, resource: str, message: str) -> None:
    with DeviceManager(sockdir) as dm, grpc.insecure_channel(f"unix://{dm.socket_path}") as ch:
        request = dp.RegisterRequest(version=version, endpoint="x.sock", resource_name=resource)
        with pytest.raises(grpc.RpcError) as err:
            dp_grpc.RegistrationStub(ch).Register(request, timeout=5)
        assert message in (err.value.details() or "")
        assert dm.events_of("register-rejected", resource)


def test_stream_end_marks_devices_unhealthy_but_keeps_capacity(
    tmp_path: Path, sockdir: Path
) -> None:
    write_nvidia_tree(tmp_path, gpus=4)
    with DeviceManager(sockdir) as dm:
        proc = subprocess.Popen([*PLUGIN, "--root", str(tmp_path), "--kubelet-dir", str(sockdir)],
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            dm.wait_registered("nvidia.com/gpu", 10)
        finally:
            proc.kill()
            proc.wait(10)
        snap = dm.wait_for(lambda s: s.allocatable("nvidia.com/gpu") == 0, 5, "stream end")
        assert snap.capacity("nvidia.com/gpu") == 4
        assert not snap.resources["nvidia.com/gpu"].connected
        assert dm.events_of("stream-end", "nvidia.com/gpu")


def test_restart_keeps_checkpoint_and_deletes_sockets(sockdir: Path) -> None:
    with DeviceManager(sockdir) as dm:
        stray = sockdir / "stray.sock"
        server = grpc.server(ThreadPoolExecutor(1))
        server.add_insecure_port(f"unix://{stray}")
        server.start()
        (sockdir / "notes.txt").write_text("not a socket\n")
        before = dm.socket_path.stat().st_ino, dm.socket_path.stat().st_ctime_ns
        dm.restart()
        server.stop(None)
        assert not stray.exists()
        assert (sockdir / "kubelet_internal_checkpoint").exists()
        assert (sockdir / "notes.txt").exists()
        assert (dm.socket_path.stat().st_ino, dm.socket_path.stat().st_ctime_ns) != before


# TopologyManager ---------------------------------------------------------------------------

NUMA = {"a0": (0,), "a1": (0,), "b0": (1,), "b1": (1,), "b2": (1,)}


def test_hints_prefer_the_fewest_nodes() -> None:
    hints = device_hints([0, 1], NUMA, sorted(NUMA), 2)
    assert hints == [Hint(frozenset({0}), True), Hint(frozenset({1}), True),
                     Hint(frozenset({0, 1}), False)]  # fmt: skip
    assert admit(Policy.BEST_EFFORT, hints, [0, 1]) == Hint(frozenset({0}), True)


def test_hints_count_all_devices_for_preference() -> None:
    # Only a0 and b0..b2 free: {0} cannot hold 2, but it is still the minimal size on paper.
    hints = device_hints([0, 1], NUMA, ["a0", "b0", "b1"], 2)
    assert hints == [Hint(frozenset({1}), True), Hint(frozenset({0, 1}), False)]


@pytest.mark.parametrize(
    ("policy", "expect"),
    [
        (Policy.NONE, None),
        (Policy.BEST_EFFORT, frozenset({0, 1})),
        (Policy.RESTRICTED, frozenset({0, 1})),  # two nodes is the minimum: preferred
        (Policy.SINGLE_NUMA_NODE, TopologyAffinityError),
    ],
)
def test_policies_for_a_request_spanning_nodes(policy: Policy, expect: Any) -> None:
    hints = device_hints([0, 1], NUMA, sorted(NUMA), 4)
    if expect is TopologyAffinityError:
        with pytest.raises(TopologyAffinityError):
            admit(policy, hints, [0, 1])
    else:
        got = admit(policy, hints, [0, 1])
        assert (got.nodes if got else None) == expect


def test_restricted_rejects_a_non_preferred_fit() -> None:
    hints = device_hints([0, 1], NUMA, ["a0", "b0"], 2)  # {0} or {1} would be minimal
    assert hints == [Hint(frozenset({0, 1}), False)]
    assert admit(Policy.BEST_EFFORT, hints, [0, 1]) == Hint(frozenset({0, 1}), False)
    with pytest.raises(TopologyAffinityError):
        admit(Policy.RESTRICTED, hints, [0, 1])


def test_no_numa_info_means_no_preference() -> None:
    assert device_hints([0, 1], {"x": (), "y": ()}, ["x", "y"], 1) is None
    assert admit(Policy.SINGLE_NUMA_NODE, None, [0, 1]) == Hint(frozenset({0, 1}), True)


# conformance -------------------------------------------------------------------------------


def test_check_passes_for_the_reference_plugin(tmp_path: Path, sockdir: Path) -> None:
    gpus = write_nvidia_tree(tmp_path / "root", gpus=4)
    advertised: list[Sequence[str]] = []

    def fault(ids: Sequence[str]) -> FaultResult:
        advertised.append(ids)
        set_aer_fatal(gpus[0], 3)
        return FaultResult(True, "gpu0 AER fatal")

    report = check(
        [*PLUGIN, "--root", str(tmp_path / "root"), "--kubelet-dir", "{kubelet_dir}"],
        workdir=sockdir,
        fault=fault,
        restart_within=2,
    )
    assert report.passed, f"{report}\n--- plugin output ---\n{report.plugin_output}"
    assert {r.name: r.status for r in report.results} == {
        name: "pass"
        for name in ("registers", "serves-before-register", "registration-accepted", "options",
                     "list-and-watch", "allocate", "health-update", "restart", "still-running")
    }  # fmt: skip
    assert "3 healthy" in report.result("health-update").message
    assert report.result("health-update").message.startswith("gpu0 AER fatal: new device list")
    assert len(advertised) == 1
    assert len(advertised[0]) == 4


BROKEN_PLUGIN = textwrap.dedent(
    '''
    """A device plugin with the classic bug: it registers before it serves."""
    import os, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import grpc
    from hwplugins.api import deviceplugin_v1beta1_pb2 as pb
    from hwplugins.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc

    d = os.environ["KUBELET_DEVICE_PLUGIN_DIR"]
    request = pb.RegisterRequest(version="v1beta1", endpoint="broken.sock",
                                 resource_name="example.com/broken")
    with grpc.insecure_channel(f"unix://{d}/kubelet.sock") as ch:
        try:
            pb_grpc.RegistrationStub(ch).Register(request, timeout=30)
        except grpc.RpcError as exc:
            print("Register failed:", exc.details(), flush=True)

    class Plugin:
        def GetDevicePluginOptions(self, request, context):
            return pb.DevicePluginOptions()
        def ListAndWatch(self, request, context):
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID="d0", health="Healthy")])
            while context.is_active():
                time.sleep(0.1)

    server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_DevicePluginServicer_to_server(Plugin(), server)
    server.add_insecure_port(f"unix://{d}/broken.sock")
    server.start()
    time.sleep(3600)
    '''
)


def test_check_reports_a_plugin_that_registers_before_serving(
    tmp_path: Path, sockdir: Path
) -> None:
    script = tmp_path / "broken_plugin.py"
    script.write_text(BROKEN_PLUGIN)
    report = check([sys.executable, str(script)], workdir=sockdir, timeout=5, dial_timeout=2)
    assert not report.passed
    serve = report.result("serves-before-register")
    assert serve.status == "fail"
    assert "serve first, then Register" in serve.message
    accepted = report.result("registration-accepted")
    assert accepted.status == "fail"
    assert "failed to dial device plugin" in accepted.message
    assert report.result("registers").status == "pass"
    assert "Register failed: failed to dial device plugin" in report.plugin_output
    assert "FAIL     serves-before-register" in str(report)


# plugin watcher (DRA) --------------------------------------------------------------------


class _FakeDriver:
    """A DRA kubelet plugin: Registration on plugins_registry, DRAPlugin v1beta1 on its own."""

    def __init__(self, registry: Path, plugin_dir: Path) -> None:
        self.endpoint = plugin_dir / "dra.sock"
        self.socket = registry / "gpu.example.com-reg.sock"
        self.statuses: list[tuple[bool, str]] = []
        self.notified = threading.Event()
        self.server = grpc.server(ThreadPoolExecutor(4))
        reg_grpc.add_RegistrationServicer_to_server(self, self.server)
        dra_grpc.add_DRAPluginServicer_to_server(self, self.server)
        plugin_dir.mkdir(parents=True, exist_ok=True)
        self.server.add_insecure_port(f"unix://{self.endpoint}")

    def start(self) -> None:
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()

    def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        return reg.PluginInfo(
            type="DRAPlugin",
            name="gpu.example.com",
            endpoint=str(self.endpoint),
            supported_versions=["v9.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAPlugin"],
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.statuses.append((request.plugin_registered, request.error))
        self.notified.set()
        return reg.RegistrationStatusResponse()

    def NodePrepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        response = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].devices.add(
                request_names=["gpu"], pool_name="node-a", device_name="gpu-0",
                cdi_device_ids=["gpu.example.com/gpu=gpu-0"],
            )  # fmt: skip
        return response

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].error = ""
        return response


def test_plugin_watcher_registers_a_dra_driver(sockdir: Path) -> None:
    registry = sockdir / "plugins_registry"
    registry.mkdir()
    driver = _FakeDriver(registry, sockdir / "plugins" / "gpu.example.com")
    with PluginWatcher(registry) as watcher:
        driver.start()
        try:
            plugin = watcher.wait_registered("gpu.example.com", 5)
            assert driver.notified.wait(5)
            assert driver.statuses == [(True, "")]
            assert plugin.version == "v1beta1.DRAPlugin"  # the first entry the kubelet knows
            claims = watcher.prepare("gpu.example.com", [Claim("default", "uid-1", "c1")])
            assert list(claims) == ["uid-1"]
            assert list(claims["uid-1"].devices[0].cdi_device_ids) == ["gpu.example.com/gpu=gpu-0"]
            assert watcher.unprepare("gpu.example.com", [Claim("default", "uid-1", "c1")])
            driver.socket.unlink()
            deadline = time.monotonic() + 5
            while "gpu.example.com" in watcher.plugins and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "gpu.example.com" not in watcher.plugins
        finally:
            driver.server.stop(None)

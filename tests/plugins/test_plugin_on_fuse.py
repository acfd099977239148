"""Acceptance: the reference device plugin on a REAL live tree, graded by the kubelet harness.

profiles/8gpu-2numa.yaml's gpu-worker is mounted over FUSE by `sandbox mount`; faults go
through its control socket exactly as `sandbox fault` sends them; the plugin is a separate
process reading only the mount (--root) and talking gRPC to the harness over unix sockets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandbox.kubelet import DeviceManager, Policy
from tests.kubelet.test_harness import BROKEN_PLUGIN  # registers before it serves
from tests.support.thirdparty import LiveNode, live_node, short_dir

pytestmark = [pytest.mark.root, pytest.mark.fuse]

GPU = "nvidia.com/gpu"
PLUGIN = [sys.executable, "-m", "hwplugins.deviceplugin"]


@dataclass(frozen=True)
class GpuNode:
    live: LiveNode
    dm: DeviceManager
    uuid: dict[str, str]  # profile device id (gpu0..) -> the GPU UUID the plugin advertises
    numa: dict[str, int]  # profile device id -> NUMA node, as the control API reports it


def _gpu_uuids(root: Path, devices: dict[str, dict[str, Any]]) -> dict[str, str]:
    """What the driver reports per GPU (proc/driver/nvidia/gpus/<BDF>/information)."""
    out: dict[str, str] = {}
    for dev_id, dev in devices.items():
        if dev["kind"] != "gpu":
            continue
        info = root / "proc/driver/nvidia/gpus" / dev["pci_address"] / "information"
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "GPU UUID":
                out[dev_id] = value.strip()
    return out


def _start_plugin(root: Path, kubelet_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*PLUGIN, "--root", str(root), "--kubelet-dir", str(kubelet_dir), "--interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
    return out.decode(errors="replace") if out else ""


@pytest.fixture
def gpu_node() -> Iterator[GpuNode]:
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live, short_dir("kl-") as sockdir:
        with live.client() as client:
            devices = client.devices()
        uuid = _gpu_uuids(live.root, devices)
        numa = {k: int(v["numa_node"]) for k, v in devices.items() if k in uuid}
        with DeviceManager(sockdir, numa_nodes=[0, 1]) as dm:
            proc = _start_plugin(live.root, dm.directory)
            try:
                dm.wait_registered(GPU, timeout=15)
                yield GpuNode(live, dm, uuid, numa)
            finally:
                output = _stop(proc)
                assert proc.returncode == 0, f"plugin did not exit cleanly:\n{output}"


def _wait(node: GpuNode, what: str, pred: Callable[[Any], bool]) -> Any:
    return node.dm.wait_for(pred, 10, what)


def test_eight_gpus_four_per_numa_node(gpu_node: GpuNode) -> None:
    state = gpu_node.dm.snapshot().resources[GPU]
    assert (state.capacity, state.allocatable) == (8, 8)
    assert {d.id for d in state.devices} == set(gpu_node.uuid.values())
    by_numa = state.by_numa()
    assert set(by_numa) == {0, 1}
    assert [len(by_numa[0]), len(by_numa[1])] == [4, 4]
    for dev_id, uuid in gpu_node.uuid.items():  # NUMA as the profile put it
        assert uuid in by_numa[gpu_node.numa[dev_id]]


def test_unplug_drops_capacity_and_plug_restores_it(gpu_node: GpuNode) -> None:
    with gpu_node.live.client() as client:
        client.unplug("gpu3")
        snap = _wait(gpu_node, "capacity 7", lambda s: s.capacity(GPU) == 7)
        assert snap.allocatable(GPU) == 7
        assert gpu_node.uuid["gpu3"] not in {d.id for d in snap.resources[GPU].devices}
        client.plug("gpu3")
    _wait(gpu_node, "capacity 8 again", lambda s: s.allocatable(GPU) == 8)


def test_aer_fatal_makes_one_gpu_unhealthy_not_gone(gpu_node: GpuNode) -> None:
    with gpu_node.live.client() as client:
        client.health("gpu1", "unhealthy", "aer-fatal")
        snap = _wait(gpu_node, "allocatable 7", lambda s: s.allocatable(GPU) == 7)
        assert snap.capacity(GPU) == 8
        sick = [d.id for d in snap.resources[GPU].devices if d.health == "Unhealthy"]
        assert sick == [gpu_node.uuid["gpu1"]]
        client.health("gpu1", "healthy")
    _wait(gpu_node, "recovery", lambda s: s.allocatable(GPU) == 8)


def test_reregisters_within_two_seconds_of_a_kubelet_restart(gpu_node: GpuNode) -> None:
    gpu_node.dm.restart()
    assert gpu_node.dm.snapshot().capacity(GPU) == 0
    started = time.monotonic()
    snap = gpu_node.dm.wait_registered(GPU, timeout=2)
    assert time.monotonic() - started < 2
    assert (snap.capacity(GPU), snap.allocatable(GPU)) == (8, 8)


def test_single_numa_node_allocation_takes_four_of_one_node(gpu_node: GpuNode) -> None:
    alloc = gpu_node.dm.allocate(GPU, 4, Policy.SINGLE_NUMA_NODE)
    assert len(alloc.device_ids) == 4
    (node,) = alloc.numa_nodes
    expected = {u for d, u in gpu_node.uuid.items() if gpu_node.numa[d] == node}
    assert set(alloc.device_ids) == expected
    assert alloc.affinity == frozenset({node})
    # Device nodes the container gets exist in the tree, one /dev/nvidiaN per GPU.
    paths = [c for c, _, _ in alloc.devices]
    gpus = [p for p in paths if p.removeprefix("/dev/nvidia").isdigit()]
    assert len(gpus) == 4
    for p in paths:
        assert os.path.exists(gpu_node.live.root / p.lstrip("/")), p
    second = gpu_node.dm.allocate(GPU, 4, Policy.SINGLE_NUMA_NODE)
    assert second.numa_nodes == {1 - node}


# the harness as a command ------------------------------------------------------------------


def _read_status(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return data


def _wait_status(path: Path, pred: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        data = _read_status(path)
        if data and pred(data):
            return data
        time.sleep(0.05)
    raise AssertionError(f"status file never showed {what}: {_read_status(path)}")


def _sock_ids(directory: Path) -> set[tuple[str, int, int]]:
    """(name, inode, ctime) of each socket: a re-created socket gets a new entry."""
    out = set()
    for path in directory.glob("*.sock"):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        out.add((path.name, st.st_ino, st.st_ctime_ns))
    return out


def test_kubelet_serve_writes_status_and_restarts_on_sighup() -> None:
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live, short_dir("ks-") as base:
        status = base / "status.json"
        kubelet_dir = base / "dp"
        serve = subprocess.Popen(
            [sys.executable, "-m", "sandbox", "kubelet", "serve", "--dir", str(kubelet_dir),
             "--status-file", str(status), "--numa-nodes", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        plugin = None
        try:
            assert serve.stdout is not None
            assert serve.stdout.readline().strip() == "ready"
            plugin = _start_plugin(live.root, kubelet_dir)
            data = _wait_status(
                status, lambda d: d["resources"].get(GPU, {}).get("allocatable") == 8, "8 GPUs"
            )
            gpu = data["resources"][GPU]
            assert gpu["capacity"] == 8
            assert gpu["connected"] is True
            assert gpu["by_numa"] == {"0": 4, "1": 4}
            assert {d["health"] for d in gpu["devices"]} == {"Healthy"}
            assert sorted(d["numa"] for d in gpu["devices"]) == [[0]] * 4 + [[1]] * 4
            with live.client() as client:
                client.health("gpu5", "unhealthy", "aer-fatal")
            data = _wait_status(
                status, lambda d: d["resources"][GPU]["allocatable"] == 7, "gpu5 unhealthy"
            )
            assert data["resources"][GPU]["by_numa"] == {"0": 4, "1": 3}
            before = _sock_ids(kubelet_dir)
            assert len(before) == 2  # kubelet.sock and the plugin's
            serve.send_signal(signal.SIGHUP)  # kubelet restart: sockets deleted, re-register
            deadline = time.monotonic() + 10
            while len(_sock_ids(kubelet_dir) - before) < 2:  # both sockets made anew
                assert time.monotonic() < deadline, f"no restart: {_sock_ids(kubelet_dir)}"
                time.sleep(0.05)
            data = _wait_status(
                status,
                lambda d: d["resources"].get(GPU, {}).get("connected") is True
                and d["resources"][GPU]["capacity"] == 8,
                "re-registration",
            )
            assert data["resources"][GPU]["allocatable"] == 7
        finally:
            if plugin is not None:
                _stop(plugin)
            serve.terminate()
            _, err = serve.communicate(timeout=10)
        assert serve.returncode == 0, err


# `sandbox kubelet check` -------------------------------------------------------------------


def test_kubelet_check_passes_our_plugin_on_the_live_tree() -> None:
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live:
        fault = (
            f"{sys.executable} -m sandbox fault --socket {live.control} "
            "health gpu-worker gpu2 unhealthy --reason aer-fatal"
        )
        result = subprocess.run(
            [sys.executable, "-m", "sandbox", "kubelet", "check", "--restart-within", "2",
             "--fault", fault, "--",
             *PLUGIN, "--root", str(live.root), "--kubelet-dir", "{kubelet_dir}",
             "--interval", "0.2"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for name in ("registers", "serves-before-register", "registration-accepted", "options",
                 "list-and-watch", "allocate", "health-update", "restart", "still-running"):
        assert any(line.split()[:2] == ["PASS", name] for line in lines), result.stdout
    assert "8 devices, 8 healthy" in result.stdout
    assert "now 7 healthy" in result.stdout
    assert "result: PASSED" in result.stdout


def test_kubelet_check_fails_a_plugin_that_registers_before_serving(tmp_path: Path) -> None:
    script = tmp_path / "broken_plugin.py"
    script.write_text(BROKEN_PLUGIN)
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "kubelet", "check", "--timeout", "5", "--",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:2] == ["PASS", "registers"] for line in lines), result.stdout
    fail = next(line for line in lines if line.split()[:2] == ["FAIL", "serves-before-register"])
    assert "serve first, then Register" in fail
    assert any(line.split()[:2] == ["FAIL", "registration-accepted"] for line in lines)
    assert "Register failed: failed to dial device plugin" in result.stdout  # plugin output
    assert "result: FAILED" in result.stdout


def test_kubelet_check_needs_a_plugin_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "kubelet", "check"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == "error: kubelet check: give the plugin command after --"


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--numa-nodes", "0"], "error: --numa-nodes: expected at least 1")],
)
def test_kubelet_serve_rejects_bad_flags(argv: list[str], message: str) -> None:
    with short_dir("ks-") as base:
        result = subprocess.run(
            [sys.executable, "-m", "sandbox", "kubelet", "serve", "--dir", str(base), *argv],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == message

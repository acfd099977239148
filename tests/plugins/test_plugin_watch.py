"""The reference device plugin following a live tree's change events (``--watch``).

profiles/8gpu-2numa.yaml's gpu-worker is mounted over FUSE; faults go through its control
socket as `sandbox fault` sends them. With a rescan period of an hour, a fault can only
reach the kubelet harness because the change event made the plugin rescan; the facts it
reports still come from the tree (the UUIDs are the driver file's). Without a reachable
socket the plugin polls as before.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandbox.kubelet import DeviceManager
from tests.support.thirdparty import LiveNode, live_node, short_dir

pytestmark = [pytest.mark.root, pytest.mark.fuse]

GPU = "nvidia.com/gpu"
HOUR = "3600"


@contextmanager
def _plugin(live: LiveNode, *flags: str) -> Iterator[tuple[DeviceManager, list[str]]]:
    """The plugin on ``live`` with ``flags``; yields the harness and, after exit, its log."""
    log: list[str] = []
    with short_dir("kw-") as sockdir, DeviceManager(sockdir, numa_nodes=[0, 1]) as dm:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hwplugins.deviceplugin", "--root", str(live.root),
             "--kubelet-dir", str(dm.directory), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            dm.wait_registered(GPU, timeout=15)
            dm.wait_for(lambda s: s.allocatable(GPU) == 8, 10, "8 GPUs")
            yield dm, log
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=15)
            log.extend(out.decode(errors="replace").splitlines())
            assert proc.returncode == 0, "\n".join(log)


def _flip(live: LiveNode, dm: DeviceManager) -> None:
    with live.client() as client:
        client.health("gpu2", "unhealthy", "aer-fatal")
        snap = dm.wait_for(lambda s: s.allocatable(GPU) == 7, 10, "allocatable 7")
        assert snap.capacity(GPU) == 8
        client.unplug("gpu5")
        dm.wait_for(lambda s: s.capacity(GPU) == 7, 10, "capacity 7")
        client.health("gpu2", "healthy")
        client.plug("gpu5")
    dm.wait_for(lambda s: s.allocatable(GPU) == 8, 10, "all 8 back")


def test_change_events_trigger_the_rescan() -> None:
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live:
        with _plugin(live, "--interval", HOUR, "--watch", str(live.control)) as (dm, log):
            _flip(live, dm)
    assert any("following change events on" in line for line in log), "\n".join(log)


def test_unreachable_socket_falls_back_to_polling(tmp_path: Path) -> None:
    missing = tmp_path / "no-such.sock"
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live:
        with _plugin(live, "--interval", "0.2", "--watch", str(missing)) as (dm, log):
            _flip(live, dm)
    assert any(f"no watch on {missing}" in line for line in log), "\n".join(log)


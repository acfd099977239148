"""The picture of a running sandbox shows what `status -o json` says, after faults.

Through the installed console script, as a user types it, with the local runtime: up, faults,
``status -o svg|png|json``, down. The numbers drawn (capacity and allocatable of every
resource on every node), each device's health and each SR-IOV device's VF count must be
the live ones; the VF counts are also read back from the node's mounted /sys.
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_draw_layout import SVG, check_layout, png_size, smallest_text
from tests.support import cli
from tests.support.cli import state_roots
from tests.support.fakehw_toy import require_fuse

pytestmark = [pytest.mark.root, pytest.mark.fuse]


def sandbox(state_root: Path, *args: str) -> Any:
    """The console script with HWSANDBOX_STATE_DIR=state_root and no kind on PATH."""
    env = cli._env(state_root)
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if not (Path(p) / "kind").exists())
    return cli.sandbox(*args, env=env)


@pytest.fixture
def state_root() -> Iterator[Path]:
    yield from state_roots()


def _json(root: Path) -> dict[str, Any]:
    result = sandbox(root, "status", "-o", "json")
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def _wait(root: Path, node: str, resource: str, capacity: int, allocatable: int) -> None:
    deadline = time.monotonic() + 15
    while True:
        [n] = [n for n in _json(root)["nodes"] if n["name"] == node]
        got = {r["resource"]: (r["capacity"], r["allocatable"]) for r in n["resources"]}
        if got.get(resource) == (capacity, allocatable):
            return
        assert time.monotonic() < deadline, f"{node} still advertises {got}"
        time.sleep(0.2)


def _picture(root: Path) -> tuple[str, ET.Element]:
    result = sandbox(root, "status", "-o", "svg")
    assert result.returncode == 0, result.stderr
    return result.stdout, ET.fromstring(result.stdout)


def _same_as_status(picture: ET.Element, status: dict[str, Any]) -> None:
    """Per node: the resources drawn (their visible numbers too) and every device's health
    are those of ``status -o json``."""
    nodes = {g.get("data-node"): g for g in picture.iter(f"{SVG}g") if g.get("class") == "node"}
    assert set(nodes) == {n["name"] for n in status["nodes"]}
    for node in status["nodes"]:
        group = nodes[node["name"]]
        drawn = {}
        for g in group.iter(f"{SVG}g"):
            if g.get("class") == "resource":
                texts = [t.text for t in g.iter(f"{SVG}text")]
                assert texts[:3] == [g.get("data-resource"), g.get("data-capacity"),
                                     g.get("data-allocatable")]
                drawn[texts[0]] = (int(texts[1] or ""), int(texts[2] or ""))
        assert drawn == {r["resource"]: (r["capacity"], r["allocatable"])
                         for r in node["resources"]}, node["name"]
        health = {g.get("data-device"): g.get("data-health") for g in group.iter(f"{SVG}g")
                  if g.get("class") == "device"}
        assert health == {d["id"]: d["health"] for d in node["devices"]}, node["name"]
        texts = [t.text for t in group.iter(f"{SVG}text")]
        assert ("Ready" if node["ready"] else "NotReady") in texts


def test_8gpu_picture_shows_capacity_7_allocatable_6(state_root: Path) -> None:
    require_fuse()
    up = sandbox(state_root, "up", "profiles/8gpu-2numa.yaml", "--runtime", "local")
    assert up.returncode == 0, up.stderr
    for fault in (("health", "gpu-worker", "gpu1", "unhealthy"),
                  ("unplug", "gpu-worker", "gpu6")):
        result = sandbox(state_root, "fault", *fault)
        assert result.returncode == 0, result.stderr
    _wait(state_root, "gpu-worker", "nvidia.com/gpu", 7, 6)

    svg, picture = _picture(state_root)
    status = _json(state_root)
    _same_as_status(picture, status)
    [gpus] = [g for g in picture.iter(f"{SVG}g") if g.get("data-resource") == "nvidia.com/gpu"]
    assert (gpus.get("data-capacity"), gpus.get("data-allocatable")) == ("7", "6")
    assert gpus.get("data-healthy") == "0:3,1:3"
    devices = {g.get("data-device"): g for g in picture.iter(f"{SVG}g")
               if g.get("class") == "device"}
    assert "unhealthy (aer-fatal)" in [t.text for t in devices["gpu1"].iter(f"{SVG}text")]
    assert "unplugged" in [t.text for t in devices["gpu6"].iter(f"{SVG}text")]
    check_layout(svg)

    png = state_root / "8gpu.png"
    result = sandbox(state_root, "status", "-o", "png", "--file", str(png))
    assert result.returncode == 0, result.stderr
    assert png_size(png.read_bytes()) == (1920, 1080)  # the default: fills a 1080p screen
    assert smallest_text(svg) >= 13
    result = sandbox(state_root, "status", "-o", "png", "--scale", "1", "--file", str(png),
                     "--force")
    assert result.returncode == 0, result.stderr
    _, _, width, height = picture.get("viewBox", "").split()
    assert png_size(png.read_bytes()) == (int(width), int(height))
    bad = sandbox(state_root, "status", "-o", "png", "--scale", "0", "--file", str(png))
    assert bad.returncode == 2
    assert "--scale: '0': expected a number from 0.1 to 10" in bad.stderr

    assert sandbox(state_root, "down").returncode == 0


def test_multi_node_picture_is_16_9_with_live_vf_counts(state_root: Path) -> None:
    require_fuse()
    up = sandbox(state_root, "up", "profiles/workshop-mixed.yaml", "--runtime", "local")
    assert up.returncode == 0, up.stderr
    _, picture = _picture(state_root)
    [nic] = [g for g in picture.iter(f"{SVG}g") if g.get("data-device") == "nic0"]
    assert nic.get("data-vfs") == "2,2"  # the profile's numVFs on both ports
    for args in (("net-worker", "nic0", "5"), ("--port", "1", "net-worker", "nic0", "3")):
        result = sandbox(state_root, "fault", "set-vfs", *args)
        assert result.returncode == 0, result.stderr
    _wait(state_root, "net-worker", "sandbox.io/sriov-vf", 8, 8)
    result = sandbox(state_root, "fault", "unplug", "gpu-worker-1", "gpu0")
    assert result.returncode == 0, result.stderr
    _wait(state_root, "gpu-worker-1", "nvidia.com/gpu", 4, 3)

    svg, picture = _picture(state_root)
    _same_as_status(picture, _json(state_root))
    check_layout(svg)
    _, _, width, height = map(float, picture.get("viewBox", "").split())
    assert width * 9 == height * 16
    [nic] = [g for g in picture.iter(f"{SVG}g") if g.get("data-device") == "nic0"]
    assert nic.get("data-vfs") == "5,3"
    assert "2x10G ethernet, VFs per port 5/8, 3/8" in [t.text for t in nic.iter(f"{SVG}text")]
    # what the node's /sys says, read through its FUSE mount
    record = json.loads((state_root / "workshop-mixed" / "sandbox.json").read_text())
    sys_root = Path(record["nodes"]["net-worker"]["root"]) / "sys" / "bus" / "pci" / "devices"
    pfs = sorted(p for p in sys_root.iterdir() if (p / "sriov_numvfs").exists())
    assert [int((p / "sriov_numvfs").read_text()) for p in pfs] == [5, 3]

    assert sandbox(state_root, "down").returncode == 0


def test_picture_is_of_the_spec_the_sandbox_came_up_with(state_root: Path) -> None:
    """`status` reads the resolved spec the runtime wrote (state/spec.json), not the profile
    again: after the profile file changed (here: another node, then not a profile at all)
    the picture still shows the node the sandbox runs, and the table matches it."""
    require_fuse()
    profile = state_root.parent / f"{state_root.name}-profile.yaml"
    profile.write_text((cli.REPO / "profiles" / "mig-single.yaml").read_text())
    try:
        up = sandbox(state_root, "up", str(profile), "--runtime", "local")
        assert up.returncode == 0, up.stderr
        profile.write_text(profile.read_text().replace("mig-worker", "renamed-worker"))
        _, picture = _picture(state_root)
        _same_as_status(picture, _json(state_root))
        nodes = [g.get("data-node") for g in picture.iter(f"{SVG}g") if g.get("class") == "node"]
        assert nodes == ["mig-worker"]
        profile.write_text("kind: not-a-profile\n")
        _, picture = _picture(state_root)
        _same_as_status(picture, _json(state_root))
        table = sandbox(state_root, "status")
        assert table.returncode == 0, table.stderr
        assert "note:" not in table.stderr
        assert sandbox(state_root, "down").returncode == 0
    finally:
        profile.unlink(missing_ok=True)

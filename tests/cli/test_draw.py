"""The workshop picture: every profile draws, NUMA groups hold their devices, PNG renders."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sandbox.draw import DeviceView, svg_to_png, topology_svg
from sandbox.profile import load_profile
from tests.support.paths import REPO as ROOT

SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize("profile", sorted((ROOT / "profiles").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_every_device_is_drawn_under_its_numa_node(profile: Path) -> None:
    cluster = load_profile(profile).cluster
    picture = ET.fromstring(topology_svg(cluster.nodes))
    for node in cluster.nodes:
        group = picture.find(f".//{SVG}g[@data-node='{node.name}']")
        assert group is not None
        for numa in node.numa:
            box = group.find(f".//{SVG}g[@class='numa'][@data-numa='{numa.id}']")
            assert box is not None
            drawn = [g.get("data-device") for g in box.iter(f"{SVG}g") if g.get("data-device")]
            assert drawn == [d.id for d in node.devices if d.numa_node == numa.id]


def test_png_of_8gpu_with_faults() -> None:
    cluster = load_profile(ROOT / "profiles" / "8gpu-2numa.yaml").cluster
    views = {"gpu-worker": {"gpu2": DeviceView("unhealthy", "aer-fatal"),
                            "gpu5": DeviceView("unplugged"),
                            "gpu0": DeviceView(allocated_to="default/train")}}
    png = svg_to_png(topology_svg(cluster.nodes, views, title="8gpu-2numa"))
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 10_000

"""The claims picture (``sandbox dra claims -o svg|png``) from the driver's own slices.

The slices are what the reference DRA driver builds for a shipped profile
(``sandbox.draconfig.node_slices``: its discovery and slice code on the rendered tree); the
claims are allocation results as the scheduler writes them. What the API objects say on a
real cluster, and that the picture shows it: tests/plugins/dra/test_claims_view.py.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from decimal import Decimal
from typing import Any

from sandbox.draclaims import Allocated, Left, Usage, quantity, usage
from sandbox.draconfig import node_slices
from sandbox.draw import claims_svg, svg_to_png
from sandbox.profile import load_profile
from tests.cli.test_draw_layout import check_layout, png_size
from tests.support.paths import REPO as ROOT

SVG = "{http://www.w3.org/2000/svg}"
DRIVER = "dra.hwsandbox.dev"


def _claim(name: str, pod: str | None, pool: str, device: str,
           bandwidth: str | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "r", "driver": DRIVER, "pool": pool, "device": device}
    if bandwidth:
        result["consumedCapacity"] = {"bandwidth": bandwidth}
    return {"metadata": {"namespace": "default", "name": name},
            "status": {"reservedFor": [{"name": pod}] if pod else [],
                       "allocation": {"devices": {"results": [result]}}}}  # fmt: skip


def _texts(group: ET.Element) -> list[str]:
    return [t.text or "" for t in group.iter(f"{SVG}text")]


def test_claims_picture_shows_holders_and_what_is_left() -> None:
    gpus = load_profile(ROOT / "profiles" / "mig-partitions.yaml").cluster.nodes[0]
    nics = load_profile(ROOT / "profiles" / "sriov-rdma.yaml").cluster.nodes[0]
    slices = node_slices(gpus) + node_slices(nics, skip_node_operations=["vf"])
    devices = {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}
    whole, other, *free = sorted(n for n, d in devices.items()
                                 if d["attributes"]["type"] == {"string": "gpu"})
    part = next(n for n in sorted(devices) if n.startswith(f"{other}-1g-10gb-"))
    nic = next(n for n in sorted(devices) if devices[n].get("allowMultipleAllocations"))
    vf = next(n for n in sorted(devices) if n.startswith("vf-"))
    claims = [_claim("train", "train-0", gpus.name, whole),
              _claim("mig", "infer-0", gpus.name, part),
              _claim("waiting", None, gpus.name, f"{other}-1g-10gb-1"),
              _claim("bw-a", "bw-a", nics.name, nic, "30G"),
              _claim("bw-b", "bw-b", nics.name, nic, "20G"),
              _claim("cp-vf", "cp-vf", nics.name, vf)]
    use = usage(slices, claims)
    svg = claims_svg(use, title="DRA claims")
    check_layout(svg)
    picture = ET.fromstring(svg)

    drawn = {(g.get("data-claim"), g.get("data-pod"), g.get("data-device")): g
             for g in picture.iter(f"{SVG}g") if g.get("class") == "claim"}
    assert set(drawn) == {(a.claim, ",".join(a.pods), a.device) for a in use.allocated}
    assert len(drawn) == len(claims)
    for (claim, pod, device), g in drawn.items():
        text = " ".join(_texts(g))
        assert claim in text
        assert device in text
        assert (f"pod {pod}" if pod else "reserved for no pod") in text

    cards = {g.get("data-owner"): g for g in picture.iter(f"{SVG}g") if g.get("class") == "card"}
    # every GPU's counter set and every NIC's bandwidth: a card, used or not
    assert {whole, other, *free, nic} <= set(cards)
    holders = {owner: {g.get("data-claim") for g in card.iter(f"{SVG}g")
                       if g.get("class") == "claim"} for owner, card in cards.items()}
    assert holders[whole] == {"default/train"}
    assert holders[other] == {"default/mig", "default/waiting"}
    assert all(holders[f] == set() for f in free)
    assert holders[nic] == {"default/bw-a", "default/bw-b"}
    assert holders["devices allocated whole"] == {"default/cp-vf"}  # a VF: no counters

    lefts = {(g.get("data-owner"), g.get("data-name")): g
             for g in picture.iter(f"{SVG}g") if g.get("class") == "left"}
    assert len(lefts) == len(use.counters) + len(use.capacity)
    for r in (*use.counters, *use.capacity):
        g = lefts[(r.owner, r.name)]
        assert g.get("data-left") == quantity(r.total - r.used)
        assert f"left {quantity(r.total - r.used)}" in _texts(g)
    assert lefts[(whole, "memory-slices")].get("data-left") == "0"  # a whole GPU takes all
    assert lefts[(other, "memory-slices")].get("data-used") == "2"  # two 1g.10gb
    assert lefts[(nic, "bandwidth")].get("data-used") == "50G"

    png = svg_to_png(claims_svg(use))
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert png_size(svg_to_png(claims_svg(use, scale=1.5)))[0] == 1350  # 900 wide at 1


def test_long_names_stay_apart_and_inside_their_cards() -> None:
    long = "inference-server-with-a-rather-long-deployment-name-7d9f8c6b5-x2x4z"
    owner = f"gpu-{long}-counter-set"
    use = Usage(
        allocated=tuple(Allocated(f"default/{long}-claim-{i}", (f"default/{long}-{i}",),
                                  f"request-{long}", DRIVER, f"node-{long}", f"{owner}-{i}",
                                  (("memory", "1000000Gi"), (f"counter-{long}", "12345")),
                                  (owner,)) for i in range(3)),
        counters=(Left(f"node-{long}", owner, f"counter-{long}", Decimal(10**12),
                       Decimal(10**12 - 1)),
                  Left(f"node-{long}", owner, "memory", Decimal(2**60), Decimal(0))),
        capacity=())
    svg = claims_svg(use, title=f"DRA claims: sandbox {long}")
    check_layout(svg)
    picture = ET.fromstring(svg)
    assert {g.get("data-pod") for g in picture.iter(f"{SVG}g") if g.get("class") == "claim"
            } == {f"default/{long}-{i}" for i in range(3)}
    assert [g.get("data-owner") for g in picture.iter(f"{SVG}g")
            if g.get("class") == "card"] == [owner]


def test_an_empty_cluster_draws_a_note() -> None:
    svg = claims_svg(usage([], []))
    check_layout(svg)
    picture = ET.fromstring(svg)
    assert "no ResourceSlices and no allocated claims" in _texts(picture)

"""The topology picture is a slide: 16:9, readable at 1080p, no label on another.

Text boxes are computed here, independently of ``sandbox.draw``: each ``<text>``'s width
from the advance widths in the DejaVu Sans font files librsvg draws with (parsed below,
every glyph of the text; kerning only narrows), its height from the font's ascent and
descent, placed by its x, y, text-anchor and the translations of its groups. That these
boxes hold what librsvg really draws is checked on a real rendering
(``test_text_boxes_hold_the_rendered_ink``).
"""

from __future__ import annotations

import re
import shutil
import struct
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import combinations
from pathlib import Path

import pytest

from sandbox.draw import DeviceView, NodeView, ResourceView, svg_to_png, topology_svg
from sandbox.profile import load_profile
from sandbox.profile.spec import NodeSpec
from tests.support.paths import REPO as ROOT

SVG = "{http://www.w3.org/2000/svg}"
FONTS = Path("/usr/share/fonts/truetype/dejavu")
SLACK = 1.03  # glyph positions rounded to pixels; kerning only narrows a text


@dataclass(frozen=True)
class Font:
    upm: int
    ascent: float  # of the font size
    descent: float
    advance: dict[str, int]  # character -> advance width in font units


@cache
def font(bold: bool) -> Font:
    """The advance widths (cmap format 4 + hmtx), ascent and descent (hhea) of DejaVu Sans."""
    path = FONTS / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf")
    if not path.exists():
        pytest.fail(f"{path} is missing: apt-get install fonts-dejavu-core", pytrace=False)
    data = path.read_bytes()
    tables = {}
    for i in range(struct.unpack(">H", data[4:6])[0]):
        tag, _, offset, _ = struct.unpack(">4sIII", data[12 + 16 * i:28 + 16 * i])
        tables[tag.decode()] = offset
    upm = struct.unpack(">H", data[tables["head"] + 18:tables["head"] + 20])[0]
    hhea = tables["hhea"]
    ascent, descent = struct.unpack(">hh", data[hhea + 4:hhea + 8])
    metrics = struct.unpack(">H", data[hhea + 34:hhea + 36])[0]
    hmtx = tables["hmtx"]
    widths = [struct.unpack(">H", data[hmtx + 4 * g:hmtx + 4 * g + 2])[0]
              for g in range(metrics)]
    cmap = tables["cmap"]
    advance = {}
    for i in range(struct.unpack(">H", data[cmap + 2:cmap + 4])[0]):
        platform, encoding, offset = struct.unpack(">HHI", data[cmap + 4 + 8 * i:cmap + 12 + 8 * i])
        sub = cmap + offset
        if (platform, encoding) != (3, 1) or struct.unpack(">H", data[sub:sub + 2])[0] != 4:
            continue
        n2 = struct.unpack(">H", data[sub + 6:sub + 8])[0]
        n = n2 // 2
        ends = struct.unpack(f">{n}H", data[sub + 14:sub + 14 + n2])
        starts = struct.unpack(f">{n}H", data[sub + 16 + n2:sub + 16 + 2 * n2])
        deltas = struct.unpack(f">{n}h", data[sub + 16 + 2 * n2:sub + 16 + 3 * n2])
        ranges_at = sub + 16 + 3 * n2
        ranges = struct.unpack(f">{n}H", data[ranges_at:ranges_at + n2])
        for k in range(n):
            for c in range(starts[k], min(ends[k], 0x3000) + 1):
                if ranges[k]:
                    at = ranges_at + 2 * k + ranges[k] + 2 * (c - starts[k])
                    glyph = struct.unpack(">H", data[at:at + 2])[0]
                    glyph = (glyph + deltas[k]) & 0xFFFF if glyph else 0
                else:
                    glyph = (c + deltas[k]) & 0xFFFF
                if glyph:
                    advance[chr(c)] = widths[min(glyph, metrics - 1)]
    return Font(upm, ascent / upm, -descent / upm, advance)


@dataclass(frozen=True)
class Box:
    x0: float
    y0: float
    x1: float
    y1: float
    what: str

    def meets(self, other: Box) -> bool:
        return (self.x0 < other.x1 and other.x0 < self.x1
                and self.y0 < other.y1 and other.y0 < self.y1)

    def holds(self, other: Box) -> bool:
        return (self.x0 <= other.x0 and other.x1 <= self.x1
                and self.y0 <= other.y0 and other.y1 <= self.y1)


def text_box(t: ET.Element, dx: float = 0, dy: float = 0) -> Box:
    """Where ``t`` is drawn, at most (SVG collapses runs of spaces)."""
    s = " ".join((t.text or "").split())
    size = float(t.get("font-size", "0"))
    f = font(t.get("font-weight") == "bold")
    missing = set(s) - set(f.advance)
    assert not missing, f"{s!r}: no glyph for {missing} in DejaVu Sans"
    width = sum(f.advance[c] for c in s) * size / f.upm * SLACK + 1
    x, y = float(t.get("x", "0")) + dx, float(t.get("y", "0")) + dy
    x0 = {"start": x, "middle": x - width / 2, "end": x - width}[t.get("text-anchor", "start")]
    return Box(x0, y - f.ascent * size, x0 + width, y + f.descent * size, s)


def _translate(g: ET.Element) -> tuple[float, float]:
    m = re.fullmatch(r"translate\(([-\d.]+),\s*([-\d.]+)\)", g.get("transform", "translate(0,0)"))
    assert m, g.get("transform")
    return float(m[1]), float(m[2])


def layout(svg: str) -> tuple[list[Box], list[tuple[Box, list[Box]]]]:
    """Every text's box, and every box rectangle (``rect.box``) with the texts its group
    holds."""
    texts: list[Box] = []
    boxes: list[tuple[Box, list[Box]]] = []

    def walk(el: ET.Element, dx: float, dy: float) -> Iterator[Box]:
        if el.tag == f"{SVG}text":
            box = text_box(el, dx, dy)
            texts.append(box)
            yield box
            return
        if el.tag == f"{SVG}g":
            tx, ty = _translate(el)
            dx, dy = dx + tx, dy + ty
        rect = next((r for r in el if r.tag == f"{SVG}rect" and r.get("class") == "box"), None)
        held = [b for child in el for b in walk(child, dx, dy)]
        if rect is not None:
            x, y = float(rect.get("x", "0")) + dx, float(rect.get("y", "0")) + dy
            box = Box(x, y, x + float(rect.get("width", "0")), y + float(rect.get("height", "0")),
                      el.get("data-device") or el.get("data-numa") or el.get("class") or "")
            boxes.append((box, held))
        yield from held

    list(walk(ET.fromstring(svg), 0, 0))
    return texts, boxes


def check_layout(svg: str) -> None:
    """No two texts meet; each text is inside every box of its groups and in the frame; two
    boxes are apart or one holds the other."""
    root = ET.fromstring(svg)
    _, _, w, h = map(float, root.get("viewBox", "").split())
    frame = Box(0, 0, w, h, "frame")
    texts, boxes = layout(svg)
    assert texts
    meeting = [(a.what, b.what) for a, b in combinations(texts, 2) if a.meets(b)]
    assert not meeting, f"texts that meet: {meeting}"
    outside = [t.what for t in texts if not frame.holds(t)]
    assert not outside, f"texts outside the picture: {outside}"
    for box, held in boxes:
        out = [t.what for t in held if not box.holds(t)]
        assert not out, f"texts outside their box {box.what}: {out}"
    crossing = [(a.what, b.what) for (a, _), (b, _) in combinations(boxes, 2)
                if a.meets(b) and not a.holds(b) and not b.holds(a)]
    assert not crossing, f"boxes that cross: {crossing}"


def png_size(png: bytes) -> tuple[int, int]:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def smallest_text(svg: str) -> float:
    return min(float(t.get("font-size", "0")) for t in ET.fromstring(svg).iter(f"{SVG}text"))


def pixels_per_unit(svg: str) -> float:
    root = ET.fromstring(svg)
    return float(root.get("width", "0")) / float(root.get("viewBox", "").split()[2])


def _profile(name: str) -> list[NodeSpec]:
    return list(load_profile(ROOT / "profiles" / f"{name}.yaml").cluster.nodes)


def _need_rsvg() -> None:
    if shutil.which("rsvg-convert") is None:
        pytest.fail("PNG tests need rsvg-convert: apt-get install librsvg2-bin", pytrace=False)


@pytest.mark.parametrize(("profile", "nodes"), [("8gpu-2numa", 1), ("workshop-mixed", 4)])
def test_png_at_the_default_scale_is_a_readable_16_9_slide(profile: str, nodes: int) -> None:
    _need_rsvg()
    cluster = _profile(profile)
    assert len(cluster) == nodes
    svg = topology_svg(cluster, title=profile)
    check_layout(svg)
    png = svg_to_png(svg)
    width, height = png_size(png)
    assert (width, height) == (1920, 1080)  # 16:9, filling a 1080p screen
    root = ET.fromstring(svg)
    _, _, vw, vh = map(float, root.get("viewBox", "").split())
    assert vw * 9 == vh * 16  # the frame itself is exactly 16:9
    assert pixels_per_unit(svg) >= 1
    assert smallest_text(svg) >= 13  # px at scale 1
    assert smallest_text(svg) * width / vw >= 12  # px in the PNG


def test_scale_sets_the_size_and_never_the_layout() -> None:
    _need_rsvg()
    cluster = _profile("workshop-mixed")
    one, two = topology_svg(cluster, scale=1), topology_svg(cluster, scale=2)
    w1, h1 = png_size(svg_to_png(one))
    w2, h2 = png_size(svg_to_png(two))
    assert w1 * 9 == h1 * 16
    assert (w2, h2) == (2 * w1, 2 * h1)
    assert re.sub(r' width="\d+" height="\d+"', "", one) == re.sub(
        r' width="\d+" height="\d+"', "", two)


def _faulted(cluster: list[NodeSpec]
             ) -> tuple[dict[str, dict[str, DeviceView]], dict[str, NodeView]]:
    """Every kind of label a device can carry, on every device: the longest ones meet."""
    looks = [DeviceView("unhealthy", "port-down", "default/net-test-with-a-long-name/main",
                        pod_unhealthy="default/net-test-with-a-long-name"),
             DeviceView("unplugged"), DeviceView("unknown"),
             DeviceView("unhealthy", "aer-fatal", num_vfs=3, port_vfs=((1, 7),)),
             DeviceView(allocated_to="default/train/main, default/infer/main")]
    views = {n.name: {d.id: looks[i % len(looks)] for i, d in enumerate(n.devices)}
             for n in cluster}
    live = {n.name: NodeView(i % 2 == 0, tuple(
        ResourceView(f"example.com/{d.kind}-{i}", 8, 7, {k.id: 3 for k in n.numa})
        for i, d in enumerate(n.devices[:3])),
        ("kubelet harness down: its last advertised resources are not shown",) if i % 2 else ())
        for i, n in enumerate(cluster)}
    return views, live


@pytest.mark.parametrize("profile", sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml")))
def test_no_label_meets_another_in_any_profile(profile: str) -> None:
    cluster = _profile(profile)
    check_layout(topology_svg(cluster, title=profile))
    views, live = _faulted(cluster)
    cpus = {n.name: {c.id: "default/train/main" for c in n.cpus[:4]} for n in cluster}
    svg = topology_svg(cluster, views, title=f"{profile} (local)", cpus=cpus, live=live)
    check_layout(svg)
    _, _, w, h = map(float, ET.fromstring(svg).get("viewBox", "").split())
    assert w * 9 == h * 16


def _ink(png: bytes) -> list[bytes]:
    """The rows of an 8-bit RGB or RGBA PNG, unfiltered: each pixel's red (text is black)."""
    width, height = png_size(png)
    depth, colour, interlace = png[24], png[25], png[28]
    assert (depth, interlace) == (8, 0)
    assert colour in (2, 6)
    channels = 3 if colour == 2 else 4
    data, at = b"", 8
    while at < len(png):
        length, kind = struct.unpack(">I4s", png[at:at + 8])
        if kind == b"IDAT":
            data += png[at + 8:at + 8 + length]
        at += 12 + length
    raw = zlib.decompress(data)
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line[k] for k in range(0, stride, channels)))  # red is enough
        prev = line
    return rows


def test_text_boxes_hold_the_rendered_ink() -> None:
    """The widest labels of real pictures, drawn by librsvg one per band: the ink of each
    stays inside the box the checks above compute for it."""
    _need_rsvg()
    views, live = _faulted(_profile("workshop-mixed"))
    samples: dict[tuple[str, str], ET.Element] = {}
    for svg in (topology_svg(_profile("8gpu-2numa"), title="8gpu-2numa"),
                topology_svg(_profile("workshop-mixed"), views, title="x", live=live)):
        for t in ET.fromstring(svg).iter(f"{SVG}text"):
            key = (t.get("font-size", ""), t.get("font-weight", ""))
            if key not in samples or len(t.text or "") > len(samples[key].text or ""):
                samples[key] = t
    parts, bands, y, width = [], [], 0.0, 0.0
    for sample in samples.values():
        size = float(sample.get("font-size", "0"))
        y += 2 * size
        t = ET.Element("text", {"x": "20", "y": f"{y:.0f}", "font-size": f"{size:g}",
                                "font-weight": sample.get("font-weight", "normal"),
                                "font-family": sample.get("font-family", "")})
        t.text = sample.text
        parts.append(ET.tostring(t, encoding="unicode"))
        box = text_box(t)
        bands.append((box, y - 2 * size + 1, y + size))
        width = max(width, box.x1 + 20)
        y += size
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y + 10:.0f}">'
           '<rect width="100%" height="100%" fill="#ffffff"/>' + "".join(parts) + "</svg>")
    rows = _ink(svg_to_png(svg))
    for box, top, bottom in bands:
        inked = [(x, yy) for yy in range(int(top), min(int(bottom), len(rows)))
                 for x, v in enumerate(rows[yy]) if v < 200]
        assert inked, box.what
        xs, ys = [x for x, _ in inked], [yy for _, yy in inked]
        # pixel (x, y) covers [x, x + 1) x [y, y + 1): each inked one must touch the box
        assert box.x0 < min(xs) + 1, (box, min(xs))
        assert max(xs) < box.x1, (box, max(xs))
        assert box.y0 < min(ys) + 1, (box, min(ys))
        assert max(ys) < box.y1, (box, max(ys))

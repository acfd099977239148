"""Topology pictures for workshops: nodes, NUMA nodes, CPUs, PCI tree, devices, health,
allocations, and what each node's kubelet advertises.

``topology_svg(nodes, views, live=..., cpus=held)`` returns a standalone SVG document (no
external fonts or scripts): per node its Ready state and a table of the extended
resources its kubelet advertises (capacity, allocatable, healthy per NUMA node), per NUMA
node its CPUs (held exclusively by a container: orange) and devices with their live
health, reason, holder and SR-IOV VF count. ``claims_svg(usage)`` draws ``sandbox dra
claims``: which pod's claim holds which partition or NIC share, and what is left of each
GPU's counters and NIC's capacity. ``svg_to_png`` rasterises either with ``rsvg-convert``
(Debian: librsvg2-bin).

Made for a projector: the topology is a 16:9 frame (a slide) with the nodes packed in rows
in the profile's order, the row breaks chosen so that the frame shows them largest; user
units are pixels at scale 1, where no text is smaller than 13 px (12 px in the claims
picture); ``scale`` (``--scale``) sets the output size, by default as large as fits
1920x1080 and never below 1. Texts are placed from their measured widths (DejaVu Sans,
the font fonts-dejavu-core gives librsvg), so no two meet and each stays inside its box;
one too long for the widest box is cut with "…".
Each drawn device carries ``data-device``/``data-numa``/``data-health`` (``data-vfs``:
VFs per physical function), each advertised resource ``data-resource``/
``data-capacity``/``data-allocatable`` (a held CPU ``data-cpu``/``data-held``), so
tests and tools can check what the picture shows without parsing its geometry.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

from sandbox.commands import run
from sandbox.errors import SandboxError
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.spec import DeviceSpec, NodeSpec
from sandbox.textui import size

if TYPE_CHECKING:  # sandbox.dra imports the DRA driver: only `sandbox dra claims` needs it
    from sandbox.dra import Allocated, Left, Usage

FONT = "DejaVu Sans, Verdana, sans-serif"
COLORS = {
    "healthy": ("#e8f5e9", "#2e7d32"),
    "unhealthy": ("#ffebee", "#c62828"),
    "unplugged": ("#f5f5f5", "#9e9e9e"),
    "unknown": ("#fffde7", "#6d4c41"),  # its node's fake hardware server did not answer
}
HELD = "#ef6c00"  # a CPU a container holds exclusively
IN_USE = "#e65100"  # "in use by": a device a container holds
INK, GREY = "#212121", "#455a64"
KIND_ICON = {"gpu": "GPU", "nic": "NIC", "fpga": "FPGA", "nvme": "NVMe", "generic": "PCI"}
FRAME = (1920, 1080)  # what the default scale fills: a 1080p screen

# Text sizes in px at scale 1; 13 px is the smallest (secondary text).
T_TITLE, T_NODE, T_NUMA, T_ID, T_BODY, T_SMALL = 24, 20, 17, 15, 14, 13
PAD = 16  # from a box's border to what it holds
GAP = 10  # between two texts on one line
LEAD = 5  # between two lines of text
CELL = 14  # a CPU square and the gap after it
NUMA_MIN_W = 340
NUMA_GAP = 56  # between two NUMA boxes: their distance is drawn there
NODE_GAP = 24
MARGIN = 24  # around the drawing, inside the frame
DEV_INDENT = 30  # device boxes hang off the PCI spine
DEV_GAP = 8
DEV_MAX_W = 560
DISC = 28  # room kept at the right of a device's first line for the "!" mark

# -- text metrics: what librsvg will draw, measured before it does

# Advance widths of DejaVu Sans in thousandths of an em (rounded up), ASCII 32..126;
# anything else counts as a whole em (wider than any glyph a label here uses).
_REGULAR = (
    318, 401, 460, 838, 637, 951, 780, 275, 391, 391, 500, 838, 318, 361, 318, 337, 637,
    637, 637, 637, 637, 637, 637, 637, 637, 637, 337, 337, 838, 838, 838, 531, 1000, 685,
    687, 699, 771, 632, 576, 775, 752, 295, 295, 656, 558, 863, 749, 788, 604, 788, 695,
    635, 611, 732, 685, 989, 686, 611, 686, 391, 337, 391, 838, 500, 500, 613, 635, 550,
    635, 616, 353, 635, 634, 278, 278, 580, 278, 975, 634, 612, 635, 635, 412, 521, 393,
    634, 592, 818, 592, 592, 525, 637, 337, 637, 838,
)
_BOLD = (
    349, 457, 521, 838, 696, 1002, 873, 307, 458, 458, 523, 838, 380, 416, 380, 366, 696,
    696, 696, 696, 696, 696, 696, 696, 696, 696, 400, 400, 838, 838, 838, 581, 1000, 774,
    763, 734, 831, 684, 684, 821, 837, 373, 373, 775, 638, 996, 837, 851, 733, 851, 771,
    721, 683, 813, 774, 1104, 771, 725, 726, 458, 366, 458, 838, 500, 500, 675, 716, 593,
    716, 679, 436, 716, 712, 343, 343, 666, 343, 1042, 712, 688, 716, 716, 494, 596, 479,
    712, 652, 924, 646, 652, 583, 712, 366, 712, 838,
)
SLACK = 1.06  # kerning only narrows a text; this covers glyph positions rounded to pixels
ASCENT, DESCENT = 0.93, 0.24  # of the font size, above and below the baseline


def text_width(s: str, size_px: float, bold: bool = False) -> float:
    """At most how wide ``s`` is drawn at ``size_px`` (SVG collapses runs of spaces)."""
    table = _BOLD if bold else _REGULAR
    em = sum(table[ord(c) - 32] if 32 <= ord(c) < 127 else 1000 for c in " ".join(s.split()))
    return em * size_px / 1000 * SLACK


def _fit(s: str, size_px: float, width: float, bold: bool = False) -> str:
    """``s``, cut with "…" where it is wider than ``width``."""
    if text_width(s, size_px, bold) <= width:
        return s
    while s and text_width(s + "…", size_px, bold) > width:
        s = s[:-1]
    return s.rstrip() + "…" if s else ""


def _below(y: float, above: float, below: float, lead: float = LEAD) -> float:
    """The baseline of a ``below`` px line under a ``above`` px line at baseline ``y``."""
    return y + DESCENT * above + lead + ASCENT * below


def _text(x: float, y: float, s: str, size_px: float = 12, weight: str = "normal",
          fill: str = INK, anchor: str = "start") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-family="{FONT}" font-size="{size_px:g}" '
        f'font-weight="{weight}" fill="{fill}" text-anchor="{anchor}">{escape(s)}</text>'
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, stroke: str, rx: int = 6,
          extra: str = "") -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx}" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="1.5"{extra}/>'
    )


def _box(x: float, y: float, w: float, h: float, fill: str, stroke: str, rx: int = 6,
         extra: str = "") -> str:
    """The rectangle that holds the rest of its group: every text of the group is inside."""
    return _rect(x, y, w, h, fill, stroke, rx, ' class="box"' + extra)


def _attr(value: str) -> str:
    return escape(value, {'"': "&quot;"})


def fit_scale(width: float, height: float) -> float:
    """The default scale: as large as fits ``FRAME`` (1920x1080), never below 1."""
    return max(1.0, min(FRAME[0] / width, FRAME[1] / height))


def _document(parts: Sequence[str], width: float, height: float,
              scale: float | None) -> str:
    s = fit_scale(width, height) if scale is None else scale
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * s:.0f}" '
        f'height="{height * s:.0f}" viewBox="0 0 {width:.0f} {height:.0f}">\n'
        f'<rect width="100%" height="100%" fill="#fafafa"/>\n' + "\n".join(parts) + "\n</svg>\n"
    )


# -- what the picture shows of a running sandbox


@dataclass(frozen=True)
class DeviceView:
    """How one device should look: its health, who holds it, which pods' status (the
    kubelet's allocatedResourcesStatus) reports it Unhealthy, and its SR-IOV VFs as the
    control API says (``num_vfs``/``port_vfs``: its ``DeviceState``; None: the profile's)."""

    health: str = "healthy"  # healthy | unhealthy | unplugged | unknown
    reason: str | None = None
    allocated_to: str | None = None
    pod_unhealthy: str = ""  # the pods that see it Unhealthy ("default/train, ..."), if any
    num_vfs: int | None = None
    port_vfs: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ResourceView:
    """One extended resource as the node's kubelet advertises it."""

    name: str
    capacity: int
    allocatable: int
    healthy_by_numa: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeView:
    """A running node: whether it is Ready, what its kubelet advertises, notes on what
    could not be asked."""

    ready: bool = True
    resources: tuple[ResourceView, ...] = ()
    notes: tuple[str, ...] = ()


def vf_counts(d: DeviceSpec, view: DeviceView) -> tuple[int, ...] | None:
    """VFs enabled on each physical function: the port's count, else the device's, else
    the profile's (as the fake tree builds them); None: no SR-IOV, or not there now."""
    total, enabled = ((d.nic.total_vfs, d.nic.num_vfs) if d.nic is not None
                      else (d.gpu.total_vfs, d.gpu.num_vfs) if d.gpu is not None else (0, 0))
    if not total or view.health in ("unplugged", "unknown"):
        return None
    ports = dict(view.port_vfs)
    counts = []
    for port in range(len(d.functions)):
        n = ports.get(port, view.num_vfs)
        counts.append(max(0, min(enabled if n is None else n, total)))
    return tuple(counts)


def _vf_text(counts: tuple[int, ...], total: int) -> str:
    if len(set(counts)) == 1:
        return f"{counts[0]}/{total} VFs" + (" per port" if len(counts) > 1 else "")
    return "VFs per port " + ", ".join(f"{n}/{total}" for n in counts)


def _detail(d: DeviceSpec, view: DeviceView) -> str:
    vfs = vf_counts(d, view)
    if d.gpu is not None:
        return size(d.gpu.memory) + (f", {_vf_text(vfs, d.gpu.total_vfs)}" if vfs else "")
    if d.nic is not None:
        ports = f"{d.nic.ports}x{d.nic.speed // 1000}G {d.nic.link_layer}"
        return ports + (f", {_vf_text(vfs, d.nic.total_vfs)}" if vfs else "")
    if d.fpga is not None:
        return f"{d.fpga.flavor}, {d.fpga.ports} port(s)"
    if d.nvme is not None:
        return f"{size(d.nvme.capacity)}, {d.nvme.namespaces} namespace(s)"
    return d.functions[0].driver or ""


@dataclass(frozen=True)
class _Device:
    """One device's texts, before they are placed."""

    spec: DeviceSpec
    view: DeviceView
    label: str  # kind and model
    detail: str  # size, ports, VFs
    badges: tuple[tuple[str, str], ...]  # (text, colour): health, holder

    @classmethod
    def of(cls, d: DeviceSpec, view: DeviceView) -> _Device:
        badges = []
        if view.health != "healthy":
            badge = "state unknown" if view.health == "unknown" else view.health
            if view.reason and view.health != "unknown":
                badge += f" ({view.reason})"
            badges.append((badge, COLORS.get(view.health, COLORS["unknown"])[1]))
        if view.allocated_to:
            badges.append((f"in use by {view.allocated_to}", IN_USE))
        label = f"{KIND_ICON.get(d.kind, '')} {d.model_name}".strip()
        return cls(d, view, label, _detail(d, view), tuple(badges))

    def width(self, id_w: float) -> float:
        tx = 10 + id_w + GAP
        line2 = text_width(self.spec.address, T_SMALL) + GAP + text_width(self.detail, T_SMALL)
        need = max(tx + text_width(self.label, T_BODY) + (DISC if self.view.pod_unhealthy
                                                           else 0),
                   tx + line2,
                   *(tx + text_width(b, T_SMALL, True) for b, _ in self.badges))
        return min(DEV_MAX_W, need + 11)  # 1: what rounding may add to a sum of widths

    def draw(self, numa_id: int, x: float, y: float, w: float, id_w: float
             ) -> tuple[list[str], float]:
        """Its group at (x, y), ``w`` wide; and its height."""
        d, view = self.spec, self.view
        fill, stroke = COLORS.get(view.health, COLORS["unknown"])
        tx, right = x + 10 + id_w + GAP, x + w - 10
        mark = DISC if view.pod_unhealthy else 0
        y1 = y + 8 + ASCENT * T_ID
        y2 = _below(y1, T_ID, T_SMALL)
        texts = [_text(x + 10, y1, d.id, T_ID, "bold", stroke),
                 _text(tx, y1, _fit(self.label, T_BODY, right - mark - tx), T_BODY),
                 _text(tx, y2, d.address, T_SMALL, fill=GREY)]
        end = tx + text_width(d.address, T_SMALL)
        detail = _fit(self.detail, T_SMALL, right - end - GAP)
        if detail:
            texts.append(_text(end + GAP, y2, detail, T_SMALL, fill=GREY))
            end += GAP + text_width(detail, T_SMALL)
        # Badges right-aligned: after the detail where they fit, else on lines of their own.
        lines: list[list[tuple[str, str]]] = [[]]
        room = right - end - GAP
        for badge, colour in self.badges:
            need = text_width(badge, T_SMALL, True) + (GAP if lines[-1] else 0)
            if need > room:
                lines.append([])
                room = right - tx
                badge = _fit(badge, T_SMALL, room, bold=True)
                need = text_width(badge, T_SMALL, True)
            lines[-1].append((badge, colour))
            room -= need
        yb = y2
        for k, line in enumerate(lines):
            if k:
                yb = _below(yb, T_SMALL, T_SMALL)
            bx = right
            for badge, colour in reversed(line):
                texts.append(_text(bx, yb, badge, T_SMALL, "bold", colour, "end"))
                bx -= text_width(badge, T_SMALL, True) + GAP
        h = yb + DESCENT * T_SMALL + 8 - y
        pods = (f' data-pod-unhealthy="{_attr(view.pod_unhealthy)}"'
                if view.pod_unhealthy else "")
        vfs = vf_counts(d, view)
        vf_attr = f' data-vfs="{",".join(map(str, vfs))}"' if vfs is not None else ""
        dash = ' stroke-dasharray="5,4"' if view.health in ("unplugged", "unknown") else ""
        out = [f'<g class="device" data-device="{_attr(d.id)}" data-kind="{d.kind}" '
               f'data-numa="{numa_id}" data-health="{view.health}"{pods}{vf_attr}>',
               _box(x, y, w, h, fill, stroke, 5, dash), *texts]
        if view.pod_unhealthy:  # a red "!" disc at the right of the first line
            cx, cy = x + w - 16, y1 - 5
            out.append(f'<circle class="pod-unhealthy" cx="{cx:.1f}" cy="{cy:.1f}" r="8" '
                       f'fill="{COLORS["unhealthy"][1]}"><title>'
                       f'{escape(f"Unhealthy in the status of {view.pod_unhealthy}")}'
                       '</title></circle>')
            out.append(_text(cx, cy + 5, "!", T_SMALL, "bold", "#ffffff", "middle"))
        out.append("</g>")
        return out, h


def _numa_width(node: NodeSpec, numa_id: int, dev_w: float) -> float:
    info = node.numa[numa_id]
    head = (text_width(f"NUMA node {numa_id}", T_NUMA, True) + 2 * GAP
            + text_width(f"{size(info.memory)} memory", T_BODY))
    cpus = sum(1 for c in node.cpus if c.numa_node == numa_id)
    return max(NUMA_MIN_W, 2 * PAD + head, 2 * PAD + min(cpus, 16) * CELL,
               PAD + DEV_INDENT + dev_w + PAD)


def _draw_numa(node: NodeSpec, numa_id: int, devices: Sequence[_Device], x: float, y: float,
               w: float, h: float, id_w: float, dev_w: float, held: Mapping[int, str]
               ) -> tuple[list[str], float]:
    """One NUMA node's box at (x, y), ``w`` by ``h`` (0: as tall as it needs); its height."""
    info = node.numa[numa_id]
    inner = w - 2 * PAD
    yh = y + 10 + ASCENT * T_NUMA
    out = [_text(x + PAD, yh, f"NUMA node {numa_id}", T_NUMA, "bold", "#283593"),
           _text(x + w - PAD, yh, f"{size(info.memory)} memory", T_BODY, anchor="end")]
    yc = _below(yh, T_NUMA, T_SMALL)
    out.append(_text(x + PAD, yc, _fit(f"CPUs {format_cpulist(info.cpus) or '-'}", T_SMALL,
                                       inner), T_SMALL, fill=GREY))
    # CPU grid: one square per logical CPU, darker for first threads; orange: held by a
    # container (exclusive CPUs, from the kubelet). Rows of equal length.
    cpus = [c for c in node.cpus if c.numa_node == numa_id]
    rows = max(1, math.ceil(len(cpus) / max(1, int(inner // CELL))))
    per_row = max(1, math.ceil(len(cpus) / rows))
    top = yc + DESCENT * T_SMALL + 6
    for k, cpu in enumerate(cpus):
        cx = x + PAD + (k % per_row) * CELL
        cy = top + (k // per_row) * CELL
        fill = "#7986cb" if cpu.thread == 0 else "#c5cae9"
        holder, extra = held.get(cpu.id), ""
        if holder is not None:
            fill = HELD
            extra = f' class="cpu-held" data-cpu="{cpu.id}" data-held="{_attr(holder)}"'
        out.append(
            f'<rect x="{cx:.1f}" y="{cy:.1f}" width="{CELL - 2}" height="{CELL - 2}" '
            f'fill="{fill}"{extra}><title>cpu{cpu.id} socket {cpu.socket} core {cpu.core} '
            f'thread {cpu.thread}{escape(f" held by {holder}") if holder else ""}'
            '</title></rect>'
        )
    yp = top + rows * CELL + 6 + ASCENT * T_SMALL
    bridges = sorted({d.spec.functions[0].host_bridge for d in devices})
    out.append(_text(x + PAD, yp, _fit("PCI " + (", ".join(bridges) or "(no devices)"),
                                       T_SMALL, inner), T_SMALL, fill=GREY))
    # The PCI spine: a line down from the PCI line, a branch to each device's first line.
    dy = yp + DESCENT * T_SMALL + 10
    spine_x, spine_top, mid = x + PAD + 8, dy - 4, dy
    drawn: list[str] = []
    for dev in devices:
        parts, dh = dev.draw(numa_id, x + PAD + DEV_INDENT, dy, dev_w, id_w)
        mid = dy + min(dh / 2, 20)
        drawn.append(f'<line x1="{spine_x:.1f}" y1="{mid:.1f}" x2="{x + PAD + DEV_INDENT:.1f}" '
                     f'y2="{mid:.1f}" stroke="#90a4ae" stroke-width="2"/>')
        drawn += parts
        dy += dh + DEV_GAP
    if devices:
        out.append(f'<line x1="{spine_x:.1f}" y1="{spine_top:.1f}" x2="{spine_x:.1f}" '
                   f'y2="{mid:.1f}" stroke="#90a4ae" stroke-width="2"/>')
    out += drawn
    height = max(h, dy - DEV_GAP + PAD - y if devices else dy - y)
    return [f'<g class="numa" data-numa="{numa_id}">',
            _box(x, y, w, height, "#f3f6fb", "#3f51b5"), *out, "</g>"], height


def _draw_resources(view: NodeView, x: float, y: float) -> tuple[list[str], float, float]:
    """The kubelet's extended resources as a table at (x, y): capacity, allocatable (red
    where below capacity), healthy devices per NUMA node; its parts, width and height."""
    if not view.resources:
        note = "no extended resources advertised"
        w = 2 * GAP + text_width(note, T_SMALL)
        h = 2 * 8 + (ASCENT + DESCENT) * T_SMALL
        return ['<g class="resources">', _box(x, y, w, h, "#fafafa", "#b0bec5", 4),
                _text(x + GAP, y + 8 + ASCENT * T_SMALL, note, T_SMALL, fill=GREY),
                "</g>"], w, h
    numas = sorted({k for r in view.resources for k in r.healthy_by_numa})
    head = ["resource", "capacity", "allocatable", *(f"healthy NUMA {k}" for k in numas)]
    rows = [[r.name, str(r.capacity), str(r.allocatable),
             *(str(r.healthy_by_numa.get(k, 0)) for k in numas)] for r in view.resources]
    widths = [max(text_width(head[i], T_SMALL, True),
                  *(text_width(row[i], T_BODY, i == 2) for row in rows))
              for i in range(len(head))]
    lefts = [x + GAP]
    for wd in widths[:-1]:
        lefts.append(lefts[-1] + wd + 2 * GAP)
    w = lefts[-1] + widths[-1] + GAP - x
    yh = y + 8 + ASCENT * T_SMALL
    out = ['<g class="resources">', ""]
    out += [_text(lefts[0], yh, head[0], T_SMALL, "bold", GREY)]
    out += [_text(lefts[i] + widths[i], yh, head[i], T_SMALL, "bold", GREY, "end")
            for i in range(1, len(head))]
    yr, above = yh, float(T_SMALL)
    for r, row in zip(view.resources, rows, strict=True):
        yr = _below(yr, above, T_BODY, 4)
        above = T_BODY
        short = r.allocatable < r.capacity
        healthy = ",".join(f"{k}:{r.healthy_by_numa.get(k, 0)}" for k in numas)
        out.append(f'<g class="resource" data-resource="{_attr(r.name)}" '
                   f'data-capacity="{r.capacity}" data-allocatable="{r.allocatable}" '
                   f'data-healthy="{healthy}">')
        out.append(_text(lefts[0], yr, row[0], T_BODY))
        for i in range(1, len(row)):
            bold, fill = (i == 2), (COLORS["unhealthy"][1] if i == 2 and short else INK)
            out.append(_text(lefts[i] + widths[i], yr, row[i], T_BODY,
                             "bold" if bold else "normal", fill, "end"))
        out.append("</g>")
    h = yr + DESCENT * T_BODY + 8 - y
    out[1] = _box(x, y, w, h, "#fafafa", "#b0bec5", 4)
    out.append("</g>")
    return out, w, h


def _draw_node(node: NodeSpec, views: Mapping[str, DeviceView], held: Mapping[int, str],
               live: NodeView | None) -> tuple[list[str], float, float]:
    """One node's box with its top left corner at (0, 0); its parts, width and height."""
    numa_ids = [n.id for n in node.numa]
    devices = {k: [_Device.of(d, views.get(d.id, DeviceView(d.health, d.health_reason)))
                   for d in node.devices if d.numa_node == k] for k in numa_ids}
    every = [dev for k in numa_ids for dev in devices[k]]
    id_w = max((text_width(dev.spec.id, T_ID, True) for dev in every), default=0.0)
    dev_w = max((dev.width(id_w) for dev in every), default=0.0)
    numa_w = max(_numa_width(node, k, dev_w) for k in numa_ids)
    row_w = len(numa_ids) * numa_w + (len(numa_ids) - 1) * NUMA_GAP

    c = node.cpu
    title = f"node {node.name}"
    state = None if live is None else ("Ready", "#2e7d32") if live.ready else (
        "NotReady", COLORS["unhealthy"][1])
    specs = (f"{c.sockets} socket(s) x {c.cores_per_socket} cores x {c.threads_per_core} "
             f"threads, {size(node.memory)}, {c.model}")
    head_w = max(text_width(title, T_NODE, True)
                 + (GAP + text_width(state[0], T_BODY, True) if state else 0),
                 text_width(specs, T_SMALL))
    _, table_w, table_h = _draw_resources(live, 0, 0) if live else ([], 0.0, 0.0)
    # The table right of the title where the NUMA boxes leave room (notes: under the title)
    beside = live is not None and not live.notes and row_w >= head_w + 4 * GAP + table_w
    inner = max(row_w, head_w, table_w if not beside else 0.0)
    w = inner + 2 * PAD

    yt = PAD + ASCENT * T_NODE
    out = [_text(PAD, yt, title, T_NODE, "bold")]
    if state:
        out.append(_text(PAD + text_width(title, T_NODE, True) + GAP, yt, state[0], T_BODY,
                         "bold", state[1]))
    ys = _below(yt, T_NODE, T_SMALL)
    out.append(_text(PAD, ys, specs, T_SMALL, fill=GREY))
    for note in live.notes if live else ():
        ys = _below(ys, T_SMALL, T_SMALL)
        out.append(_text(PAD, ys, _fit(f"! {note}", T_SMALL, inner), T_SMALL,
                         fill=COLORS["unhealthy"][1]))
    bottom = ys + DESCENT * T_SMALL
    if live is not None:
        tx, ty = (w - PAD - table_w, PAD) if beside else (PAD, bottom + 10)
        out += _draw_resources(live, tx, ty)[0]
        bottom = max(bottom, ty + table_h)
    top = bottom + 14
    heights = [_draw_numa(node, k, devices[k], 0, 0, numa_w, 0, id_w, dev_w, {})[1]
               for k in numa_ids]
    for i, k in enumerate(numa_ids):
        nx = PAD + i * (numa_w + NUMA_GAP)
        out += _draw_numa(node, k, devices[k], nx, top, numa_w, max(heights), id_w, dev_w,
                          held)[0]
        if i:
            ly = top + 30
            d = node.numa[k].distances[numa_ids[i - 1]]
            out.append(f'<line x1="{nx - NUMA_GAP:.1f}" y1="{ly:.1f}" x2="{nx:.1f}" '
                       f'y2="{ly:.1f}" stroke="#3f51b5" stroke-width="2" '
                       'stroke-dasharray="4,3"/>')
            out.append(_text(nx - NUMA_GAP / 2, ly - 6, f"{d}", T_SMALL, "bold", "#3f51b5",
                             "middle"))
    h = top + max(heights) + PAD
    return [_box(0, 0, w, h, "#ffffff", "#263238", 10), *out], w, h


Icon = Callable[[float, float], list[str]]  # draws a 14 px icon with its top left at (x, y)


def _swatch(fill: str, stroke: str, dash: str = "") -> Icon:
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return lambda x, y: [_rect(x, y, 14, 14, fill, stroke, 3, extra)]


def _legend_items(nodes: Sequence[NodeSpec], views: Mapping[str, Mapping[str, DeviceView]],
                  cpus: Mapping[str, Mapping[int, str]]) -> list[tuple[Icon, str]]:
    shown = {v.health for node_views in views.values() for v in node_views.values()}
    items = [(_swatch(*COLORS[h], "4,3" if h == "unplugged" else ""), h)
             for h in ("healthy", "unhealthy", "unplugged")]
    if "unknown" in shown:
        items.append((_swatch(*COLORS["unknown"], "4,3"), "state unknown (no answer)"))
    items.append((lambda x, y: [_rect(x, y, 6, 14, "#7986cb", "none", 1),
                                _rect(x + 8, y, 6, 14, "#c5cae9", "none", 1)],
                  "CPUs (dark: first thread)"))
    if any(cpus.values()):
        items.append((_swatch(HELD, "none"), "CPU held by a pod"))
    if any(len(n.numa) > 1 for n in nodes):
        items.append((lambda x, y: [f'<line x1="{x:.1f}" y1="{y + 7:.1f}" x2="{x + 14:.1f}" '
                                    f'y2="{y + 7:.1f}" stroke="#3f51b5" stroke-width="2" '
                                    'stroke-dasharray="4,3"/>'], "NUMA distance"))
    if any(v.pod_unhealthy for node_views in views.values() for v in node_views.values()):
        red = COLORS["unhealthy"][1]
        items.append((lambda x, y: [f'<circle cx="{x + 7:.1f}" cy="{y + 7:.1f}" r="7" '
                                    f'fill="{red}"/>',
                                    _text(x + 7, y + 12, "!", T_SMALL, "bold", "#ffffff",
                                          "middle")],
                      "Unhealthy in the status of a pod holding it "
                      "(allocatedResourcesStatus)"))
    return items


def _draw_legend(items: Sequence[tuple[Icon, str]], x: float, y: float, width: float
                 ) -> tuple[list[str], float]:
    """The legend's items in lines no wider than ``width``, from (x, y); its height."""
    out = ['<g class="legend">']
    cx, base = x, y + ASCENT * T_SMALL
    for icon, label in items:
        label = _fit(label, T_SMALL, width - 20)
        need = 20 + text_width(label, T_SMALL)
        if cx > x and cx + need > x + width:
            cx, base = x, _below(base, T_SMALL, T_SMALL, 10)
        out += icon(cx, base - 12)
        out.append(_text(cx + 20, base, label, T_SMALL, fill=GREY))
        cx += need + 28
    out.append("</g>")
    return out, base + DESCENT * T_SMALL - y


def _shelves(sizes: Sequence[tuple[float, float]], limit: float
             ) -> tuple[list[tuple[float, float]], float, float]:
    """Boxes in rows, in order, each row at most ``limit`` wide (or one box): their top
    left corners, the width and the height of them all."""
    at: list[tuple[float, float]] = []
    x = y = row_h = width = 0.0
    for w, h in sizes:
        if x and x + w > limit:
            x, y, row_h = 0.0, y + row_h + NODE_GAP, 0.0
        at.append((x, y))
        width = max(width, x + w)
        row_h = max(row_h, h)
        x += w + NODE_GAP
    return at, width, y + row_h


def topology_svg(nodes: Sequence[NodeSpec],
                 views: Mapping[str, Mapping[str, DeviceView]] | None = None,
                 title: str = "", cpus: Mapping[str, Mapping[int, str]] | None = None,
                 live: Mapping[str, NodeView] | None = None,
                 scale: float | None = None) -> str:
    """One picture of every node, a 16:9 frame. ``views``: node name -> device id ->
    DeviceView (a device missing: as the profile starts it); ``cpus``: node name -> CPU
    id -> who holds it exclusively; ``live``: node name -> NodeView (none: no Ready state
    and no resources drawn, the profile alone); ``scale``: output pixels per user unit
    (None: ``fit_scale``)."""
    views, cpus = views or {}, cpus or {}
    drawn = [_draw_node(n, views.get(n.name, {}), cpus.get(n.name, {}),
                        (live or {}).get(n.name)) for n in nodes]
    items = _legend_items(nodes, views, cpus)
    title_h = (ASCENT + DESCENT) * T_TITLE + 14 if title else 0.0
    title_w = text_width(title, T_TITLE, True)
    # Rows in the profile's order; of every way to break them, the one whose 16:9 frame
    # is smallest: the one a screen shows largest.
    sizes = [(w, h) for _, w, h in drawn]
    limits = sorted({sum(w for w, _ in sizes[i:j]) + (j - i - 1) * NODE_GAP
                     for i in range(len(sizes)) for j in range(i + 1, len(sizes) + 1)})
    best: tuple[float, list[tuple[float, float]], float, float, float] | None = None
    for limit in limits or [0.0]:
        at, w, h = _shelves(sizes, limit)
        content_w = max(w, title_w, 300.0)
        legend_h = _draw_legend(items, 0, 0, content_w)[1]
        total_w = content_w + 2 * MARGIN
        total_h = 2 * MARGIN + title_h + h + 18 + legend_h
        frame_w = max(total_w, total_h * 16 / 9)
        if best is None or frame_w < best[0]:
            best = (frame_w, at, content_w, total_w, total_h)
    assert best is not None
    _, at, content_w, total_w, total_h = best
    unit = math.ceil(max(total_h, total_w * 9 / 16) / 9)
    frame_w, frame_h = 16 * unit, 9 * unit
    x0, y0 = (frame_w - total_w) / 2 + MARGIN, (frame_h - total_h) / 2 + MARGIN
    parts = []
    if title:
        parts.append(_text(x0, y0 + ASCENT * T_TITLE, title, T_TITLE, "bold"))
    body = y0 + title_h
    bottom = body
    for node, (nparts, _, h), (x, y) in zip(nodes, drawn, at, strict=True):
        parts.append(f'<g class="node" data-node="{_attr(node.name)}" '
                     f'transform="translate({x0 + x:.1f},{body + y:.1f})">')
        parts += nparts
        parts.append("</g>")
        bottom = max(bottom, body + y + h)
    parts += _draw_legend(items, x0, bottom + 18, content_w)[0]
    return _document(parts, frame_w, frame_h, scale)


# -- claims: who holds which device or partition, what is left (`sandbox dra claims -o svg`)

CLAIMS_W = 900
BAR_W = 340
USED = "#ef6c00"  # the part of a counter or capacity that claims hold
FREE = "#c8e6c9"  # the part that is left
FULL = "#c62828"  # nothing left


def _holder(a: Allocated, x: float, y: float, right: float) -> list[str]:
    """Two lines: which pod holds it through which claim, then the device and what it takes."""
    who = f"pod {', '.join(a.pods)}" if a.pods else "reserved for no pod (yet)"
    who = _fit(who, 13, right - x - 200, bold=True)
    cx = max(x + 300, x + text_width(who, 13, True) + 2 * GAP)
    takes = ", ".join(f"{k} {v}" for k, v in a.consumed)
    return [
        f'<g class="claim" data-claim="{_attr(a.claim)}" data-pod="{_attr(",".join(a.pods))}" '
        f'data-device="{_attr(a.device)}" data-request="{_attr(a.request)}">',
        _text(x, y + 15, who, 13, "bold", "#1a237e"),
        _text(cx, y + 15, _fit(f"claim {a.claim} (request {a.request})", 12, right - cx), 12,
              fill="#37474f"),
        _text(x + 14, y + 32, _fit(a.device + (f": takes {takes}" if takes else ""), 12,
                                   right - x - 14), 12, fill="#546e7a"),
        "</g>",
    ]


def _card(title: str, caption: str, rows: Sequence[Left], holders: Sequence[Allocated],
          y: float, quantity: Callable[[Decimal], str]) -> tuple[list[str], float]:
    """One GPU's counter set or one NIC's capacity: a bar per counter, then its holders."""
    x, w = PAD, CLAIMS_W - 2 * PAD
    right = x + w - 16
    height = 44 + len(rows) * 28 + 8 + (len(holders) * 40 if holders else 28) + 8
    full = any(r.used >= r.total for r in rows)
    stroke = FULL if full else ("#ef6c00" if holders else "#2e7d32")
    shown = _fit(title, 16, w - 32, bold=True)
    caption = _fit(caption, 12, right - (x + 16 + text_width(shown, 16, True) + 2 * GAP))
    out = [f'<g class="card" data-owner="{_attr(title)}">',
           _box(x, y, w, height, "#ffffff", stroke, 8),
           _text(x + 16, y + 26, shown, 16, "bold", INK),
           _text(right, y + 26, caption, 12, fill="#546e7a", anchor="end")]
    ry = y + 44
    for r in rows:
        left = r.total - r.used
        share = float(r.used / r.total) if r.total else 1.0
        used_w = max(0.0, min(1.0, share)) * BAR_W
        bx = x + 190
        lx = bx + BAR_W + 14
        left_text = f"left {quantity(left)}"
        of_x = max(bx + BAR_W + 110, lx + text_width(left_text, 13, True) + GAP)
        out += [
            f'<g class="left" data-owner="{_attr(r.owner)}" data-name="{_attr(r.name)}" '
            f'data-used="{quantity(r.used)}" data-left="{quantity(left)}" '
            f'data-total="{quantity(r.total)}">',
            _text(x + 16, ry + 15, _fit(r.name, 13, 190 - 16 - GAP), 13, fill="#37474f"),
            _rect(bx, ry + 2, BAR_W, 16, FREE, "#90a4ae", 3),
        ]
        if used_w:
            out.append(_rect(bx, ry + 2, used_w, 16, FULL if left <= 0 else USED, "none", 3))
        out += [_text(lx, ry + 15, left_text, 13, "bold", FULL if left <= 0 else "#2e7d32"),
                _text(of_x, ry + 15, _fit(f"of {quantity(r.total)} ({quantity(r.used)} used)",
                                          12, right - of_x), 12, fill="#546e7a"),
                "</g>"]
        ry += 28
    ry += 8
    if not holders:
        out.append(_text(x + 16, ry + 16, "free: no claim holds any of it", 13, fill="#2e7d32"))
    for a in holders:
        out += _holder(a, x + 16, ry, right)
        ry += 40
    out.append("</g>")
    return out, height


def claims_svg(use: Usage, title: str = "", scale: float | None = None) -> str:
    """The claims view of ``sandbox.dra.usage`` as a picture: per pool (node), one card per
    GPU counter set and per device with consumable capacity (a NIC's bandwidth), with a
    bar for each counter (what claims hold, what is left) and the pods and claims that
    hold its partitions or shares; then the devices allocated whole. ``data-*``
    attributes (claim, pod, device; owner, name, used, left, total) let tests read it.
    ``scale``: output pixels per user unit (None: ``fit_scale``)."""
    from sandbox.dra import quantity

    parts: list[str] = []
    y = 20.0
    if title:
        parts.append(_text(PAD, 34, _fit(title, 20, CLAIMS_W - 2 * PAD, True), 20, "bold"))
        y = 50.0
    held = len({a.claim for a in use.allocated})
    parts.append(_text(PAD, y + 4, f"{held} claim(s) hold {len(use.allocated)} device(s)", 13,
                       fill=GREY))
    y += 20
    pools = sorted({r.pool for r in (*use.counters, *use.capacity)}
                   | {a.pool for a in use.allocated})
    for pool in pools:
        parts.append(_text(PAD, y + 22, _fit(f"pool {pool}", 17, CLAIMS_W - 2 * PAD, True), 17,
                           "bold", "#283593"))
        y += 34
        mine = [a for a in use.allocated if a.pool == pool]
        shown: set[Allocated] = set()
        cards: list[tuple[str, str, list[Left], list[Allocated]]] = []
        for kind, rows in (("counter set", use.counters), ("capacity", use.capacity)):
            owners = sorted({r.owner for r in rows if r.pool == pool})
            for owner in owners:
                of = [r for r in rows if (r.pool, r.owner) == (pool, owner)]
                if kind == "counter set":
                    holders = [a for a in mine if owner in a.counter_sets]
                    caption = "shared counters: its partitions and the whole device draw on them"
                else:
                    holders = [a for a in mine if a.device == owner]
                    caption = "consumable capacity: claims take shares"
                shown.update(holders)
                cards.append((owner, caption, of, holders))
        rest = [a for a in mine if a not in shown]
        for owner, caption, of, holders in cards:
            card, height = _card(owner, caption, of, holders, y, quantity)
            parts += card
            y += height + 12
        if rest:
            card, height = _card("devices allocated whole", "no shared counters or capacity",
                                 [], rest, y, quantity)
            parts += card
            y += height + 12
    if not pools:
        parts.append(_text(PAD, y + 24, "no ResourceSlices and no allocated claims", 14))
        y += 40
    legend_y = y + 4
    parts += [_rect(PAD, legend_y, 14, 14, USED, "none", 3),
              _text(PAD + 20, legend_y + 12, "held by claims", 12),
              _rect(PAD + 140, legend_y, 14, 14, FREE, "#90a4ae", 3),
              _text(PAD + 160, legend_y + 12, "left", 12),
              _rect(PAD + 220, legend_y, 14, 14, FULL, "none", 3),
              _text(PAD + 240, legend_y + 12, "nothing left", 12)]
    return _document(parts, CLAIMS_W, legend_y + 30, scale)


def svg_to_png(svg: str) -> bytes:
    tool = shutil.which("rsvg-convert")
    if tool is None:
        raise SandboxError(
            "PNG output needs rsvg-convert: apt-get install librsvg2-bin (or use --output svg)"
        )
    return run([tool, "--format=png"], input=svg.encode(), timeout=None).stdout_bytes

"""Topology pictures for workshops: NUMA nodes, CPUs, PCI tree, devices, health, allocations.

``topology_svg(nodes, status, cpus=held)`` returns a standalone SVG document (no external
fonts or scripts; CPUs a container holds exclusively in orange); ``claims_svg(usage)``
draws ``sandbox dra claims``: which pod's claim holds which partition or NIC share, and
what is left of each GPU's counters and NIC's capacity.
``svg_to_png`` rasterises either with ``rsvg-convert`` (Debian: librsvg2-bin).
Each drawn device carries ``data-device``/``data-numa`` attributes (a held CPU
``data-cpu``/``data-held``) so tests and tools can check what the picture shows without
parsing its geometry.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

from sandbox.errors import CommandError, SandboxError
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
}
HELD = "#ef6c00"  # a CPU a container holds exclusively
KIND_ICON = {"gpu": "GPU", "nic": "NIC", "fpga": "FPGA", "generic": "PCI"}
NUMA_W = 420
ROW_H = 50
PAD = 16


@dataclass(frozen=True)
class DeviceView:
    """How one device should look: its health, who holds it and which pods' status
    (the kubelet's allocatedResourcesStatus) reports it Unhealthy."""

    health: str = "healthy"  # healthy | unhealthy | unplugged
    reason: str | None = None
    allocated_to: str | None = None
    pod_unhealthy: str = ""  # the pods that see it Unhealthy ("default/train, ..."), if any


def _text(x: float, y: float, s: str, size_px: int = 12, weight: str = "normal",
          fill: str = "#212121", anchor: str = "start") -> str:
    return (
        f'<text x="{x:.0f}" y="{y:.0f}" font-family="{FONT}" font-size="{size_px}" '
        f'font-weight="{weight}" fill="{fill}" text-anchor="{anchor}">{escape(s)}</text>'
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, stroke: str, rx: int = 6,
          extra: str = "") -> str:
    return (
        f'<rect x="{x:.0f}" y="{y:.0f}" width="{w:.0f}" height="{h:.0f}" rx="{rx}" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="1.5"{extra}/>'
    )


def _device_detail(d: DeviceSpec) -> str:
    if d.gpu is not None:
        return f"{size(d.gpu.memory)}"
    if d.nic is not None:
        vfs = f", {d.nic.num_vfs}/{d.nic.total_vfs} VFs" if d.nic.total_vfs else ""
        return f"{d.nic.ports}x{d.nic.speed // 1000}G {d.nic.link_layer}{vfs}"
    if d.fpga is not None:
        return f"{d.fpga.flavor}, {d.fpga.ports} port(s)"
    return d.functions[0].driver or ""


def _numa_box(node: NodeSpec, numa_id: int, x: float, y: float, height: float,
              views: Mapping[str, DeviceView], held: Mapping[int, str]) -> list[str]:
    info = node.numa[numa_id]
    out = [
        f'<g class="numa" data-numa="{numa_id}">',
        _rect(x, y, NUMA_W, height, "#f3f6fb", "#3f51b5"),
        _text(x + PAD, y + 24, f"NUMA node {numa_id}", 15, "bold", "#283593"),
        _text(x + NUMA_W - PAD, y + 24, f"{size(info.memory)} memory", 12, anchor="end"),
        _text(x + PAD, y + 44, f"CPUs {format_cpulist(info.cpus) or '-'}", 11, fill="#455a64"),
    ]
    # CPU grid: one square per logical CPU, darker for first threads; orange: held by a
    # container (exclusive CPUs, from the kubelet).
    cy = y + 54
    per_row = 32
    cell = (NUMA_W - 2 * PAD) / per_row
    cpus = [c for c in node.cpus if c.numa_node == numa_id]
    for k, cpu in enumerate(cpus):
        cx = x + PAD + (k % per_row) * cell
        ry = cy + (k // per_row) * cell
        fill = "#7986cb" if cpu.thread == 0 else "#c5cae9"
        holder, extra = held.get(cpu.id), ""
        if holder is not None:
            fill = HELD
            extra = f' class="cpu-held" data-cpu="{cpu.id}" data-held="{_attr(holder)}"'
        out.append(
            f'<rect x="{cx:.1f}" y="{ry:.1f}" width="{cell - 2:.1f}" height="{cell - 2:.1f}" '
            f'fill="{fill}"{extra}><title>cpu{cpu.id} socket {cpu.socket} core {cpu.core} '
            f'thread {cpu.thread}{escape(f" held by {holder}") if holder else ""}'
            '</title></rect>'
        )
    rows = max(1, -(-len(cpus) // per_row))
    dy = cy + rows * cell + 14
    bridges = sorted({d.functions[0].host_bridge for d in node.devices if d.numa_node == numa_id})
    out.append(_text(x + PAD, dy + 4, "PCI " + (", ".join(bridges) or "(no devices)"), 11,
                     fill="#455a64"))
    dy += 14
    spine_x = x + PAD + 6
    devices = [d for d in node.devices if d.numa_node == numa_id]
    if devices:
        out.append(
            f'<line x1="{spine_x}" y1="{dy:.0f}" x2="{spine_x}" '
            f'y2="{dy + (len(devices) - 0.5) * ROW_H:.0f}" stroke="#90a4ae" stroke-width="2"/>'
        )
    for d in devices:
        view = views.get(d.id, DeviceView(d.health, d.health_reason))
        fill, stroke = COLORS.get(view.health, COLORS["healthy"])
        top = dy + 6
        mid = top + (ROW_H - 10) / 2
        out.append(f'<line x1="{spine_x}" y1="{mid:.0f}" x2="{spine_x + 18}" y2="{mid:.0f}" '
                   'stroke="#90a4ae" stroke-width="2"/>')
        bx = spine_x + 18
        bw = NUMA_W - (bx - x) - PAD
        dash = ' stroke-dasharray="5,4"' if view.health == "unplugged" else ""
        pods = (f' data-pod-unhealthy="{_attr(view.pod_unhealthy)}"'
                if view.pod_unhealthy else "")
        out.append(
            f'<g class="device" data-device="{escape(d.id)}" data-kind="{d.kind}" '
            f'data-numa="{numa_id}" data-health="{view.health}"{pods}>'
        )
        out.append(_rect(bx, top, bw, ROW_H - 10, fill, stroke, 5, dash))
        out.append(_text(bx + 10, top + 17, f"{d.id}", 13, "bold", stroke))
        out.append(_text(bx + 62, top + 17, f"{KIND_ICON.get(d.kind, '')}  {d.model_name}", 12))
        detail = f"{d.address}   {_device_detail(d)}"
        out.append(_text(bx + 62, top + 33, detail, 10, fill="#546e7a"))
        badge = view.health if view.health != "healthy" else ""
        if view.reason and view.health != "healthy":
            badge += f" ({view.reason})"
        if view.allocated_to:
            badge = f"in use by {view.allocated_to}"
        if badge:
            out.append(_text(bx + bw - 8, top + 33, badge, 10, "bold", stroke, "end"))
        if view.pod_unhealthy:  # a red "!" disc and whose status says so, top right
            red = COLORS["unhealthy"][1]
            out.append(f'<circle class="pod-unhealthy" cx="{bx + bw - 2:.0f}" '
                       f'cy="{top + 2:.0f}" r="7" fill="{red}"><title>'
                       f'{escape(f"Unhealthy in the status of {view.pod_unhealthy}")}'
                       '</title></circle>')
            out.append(_text(bx + bw - 2, top + 6, "!", 11, "bold", "#ffffff", "middle"))
        out.append("</g>")
        dy += ROW_H
    out.append("</g>")
    return out


def _numa_height(node: NodeSpec, numa_id: int) -> float:
    cpus = sum(1 for c in node.cpus if c.numa_node == numa_id)
    cell = (NUMA_W - 2 * PAD) / 32
    rows = max(1, -(-cpus // 32))
    devices = sum(1 for d in node.devices if d.numa_node == numa_id)
    return 54 + rows * cell + 28 + devices * ROW_H + 12


def topology_svg(nodes: Sequence[NodeSpec],
                 views: Mapping[str, Mapping[str, DeviceView]] | None = None,
                 title: str = "", cpus: Mapping[str, Mapping[int, str]] | None = None) -> str:
    """One picture of every node; ``views`` maps node name -> device id -> DeviceView,
    ``cpus`` node name -> CPU id -> who holds it exclusively."""
    views = views or {}
    cpus = cpus or {}
    parts: list[str] = []
    y = 20.0
    width = 0.0
    if title:
        parts.append(_text(PAD, 32, title, 18, "bold"))
        y = 48.0
    for node in nodes:
        numa_ids = [n.id for n in node.numa]
        gap = 60
        inner_w = len(numa_ids) * NUMA_W + (len(numa_ids) - 1) * gap
        heights = [_numa_height(node, n) for n in numa_ids]
        box_h = max(heights) + 70
        parts.append(f'<g class="node" data-node="{escape(node.name)}">')
        parts.append(_rect(PAD, y, inner_w + 2 * PAD, box_h, "#ffffff", "#263238", 10))
        c = node.cpu
        parts.append(_text(2 * PAD, y + 26, f"node {node.name}", 16, "bold"))
        parts.append(_text(
            2 * PAD, y + 44,
            f"{c.sockets} socket(s) x {c.cores_per_socket} cores x {c.threads_per_core} threads,"
            f" {size(node.memory)}, {c.model}", 11, fill="#455a64"))
        for k, numa_id in enumerate(numa_ids):
            nx = 2 * PAD + k * (NUMA_W + gap) - PAD
            parts.extend(_numa_box(node, numa_id, nx + PAD, y + 56, max(heights),
                                   views.get(node.name, {}), cpus.get(node.name, {})))
            if k:
                lx = nx + PAD - gap
                ly = y + 56 + 30
                d = node.numa[numa_id].distances[numa_ids[k - 1]]
                parts.append(f'<line x1="{lx:.0f}" y1="{ly:.0f}" x2="{lx + gap:.0f}" '
                             f'y2="{ly:.0f}" stroke="#3f51b5" stroke-width="2" '
                             'stroke-dasharray="4,3"/>')
                parts.append(_text(lx + gap / 2, ly - 6, f"{d}", 11, "bold", "#3f51b5",
                                   "middle"))
        parts.append("</g>")
        y += box_h + 20
        width = max(width, inner_w + 4 * PAD)
    legend_y = y + 6
    lx = PAD
    for label, (fill, stroke) in COLORS.items():
        parts.append(_rect(lx, legend_y, 14, 14, fill, stroke, 3))
        parts.append(_text(lx + 20, legend_y + 12, label, 11))
        lx += 110
    # Two text elements: SVG collapses the spaces that would separate them in one.
    parts.append(_text(lx, legend_y + 12, "squares: CPUs (dark: first thread)", 11,
                       fill="#455a64"))
    parts.append(_text(lx + 230, legend_y + 12, "dashed line: NUMA distance", 11,
                       fill="#455a64"))
    width = max(width, lx + 230 + 170)
    if any(cpus.values()):
        parts.append(_rect(lx + 410, legend_y, 14, 14, HELD, "none", 3))
        parts.append(_text(lx + 430, legend_y + 12, "CPU held by a pod", 11, fill="#455a64"))
        width = max(width, lx + 430 + 130)
    if any(v.pod_unhealthy for node_views in views.values() for v in node_views.values()):
        ly = legend_y + 24  # a second legend line: the mark is rare, keep the first as is
        red = COLORS["unhealthy"][1]
        parts.append(f'<circle cx="{PAD + 7}" cy="{ly + 7}" r="7" fill="{red}"/>')
        parts.append(_text(PAD + 7, ly + 11, "!", 11, "bold", "#ffffff", "middle"))
        parts.append(_text(PAD + 20, ly + 12, "Unhealthy in the status of a pod holding it "
                           "(allocatedResourcesStatus)", 11, fill="#455a64"))
        legend_y = ly
    height = legend_y + 30
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}">\n'
        f'<rect width="100%" height="100%" fill="#fafafa"/>\n' + "\n".join(parts) + "\n</svg>\n"
    )


# -- claims: who holds which device or partition, what is left (`sandbox dra claims -o svg`)

CLAIMS_W = 900
BAR_W = 340
USED = "#ef6c00"  # the part of a counter or capacity that claims hold
FREE = "#c8e6c9"  # the part that is left
FULL = "#c62828"  # nothing left


def _attr(value: str) -> str:
    return escape(value, {'"': "&quot;"})


def _holder(a: Allocated, x: float, y: float) -> list[str]:
    """Two lines: which pod holds it through which claim, then the device and what it takes."""
    who = f"pod {', '.join(a.pods)}" if a.pods else "reserved for no pod (yet)"
    takes = ", ".join(f"{k} {v}" for k, v in a.consumed)
    return [
        f'<g class="claim" data-claim="{_attr(a.claim)}" data-pod="{_attr(",".join(a.pods))}" '
        f'data-device="{_attr(a.device)}" data-request="{_attr(a.request)}">',
        _text(x, y + 15, who, 13, "bold", "#1a237e"),
        _text(x + 300, y + 15, f"claim {a.claim} (request {a.request})", 12, fill="#37474f"),
        _text(x + 14, y + 32, a.device + (f": takes {takes}" if takes else ""), 12,
              fill="#546e7a"),
        "</g>",
    ]


def _card(title: str, caption: str, rows: Sequence[Left], holders: Sequence[Allocated],
          y: float, quantity: Callable[[Decimal], str]) -> tuple[list[str], float]:
    """One GPU's counter set or one NIC's capacity: a bar per counter, then its holders."""
    x, w = PAD, CLAIMS_W - 2 * PAD
    height = 44 + len(rows) * 28 + 8 + (len(holders) * 40 if holders else 28) + 8
    full = any(r.used >= r.total for r in rows)
    stroke = FULL if full else ("#ef6c00" if holders else "#2e7d32")
    out = [f'<g class="card" data-owner="{_attr(title)}">',
           _rect(x, y, w, height, "#ffffff", stroke, 8),
           _text(x + 16, y + 26, title, 16, "bold", "#212121"),
           _text(x + w - 16, y + 26, caption, 12, fill="#546e7a", anchor="end")]
    ry = y + 44
    for r in rows:
        left = r.total - r.used
        share = float(r.used / r.total) if r.total else 1.0
        used_w = max(0.0, min(1.0, share)) * BAR_W
        bx = x + 190
        out += [
            f'<g class="left" data-owner="{_attr(r.owner)}" data-name="{_attr(r.name)}" '
            f'data-used="{quantity(r.used)}" data-left="{quantity(left)}" '
            f'data-total="{quantity(r.total)}">',
            _text(x + 16, ry + 15, r.name, 13, fill="#37474f"),
            _rect(bx, ry + 2, BAR_W, 16, FREE, "#90a4ae", 3),
        ]
        if used_w:
            out.append(_rect(bx, ry + 2, used_w, 16, FULL if left <= 0 else USED, "none", 3))
        out += [_text(bx + BAR_W + 14, ry + 15, f"left {quantity(left)}", 13, "bold",
                      FULL if left <= 0 else "#2e7d32"),
                _text(bx + BAR_W + 110, ry + 15,
                      f"of {quantity(r.total)} ({quantity(r.used)} used)", 12, fill="#546e7a"),
                "</g>"]
        ry += 28
    ry += 8
    if not holders:
        out.append(_text(x + 16, ry + 16, "free: no claim holds any of it", 13, fill="#2e7d32"))
    for a in holders:
        out += _holder(a, x + 16, ry)
        ry += 40
    out.append("</g>")
    return out, height


def claims_svg(use: Usage, title: str = "") -> str:
    """The claims view of ``sandbox.dra.usage`` as a picture: per pool (node), one card per
    GPU counter set and per device with consumable capacity (a NIC's bandwidth), with a
    bar for each counter (what claims hold, what is left) and the pods and claims that
    hold its partitions or shares; then the devices allocated whole. ``data-*``
    attributes (claim, pod, device; owner, name, used, left, total) let tests read it."""
    from sandbox.dra import quantity

    parts: list[str] = []
    y = 20.0
    if title:
        parts.append(_text(PAD, 34, title, 20, "bold"))
        y = 50.0
    held = len({a.claim for a in use.allocated})
    parts.append(_text(PAD, y + 4, f"{held} claim(s) hold {len(use.allocated)} device(s)", 13,
                       fill="#455a64"))
    y += 20
    pools = sorted({r.pool for r in (*use.counters, *use.capacity)}
                   | {a.pool for a in use.allocated})
    for pool in pools:
        parts.append(_text(PAD, y + 22, f"pool {pool}", 17, "bold", "#283593"))
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
    height = legend_y + 30
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CLAIMS_W}" height="{height:.0f}" '
        f'viewBox="0 0 {CLAIMS_W} {height:.0f}">\n'
        f'<rect width="100%" height="100%" fill="#fafafa"/>\n' + "\n".join(parts) + "\n</svg>\n"
    )


def svg_to_png(svg: str) -> bytes:
    tool = shutil.which("rsvg-convert")
    if tool is None:
        raise SandboxError(
            "PNG output needs rsvg-convert: apt-get install librsvg2-bin (or use --output svg)"
        )
    result = subprocess.run([tool, "--format=png"], input=svg.encode(), capture_output=True,
                            check=False)
    if result.returncode != 0:
        raise CommandError([tool, "--format=png"], result.returncode,
                           result.stderr.decode(errors="replace"))
    return result.stdout

"""Topology pictures for workshops: NUMA nodes, CPUs, PCI tree, devices, health, allocations.

``topology_svg(nodes, status)`` returns a standalone SVG document (no external fonts or
scripts). ``svg_to_png`` rasterises it with ``rsvg-convert`` (Debian: librsvg2-bin).
Each drawn device carries ``data-device``/``data-numa`` attributes so tests and tools can
check what the picture shows without parsing its geometry.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from sandbox.errors import CommandError, SandboxError
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.spec import DeviceSpec, NodeSpec
from sandbox.textui import size

FONT = "DejaVu Sans, Verdana, sans-serif"
COLORS = {
    "healthy": ("#e8f5e9", "#2e7d32"),
    "unhealthy": ("#ffebee", "#c62828"),
    "unplugged": ("#f5f5f5", "#9e9e9e"),
}
KIND_ICON = {"gpu": "GPU", "nic": "NIC", "fpga": "FPGA", "generic": "PCI"}
NUMA_W = 420
ROW_H = 50
PAD = 16


@dataclass(frozen=True)
class DeviceView:
    """How one device should look: its health and who holds it."""

    health: str = "healthy"  # healthy | unhealthy | unplugged
    reason: str | None = None
    allocated_to: str | None = None


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
              views: Mapping[str, DeviceView]) -> list[str]:
    info = node.numa[numa_id]
    out = [
        f'<g class="numa" data-numa="{numa_id}">',
        _rect(x, y, NUMA_W, height, "#f3f6fb", "#3f51b5"),
        _text(x + PAD, y + 24, f"NUMA node {numa_id}", 15, "bold", "#283593"),
        _text(x + NUMA_W - PAD, y + 24, f"{size(info.memory)} memory", 12, anchor="end"),
        _text(x + PAD, y + 44, f"CPUs {format_cpulist(info.cpus) or '-'}", 11, fill="#455a64"),
    ]
    # CPU grid: one square per logical CPU, coloured by socket, darker for first threads.
    cy = y + 54
    per_row = 32
    cell = (NUMA_W - 2 * PAD) / per_row
    cpus = [c for c in node.cpus if c.numa_node == numa_id]
    for k, cpu in enumerate(cpus):
        cx = x + PAD + (k % per_row) * cell
        ry = cy + (k // per_row) * cell
        fill = "#7986cb" if cpu.thread == 0 else "#c5cae9"
        out.append(
            f'<rect x="{cx:.1f}" y="{ry:.1f}" width="{cell - 2:.1f}" height="{cell - 2:.1f}" '
            f'fill="{fill}"><title>cpu{cpu.id} socket {cpu.socket} core {cpu.core} '
            f'thread {cpu.thread}</title></rect>'
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
        out.append(
            f'<g class="device" data-device="{escape(d.id)}" data-kind="{d.kind}" '
            f'data-numa="{numa_id}" data-health="{view.health}">'
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
                 title: str = "") -> str:
    """One picture of every node; ``views`` maps node name -> device id -> DeviceView."""
    views = views or {}
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
                                   views.get(node.name, {})))
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
    height = legend_y + 30
    width = max(width, lx + 230 + 170)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}">\n'
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

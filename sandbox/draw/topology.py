"""``topology_svg``: nodes, NUMA nodes, CPUs, PCI spine, devices, health, allocations and
the kubelet's extended resources, packed into a 16:9 frame."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from sandbox.draw.svg import (
    ASCENT,
    CELL,
    COLORS,
    DESCENT,
    DEV_GAP,
    DEV_INDENT,
    DEV_MAX_W,
    DISC,
    GAP,
    GREY,
    HELD,
    IN_USE,
    INK,
    KIND_ICON,
    MARGIN,
    NODE_GAP,
    NUMA_GAP,
    NUMA_MIN_W,
    PAD,
    T_BODY,
    T_ID,
    T_NODE,
    T_NUMA,
    T_SMALL,
    T_TITLE,
    attr,
    below,
    box,
    document,
    fit,
    rect,
    text,
    text_width,
)
from sandbox.draw.views import DeviceView, NodeView, device_detail, vf_counts
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.spec import DeviceSpec, NodeSpec
from sandbox.textui import size


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
        return cls(d, view, label, device_detail(d, view), tuple(badges))

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
        y2 = below(y1, T_ID, T_SMALL)
        texts = [text(x + 10, y1, d.id, T_ID, "bold", stroke),
                 text(tx, y1, fit(self.label, T_BODY, right - mark - tx), T_BODY),
                 text(tx, y2, d.address, T_SMALL, fill=GREY)]
        end = tx + text_width(d.address, T_SMALL)
        detail = fit(self.detail, T_SMALL, right - end - GAP)
        if detail:
            texts.append(text(end + GAP, y2, detail, T_SMALL, fill=GREY))
            end += GAP + text_width(detail, T_SMALL)
        # Badges right-aligned: after the detail where they fit, else on lines of their own.
        lines: list[list[tuple[str, str]]] = [[]]
        room = right - end - GAP
        for badge, colour in self.badges:
            need = text_width(badge, T_SMALL, True) + (GAP if lines[-1] else 0)
            if need > room:
                lines.append([])
                room = right - tx
                badge = fit(badge, T_SMALL, room, bold=True)
                need = text_width(badge, T_SMALL, True)
            lines[-1].append((badge, colour))
            room -= need
        yb = y2
        for k, line in enumerate(lines):
            if k:
                yb = below(yb, T_SMALL, T_SMALL)
            bx = right
            for badge, colour in reversed(line):
                texts.append(text(bx, yb, badge, T_SMALL, "bold", colour, "end"))
                bx -= text_width(badge, T_SMALL, True) + GAP
        h = yb + DESCENT * T_SMALL + 8 - y
        pods = (f' data-pod-unhealthy="{attr(view.pod_unhealthy)}"'
                if view.pod_unhealthy else "")
        vfs = vf_counts(d, view)
        vf_attr = f' data-vfs="{",".join(map(str, vfs))}"' if vfs is not None else ""
        dash = ' stroke-dasharray="5,4"' if view.health in ("unplugged", "unknown") else ""
        out = [f'<g class="device" data-device="{attr(d.id)}" data-kind="{d.kind}" '
               f'data-numa="{numa_id}" data-health="{view.health}"{pods}{vf_attr}>',
               box(x, y, w, h, fill, stroke, 5, dash), *texts]
        if view.pod_unhealthy:  # a red "!" disc at the right of the first line
            cx, cy = x + w - 16, y1 - 5
            out.append(f'<circle class="pod-unhealthy" cx="{cx:.1f}" cy="{cy:.1f}" r="8" '
                       f'fill="{COLORS["unhealthy"][1]}"><title>'
                       f'{escape(f"Unhealthy in the status of {view.pod_unhealthy}")}'
                       '</title></circle>')
            out.append(text(cx, cy + 5, "!", T_SMALL, "bold", "#ffffff", "middle"))
        out.append("</g>")
        return out, h


NO_NUMA = -1  # the box of the devices without NUMA affinity (sysfs numa_node -1)


def _numa_title(node: NodeSpec, numa_id: int) -> tuple[str, str]:
    """A NUMA box's title and its memory text (none for the no-affinity box)."""
    if numa_id == NO_NUMA:
        return "no NUMA affinity", ""
    return f"NUMA node {numa_id}", f"{size(node.numa[numa_id].memory)} memory"


def _numa_width(node: NodeSpec, numa_id: int, dev_w: float) -> float:
    title, memory = _numa_title(node, numa_id)
    head = text_width(title, T_NUMA, True) + 2 * GAP + text_width(memory, T_BODY)
    cpus = sum(1 for c in node.cpus if c.numa_node == numa_id)
    return max(NUMA_MIN_W, 2 * PAD + head, 2 * PAD + min(cpus, 16) * CELL,
               PAD + DEV_INDENT + dev_w + PAD)


def _draw_numa(node: NodeSpec, numa_id: int, devices: Sequence[_Device], x: float, y: float,
               w: float, h: float, id_w: float, dev_w: float, held: Mapping[int, str]
               ) -> tuple[list[str], float]:
    """One NUMA node's box at (x, y), ``w`` by ``h`` (0: as tall as it needs); its height.
    ``NO_NUMA``: the devices without NUMA affinity, local to every CPU, no CPU grid."""
    inner = w - 2 * PAD
    yh = y + 10 + ASCENT * T_NUMA
    title, memory = _numa_title(node, numa_id)
    out = [text(x + PAD, yh, title, T_NUMA, "bold", "#283593"),
           text(x + w - PAD, yh, memory, T_BODY, anchor="end")]
    yc = below(yh, T_NUMA, T_SMALL)
    local = (f"local CPUs: all ({format_cpulist(c.id for c in node.cpus)})"
             if numa_id == NO_NUMA else f"CPUs {format_cpulist(node.numa[numa_id].cpus) or '-'}")
    out.append(text(x + PAD, yc, fit(local, T_SMALL, inner), T_SMALL, fill=GREY))
    # CPU grid: one square per logical CPU, darker for first threads; orange: held by a
    # container (exclusive CPUs, from the kubelet). Rows of equal length.
    cpus = [c for c in node.cpus if c.numa_node == numa_id] if numa_id != NO_NUMA else []
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
            extra = f' class="cpu-held" data-cpu="{cpu.id}" data-held="{attr(holder)}"'
        out.append(
            f'<rect x="{cx:.1f}" y="{cy:.1f}" width="{CELL - 2}" height="{CELL - 2}" '
            f'fill="{fill}"{extra}><title>cpu{cpu.id} socket {cpu.socket} core {cpu.core} '
            f'thread {cpu.thread}{escape(f" held by {holder}") if holder else ""}'
            '</title></rect>'
        )
    yp = top + rows * CELL + 6 + ASCENT * T_SMALL
    bridges = sorted({d.spec.functions[0].host_bridge for d in devices})
    out.append(text(x + PAD, yp, fit("PCI " + (", ".join(bridges) or "(no devices)"),
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
            box(x, y, w, height, "#f3f6fb", "#3f51b5"), *out, "</g>"], height


def _draw_resources(view: NodeView, x: float, y: float) -> tuple[list[str], float, float]:
    """The kubelet's extended resources as a table at (x, y): capacity, allocatable (red
    where below capacity), healthy devices per NUMA node; its parts, width and height."""
    if not view.resources:
        note = "no extended resources advertised"
        w = 2 * GAP + text_width(note, T_SMALL)
        h = 2 * 8 + (ASCENT + DESCENT) * T_SMALL
        return ['<g class="resources">', box(x, y, w, h, "#fafafa", "#b0bec5", 4),
                text(x + GAP, y + 8 + ASCENT * T_SMALL, note, T_SMALL, fill=GREY),
                "</g>"], w, h
    numas = sorted({k for r in view.resources for k in r.healthy_by_numa})
    head = ["resource", "capacity", "allocatable",
            *(f"healthy NUMA {k}" if k >= 0 else "healthy, no NUMA" for k in numas)]
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
    out += [text(lefts[0], yh, head[0], T_SMALL, "bold", GREY)]
    out += [text(lefts[i] + widths[i], yh, head[i], T_SMALL, "bold", GREY, "end")
            for i in range(1, len(head))]
    yr, above = yh, float(T_SMALL)
    for r, row in zip(view.resources, rows, strict=True):
        yr = below(yr, above, T_BODY, 4)
        above = T_BODY
        short = r.allocatable < r.capacity
        healthy = ",".join(f"{k}:{r.healthy_by_numa.get(k, 0)}" for k in numas)
        out.append(f'<g class="resource" data-resource="{attr(r.name)}" '
                   f'data-capacity="{r.capacity}" data-allocatable="{r.allocatable}" '
                   f'data-healthy="{healthy}">')
        out.append(text(lefts[0], yr, row[0], T_BODY))
        for i in range(1, len(row)):
            bold, fill = (i == 2), (COLORS["unhealthy"][1] if i == 2 and short else INK)
            out.append(text(lefts[i] + widths[i], yr, row[i], T_BODY,
                             "bold" if bold else "normal", fill, "end"))
        out.append("</g>")
    h = yr + DESCENT * T_BODY + 8 - y
    out[1] = box(x, y, w, h, "#fafafa", "#b0bec5", 4)
    out.append("</g>")
    return out, w, h


def _draw_node(node: NodeSpec, views: Mapping[str, DeviceView], held: Mapping[int, str],
               live: NodeView | None) -> tuple[list[str], float, float]:
    """One node's box with its top left corner at (0, 0); its parts, width and height."""
    numa_ids = [n.id for n in node.numa]
    if any(d.numa_node == NO_NUMA for d in node.devices):
        numa_ids.append(NO_NUMA)
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
    out = [text(PAD, yt, title, T_NODE, "bold")]
    if state:
        out.append(text(PAD + text_width(title, T_NODE, True) + GAP, yt, state[0], T_BODY,
                         "bold", state[1]))
    ys = below(yt, T_NODE, T_SMALL)
    out.append(text(PAD, ys, specs, T_SMALL, fill=GREY))
    for note in live.notes if live else ():
        ys = below(ys, T_SMALL, T_SMALL)
        out.append(text(PAD, ys, fit(f"! {note}", T_SMALL, inner), T_SMALL,
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
        if i and k != NO_NUMA:
            ly = top + 30
            d = node.numa[k].distances[numa_ids[i - 1]]
            out.append(f'<line x1="{nx - NUMA_GAP:.1f}" y1="{ly:.1f}" x2="{nx:.1f}" '
                       f'y2="{ly:.1f}" stroke="#3f51b5" stroke-width="2" '
                       'stroke-dasharray="4,3"/>')
            out.append(text(nx - NUMA_GAP / 2, ly - 6, f"{d}", T_SMALL, "bold", "#3f51b5",
                             "middle"))
    h = top + max(heights) + PAD
    return [box(0, 0, w, h, "#ffffff", "#263238", 10), *out], w, h


Icon = Callable[[float, float], list[str]]  # draws a 14 px icon with its top left at (x, y)


def _swatch(fill: str, stroke: str, dash: str = "") -> Icon:
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return lambda x, y: [rect(x, y, 14, 14, fill, stroke, 3, extra)]


def _legend_items(nodes: Sequence[NodeSpec], views: Mapping[str, Mapping[str, DeviceView]],
                  cpus: Mapping[str, Mapping[int, str]]) -> list[tuple[Icon, str]]:
    shown = {v.health for node_views in views.values() for v in node_views.values()}
    items = [(_swatch(*COLORS[h], "4,3" if h == "unplugged" else ""), h)
             for h in ("healthy", "unhealthy", "unplugged")]
    if "unknown" in shown:
        items.append((_swatch(*COLORS["unknown"], "4,3"), "state unknown (no answer)"))
    items.append((lambda x, y: [rect(x, y, 6, 14, "#7986cb", "none", 1),
                                rect(x + 8, y, 6, 14, "#c5cae9", "none", 1)],
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
                                    text(x + 7, y + 12, "!", T_SMALL, "bold", "#ffffff",
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
        label = fit(label, T_SMALL, width - 20)
        need = 20 + text_width(label, T_SMALL)
        if cx > x and cx + need > x + width:
            cx, base = x, below(base, T_SMALL, T_SMALL, 10)
        out += icon(cx, base - 12)
        out.append(text(cx + 20, base, label, T_SMALL, fill=GREY))
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
        parts.append(text(x0, y0 + ASCENT * T_TITLE, title, T_TITLE, "bold"))
    body = y0 + title_h
    bottom = body
    for node, (nparts, _, h), (x, y) in zip(nodes, drawn, at, strict=True):
        parts.append(f'<g class="node" data-node="{attr(node.name)}" '
                     f'transform="translate({x0 + x:.1f},{body + y:.1f})">')
        parts += nparts
        parts.append("</g>")
        bottom = max(bottom, body + y + h)
    parts += _draw_legend(items, x0, bottom + 18, content_w)[0]
    return document(parts, frame_w, frame_h, scale)

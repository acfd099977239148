"""``claims_svg``: who holds which device or partition, and what is left (``sandbox dra
claims -o svg``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING

from sandbox.draw.svg import GAP, GREY, INK, PAD, attr, box, document, fit, rect, text, text_width

if TYPE_CHECKING:  # only `sandbox dra claims` needs them
    from sandbox.draclaims import Allocated, Left, Usage

CLAIMS_W = 900
BAR_W = 340
USED = "#ef6c00"  # the part of a counter or capacity that claims hold
FREE = "#c8e6c9"  # the part that is left
FULL = "#c62828"  # nothing left


def _holder(a: Allocated, x: float, y: float, right: float) -> list[str]:
    """Two lines: which pod holds it through which claim, then the device and what it takes."""
    who = f"pod {', '.join(a.pods)}" if a.pods else "reserved for no pod (yet)"
    who = fit(who, 13, right - x - 200, bold=True)
    cx = max(x + 300, x + text_width(who, 13, True) + 2 * GAP)
    takes = ", ".join(f"{k} {v}" for k, v in a.consumed)
    return [
        f'<g class="claim" data-claim="{attr(a.claim)}" data-pod="{attr(",".join(a.pods))}" '
        f'data-device="{attr(a.device)}" data-request="{attr(a.request)}">',
        text(x, y + 15, who, 13, "bold", "#1a237e"),
        text(cx, y + 15, fit(f"claim {a.claim} (request {a.request})", 12, right - cx), 12,
              fill="#37474f"),
        text(x + 14, y + 32, fit(a.device + (f": takes {takes}" if takes else ""), 12,
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
    shown = fit(title, 16, w - 32, bold=True)
    caption = fit(caption, 12, right - (x + 16 + text_width(shown, 16, True) + 2 * GAP))
    out = [f'<g class="card" data-owner="{attr(title)}">',
           box(x, y, w, height, "#ffffff", stroke, 8),
           text(x + 16, y + 26, shown, 16, "bold", INK),
           text(right, y + 26, caption, 12, fill="#546e7a", anchor="end")]
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
            f'<g class="left" data-owner="{attr(r.owner)}" data-name="{attr(r.name)}" '
            f'data-used="{quantity(r.used)}" data-left="{quantity(left)}" '
            f'data-total="{quantity(r.total)}">',
            text(x + 16, ry + 15, fit(r.name, 13, 190 - 16 - GAP), 13, fill="#37474f"),
            rect(bx, ry + 2, BAR_W, 16, FREE, "#90a4ae", 3),
        ]
        if used_w:
            out.append(rect(bx, ry + 2, used_w, 16, FULL if left <= 0 else USED, "none", 3))
        out += [text(lx, ry + 15, left_text, 13, "bold", FULL if left <= 0 else "#2e7d32"),
                text(of_x, ry + 15, fit(f"of {quantity(r.total)} ({quantity(r.used)} used)",
                                          12, right - of_x), 12, fill="#546e7a"),
                "</g>"]
        ry += 28
    ry += 8
    if not holders:
        out.append(text(x + 16, ry + 16, "free: no claim holds any of it", 13, fill="#2e7d32"))
    for a in holders:
        out += _holder(a, x + 16, ry, right)
        ry += 40
    out.append("</g>")
    return out, height


def claims_svg(use: Usage, title: str = "", scale: float | None = None) -> str:
    """The claims view of ``sandbox.draclaims.usage`` as a picture: per pool (node), one card per
    GPU counter set and per device with consumable capacity (a NIC's bandwidth), with a
    bar for each counter (what claims hold, what is left) and the pods and claims that
    hold its partitions or shares; then the devices allocated whole. ``data-*``
    attributes (claim, pod, device; owner, name, used, left, total) let tests read it.
    ``scale``: output pixels per user unit (None: ``fit_scale``)."""
    from sandbox.draclaims import quantity

    parts: list[str] = []
    y = 20.0
    if title:
        parts.append(text(PAD, 34, fit(title, 20, CLAIMS_W - 2 * PAD, True), 20, "bold"))
        y = 50.0
    held = len({a.claim for a in use.allocated})
    parts.append(text(PAD, y + 4, f"{held} claim(s) hold {len(use.allocated)} device(s)", 13,
                       fill=GREY))
    y += 20
    pools = sorted({r.pool for r in (*use.counters, *use.capacity)}
                   | {a.pool for a in use.allocated})
    for pool in pools:
        parts.append(text(PAD, y + 22, fit(f"pool {pool}", 17, CLAIMS_W - 2 * PAD, True), 17,
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
        parts.append(text(PAD, y + 24, "no ResourceSlices and no allocated claims", 14))
        y += 40
    legend_y = y + 4
    parts += [rect(PAD, legend_y, 14, 14, USED, "none", 3),
              text(PAD + 20, legend_y + 12, "held by claims", 12),
              rect(PAD + 140, legend_y, 14, 14, FREE, "#90a4ae", 3),
              text(PAD + 160, legend_y + 12, "left", 12),
              rect(PAD + 220, legend_y, 14, 14, FULL, "none", 3),
              text(PAD + 240, legend_y + 12, "nothing left", 12)]
    return document(parts, CLAIMS_W, legend_y + 30, scale)

"""The look of the pictures and the SVG they are written in: colours, sizes, the measured
text widths of DejaVu Sans (what librsvg will draw, measured before it does), the
primitives every picture is made of (text, boxes, the 16:9 document)."""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape

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


def fit(s: str, size_px: float, width: float, bold: bool = False) -> str:
    """``s``, cut with "…" where it is wider than ``width``."""
    if text_width(s, size_px, bold) <= width:
        return s
    while s and text_width(s + "…", size_px, bold) > width:
        s = s[:-1]
    return s.rstrip() + "…" if s else ""


def below(y: float, above: float, below: float, lead: float = LEAD) -> float:
    """The baseline of a ``below`` px line under a ``above`` px line at baseline ``y``."""
    return y + DESCENT * above + lead + ASCENT * below


def text(x: float, y: float, s: str, size_px: float = 12, weight: str = "normal",
          fill: str = INK, anchor: str = "start") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-family="{FONT}" font-size="{size_px:g}" '
        f'font-weight="{weight}" fill="{fill}" text-anchor="{anchor}">{escape(s)}</text>'
    )


def rect(x: float, y: float, w: float, h: float, fill: str, stroke: str, rx: int = 6,
          extra: str = "") -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx}" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="1.5"{extra}/>'
    )


def box(x: float, y: float, w: float, h: float, fill: str, stroke: str, rx: int = 6,
         extra: str = "") -> str:
    """The rectangle that holds the rest of its group: every text of the group is inside."""
    return rect(x, y, w, h, fill, stroke, rx, ' class="box"' + extra)


def attr(value: str) -> str:
    return escape(value, {'"': "&quot;"})


def fit_scale(width: float, height: float) -> float:
    """The default scale: as large as fits ``FRAME`` (1920x1080), never below 1."""
    return max(1.0, min(FRAME[0] / width, FRAME[1] / height))


def document(parts: Sequence[str], width: float, height: float,
              scale: float | None) -> str:
    s = fit_scale(width, height) if scale is None else scale
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * s:.0f}" '
        f'height="{height * s:.0f}" viewBox="0 0 {width:.0f} {height:.0f}">\n'
        f'<rect width="100%" height="100%" fill="#fafafa"/>\n' + "\n".join(parts) + "\n</svg>\n"
    )

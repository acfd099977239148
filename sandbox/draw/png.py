"""PNG output: an SVG rasterised by ``rsvg-convert`` (Debian: librsvg2-bin)."""

from __future__ import annotations

import shutil

from sandbox.commands import run
from sandbox.errors import SandboxError


def svg_to_png(svg: str) -> bytes:
    tool = shutil.which("rsvg-convert")
    if tool is None:
        raise SandboxError(
            "PNG output needs rsvg-convert: apt-get install librsvg2-bin (or use --output svg)"
        )
    return run([tool, "--format=png"], input=svg.encode(), timeout=None).stdout_bytes

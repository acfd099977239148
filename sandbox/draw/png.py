"""PNG output: an SVG rasterised by ``rsvg-convert`` (Debian: librsvg2-bin)."""

from __future__ import annotations

import shutil
import subprocess

from sandbox.errors import CommandError, SandboxError


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

"""Plain-text tables and sizes for terminal output (show, status, kubelet snapshots)."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "") -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in cells
    ]
    return "\n".join(lines)


def size(n: int) -> str:
    """Bytes as the largest binary unit that keeps it whole-ish: 256Gi, 1.5Ti, 512Mi."""
    for unit, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= factor:
            value = n / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


def dump(data: object, output: str) -> None:
    """``data`` on stdout as ``output`` says: "json" (indented) or "yaml" (keys in their
    order); mappings and tuples made plain first, anything else as its text."""
    import json
    import sys

    import yaml

    plain = json.loads(json.dumps(data, default=lambda o: dict(o) if hasattr(o, "keys")
                                  else str(o)))
    if output == "json":
        json.dump(plain, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        yaml.safe_dump(plain, sys.stdout, sort_keys=False)

"""The kernel's cpulist and cpumask text formats (Documentation/admin-guide/cputopology)."""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpulist(text: str, limit: int | None = None) -> list[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]; raises ValueError with a readable message.
    With ``limit``, any CPU number >= limit is an error found before anything is expanded
    (so ``0-999999999999`` costs nothing)."""
    cpus: list[int] = []
    text = text.strip()
    if not text:
        return cpus
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isascii() or not lo.isdigit() or (sep and not (hi.isascii() and hi.isdigit())):
            raise ValueError(f"{part!r} is not a CPU number or range (like 0-15,32)")
        if len(lo) > 9 or len(hi) > 9:
            raise ValueError(f"{part[:40]!r}: CPU number too large")
        start, end = int(lo), int(hi) if sep else int(lo)
        if end < start:
            raise ValueError(f"range {part!r} runs backwards")
        if limit is not None and end >= limit:
            have = f"0-{limit - 1}" if limit else "none"
            raise ValueError(f"CPU {max(start, limit)} does not exist (have {have})")
        cpus.extend(range(start, end + 1))
    return cpus


def format_cpulist(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``"0-3,8"`` (the kernel's form, no trailing newline)."""
    ordered = sorted(set(cpus))
    out: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def format_cpumask(cpus: Iterable[int], ncpus: int) -> str:
    """The kernel's hex mask: 32-bit words, comma-separated, most significant first."""
    mask = 0
    for cpu in cpus:
        mask |= 1 << cpu
    words = max(1, (ncpus + 31) // 32)
    return ",".join(f"{(mask >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))

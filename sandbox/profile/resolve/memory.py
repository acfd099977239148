"""Memory per NUMA node, hugepage pools and the NUMA distance matrix.

The node's total splits evenly across the NUMA nodes that don't state their own (16 GiB
each when the node states no total); sizes are rounded down to whole 4 KiB pages.
"""

from __future__ import annotations

from sandbox.profile import model
from sandbox.profile.spec import Loc, NumaInfo

Problems = list[tuple[Loc, str]]

LOCAL_DISTANCE, REMOTE_DISTANCE = 10, 21
DEFAULT_NUMA_MEMORY = 16 * 2**30


def _size(n: int) -> str:
    from sandbox.textui import size

    return size(n)


def split_memory(node: model.Node, entries: list[model.NumaNode], loc: Loc,
                 problems: Problems) -> list[int]:
    """Bytes of memory of each NUMA node."""
    stated = [n.memory for n in entries]
    if node.memory is None:
        total = sum(m for m in stated if m is not None) + DEFAULT_NUMA_MEMORY * stated.count(None)
    else:
        total = node.memory
    rest = total - sum(m for m in stated if m is not None)
    unstated = stated.count(None)
    if node.memory is not None:
        if unstated == 0 and rest != 0:
            problems.append(
                ((*loc, "memory"), f"total {_size(total)} differs from the NUMA nodes' sum "
                 f"{_size(total - rest)}")
            )
        elif rest < 0 or (unstated and rest < unstated * 2**20):
            problems.append(
                ((*loc, "memory"), "total memory is smaller than the NUMA nodes' memory")
            )
    mems = [m if m is not None else (rest // unstated if unstated else 0) for m in stated]
    return [m - m % 4096 for m in mems]


def _hugepage_kb(size: str) -> int | None:
    try:
        value = model.parse_quantity(size)
    except ValueError:
        return None
    if not isinstance(value, int) or value < 4096 or value % 1024:
        return None
    return value // 1024


def hugepages(entry: model.NumaNode, memory: int, kloc: Loc,
              problems: Problems) -> tuple[tuple[int, int], ...]:
    """(page size in kB, pages) of one NUMA node, by page size."""
    pages: list[tuple[int, int]] = []
    for size, pages_count in sorted(entry.hugepages.items()):
        kb = _hugepage_kb(size)
        if kb is None:
            problems.append(
                ((*kloc, "hugepages", size), f"{size!r} is not a page size (like 2Mi or 1Gi)")
            )
            continue
        pages.append((kb, pages_count))
    pages.sort()
    if sum(kb * 1024 * c for kb, c in pages) > memory:
        problems.append(((*kloc, "hugepages"), "hugepages exceed the NUMA node's memory"))
    return tuple(pages)


def distances(node: model.Node, count: int, loc: Loc, problems: Problems) -> list[list[int]]:
    """The SLIT matrix: the profile's (checked), or 10 local and 21 remote."""
    if node.numa.distances is None:
        return [[LOCAL_DISTANCE if a == b else REMOTE_DISTANCE for b in range(count)]
                for a in range(count)]
    dist_loc: Loc = (*loc, "numa", "distances")
    matrix = node.numa.distances
    if len(matrix) != count or any(len(row) != count for row in matrix):
        problems.append((dist_loc, f"must be a {count}x{count} matrix (one row per NUMA node)"))
        return matrix
    for a in range(count):
        for b in range(count):
            problem = _distance_problem(matrix, a, b)
            if problem:
                problems.append(((*dist_loc, a, b), problem))
    return matrix


def _distance_problem(matrix: list[list[int]], a: int, b: int) -> str | None:
    d = matrix[a][b]
    if a == b and d != LOCAL_DISTANCE:
        return f"local distance must be 10, got {d}"
    if a != b and not 11 <= d <= 254:
        return f"remote distance must be 11..254, got {d}"
    if a < b and matrix[b][a] != d:
        return f"matrix is not symmetric: [{a}][{b}]={d} but [{b}][{a}]={matrix[b][a]}"
    return None


def numa_nodes(node: model.Node, entries: list[model.NumaNode], cpu_of: dict[int, int],
               ncpus: int, loc: Loc, problems: Problems) -> tuple[tuple[NumaInfo, ...], int]:
    """Every NUMA node with its CPUs, memory, hugepages and distances; the total memory."""
    mems = split_memory(node, entries, loc, problems)
    numa: list[NumaInfo] = []
    for k, n in enumerate(entries):
        pages = hugepages(n, mems[k], (*loc, "numa", "nodes", k), problems)
        numa.append(
            NumaInfo(k, tuple(c for c in range(ncpus) if cpu_of.get(c) == k), mems[k], pages, ())
        )
    matrix = distances(node, len(entries), loc, problems)
    if len(problems) == 0:
        numa = [
            NumaInfo(n.id, n.cpus, n.memory, n.hugepages, tuple(matrix[n.id])) for n in numa
        ]
    return tuple(numa), sum(mems)

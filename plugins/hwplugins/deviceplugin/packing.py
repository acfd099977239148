"""GetPreferredAllocation's choice: pack a request onto as few NUMA nodes as possible.

Pure function over device ids and their NUMA nodes; the gRPC layer only adapts to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def pack(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    numa_of: Mapping[str, int | None],
) -> list[str]:
    """Pick ``size`` ids: all of ``must_include``, then whole NUMA nodes, fewest first.

    Nodes already used by ``must_include`` are filled first; after that, if one node can
    hold the rest, the smallest such node is used (keeps big nodes free for big requests),
    otherwise the fullest node is drained and the search repeats. Devices with no NUMA node
    come last. Returns fewer than ``size`` ids only when ``available`` is too small.
    """
    chosen = list(dict.fromkeys(must_include))
    taken = set(chosen)
    pools: dict[int | None, list[str]] = {}
    for dev in available:
        if dev not in taken:
            pools.setdefault(numa_of.get(dev), []).append(dev)
    for devs in pools.values():
        devs.sort()

    def take(node: int | None, count: int) -> None:
        got = pools[node][:count]
        pools[node] = pools[node][count:]
        chosen.extend(got)

    used = {numa_of.get(d) for d in chosen} - {None}
    for node in sorted(used, key=lambda n: -len(pools.get(n, []))):
        if node in pools:
            take(node, size - len(chosen))
    while len(chosen) < size:
        numa_nodes = [n for n, devs in pools.items() if n is not None and devs]
        if not numa_nodes:
            break
        need = size - len(chosen)
        fitting = [n for n in numa_nodes if len(pools[n]) >= need]
        if fitting:
            node = min(fitting, key=lambda n: (len(pools[n]), n))
        else:
            node = max(numa_nodes, key=lambda n: (len(pools[n]), -n))
        take(node, need)
    if len(chosen) < size and None in pools:
        take(None, size - len(chosen))
    return chosen[:size] if len(chosen) > size else chosen

"""TopologyManager, for the device manager alone: NUMA hints, policy merge, device choice.

Pure functions, following the kubelet's devicemanager (``generateDeviceTopologyHints``,
``filterByAffinity``, ``devicesToAllocate``) and topologymanager policies. Only one hint
provider exists here (devices), so merging is picking the best of its hints.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sandbox.errors import AllocationError, TopologyAffinityError


class Policy(enum.Enum):
    NONE = "none"
    BEST_EFFORT = "best-effort"
    RESTRICTED = "restricted"
    SINGLE_NUMA_NODE = "single-numa-node"


@dataclass(frozen=True)
class Hint:
    nodes: frozenset[int]
    preferred: bool

    def narrower_than(self, other: Hint) -> bool:
        """Fewer nodes, or as many but lower-numbered (bitmask IsNarrowerThan)."""
        if len(self.nodes) != len(other.nodes):
            return len(self.nodes) < len(other.nodes)
        return sorted(self.nodes) < sorted(other.nodes)


NumaOf = Mapping[str, tuple[int, ...]]  # device id -> its NUMA nodes (empty: none)


def device_hints(
    numa_nodes: Collection[int], all_devices: NumaOf, available: Iterable[str], request: int
) -> list[Hint] | None:
    """Hints for ``request`` devices; None when no device has NUMA info (no preference).

    A mask is a hint when enough AVAILABLE devices sit on it; it is preferred when its size
    is the smallest that could hold the request counting ALL devices (healthy or not, free
    or not), as the kubelet does.
    """
    if not any(all_devices.values()):
        return None
    avail = list(available)
    if len(avail) < request:
        return []
    nodes = sorted(numa_nodes)
    min_size = len(nodes)
    hints = []
    for size in range(1, len(nodes) + 1):
        for combo in itertools.combinations(nodes, size):
            mask = frozenset(combo)
            in_mask = sum(1 for n in all_devices.values() if mask.intersection(n))
            if in_mask >= request and size < min_size:
                min_size = size
            matching = sum(1 for d in avail if mask.intersection(all_devices.get(d, ())))
            if matching >= request:
                hints.append(Hint(mask, False))
    return [Hint(h.nodes, len(h.nodes) == min_size) for h in hints]


def admit(policy: Policy, hints: list[Hint] | None, numa_nodes: Collection[int]) -> Hint | None:
    """The merged hint the policy settles on; raises TopologyAffinityError to reject.

    Returns None for policy none (no TopologyManager). No hints at all means "don't care":
    every NUMA node, preferred.
    """
    if policy is Policy.NONE:
        return None
    everything = frozenset(numa_nodes)
    if hints is None:
        return Hint(everything, True)
    candidates = hints
    if policy is Policy.SINGLE_NUMA_NODE:
        candidates = [h for h in hints if h.preferred and len(h.nodes) == 1]
    best: Hint | None = None
    for hint in candidates:
        if best is None or (hint.preferred and not best.preferred):
            best = hint
        elif hint.preferred == best.preferred and hint.narrower_than(best):
            best = hint
    if best is None:
        best = Hint(everything, False)
    if policy in (Policy.RESTRICTED, Policy.SINGLE_NUMA_NODE) and not best.preferred:
        raise TopologyAffinityError(
            f"Resources cannot be allocated with Topology locality (policy {policy.value}: "
            f"no preferred NUMA affinity among hints {format_hints(hints)})"
        )
    return best


def format_hints(hints: Sequence[Hint] | None) -> str:
    """``[{0}*, {0,1}]``: NUMA masks, ``*`` marking preferred ones; ``none`` for no hints."""
    if hints is None:
        return "none"
    return (
        "["
        + ", ".join(
            f"{{{','.join(map(str, sorted(h.nodes)))}}}{'*' if h.preferred else ''}" for h in hints
        )
        + "]"
    )


Preferred = Callable[[list[str], list[str], int], list[str]]


def choose_devices(
    available: Sequence[str],
    needed: int,
    affinity: Hint | None,
    numa_of: NumaOf,
    preferred: Preferred | None,
) -> list[str]:
    """devicesToAllocate: aligned first, the plugin's preference where the kubelet asks."""
    allocated: list[str] = []

    def take_from(pool: Iterable[str]) -> bool:
        for dev in sorted(pool):
            if dev not in allocated:
                allocated.append(dev)
                if len(allocated) == needed:
                    return True
        return False

    if len(available) < needed:
        raise AllocationError(
            f"requested number of devices unavailable. Requested: {needed}, "
            f"Available: {len(available)}"
        )
    if affinity is None:
        aligned: list[str] = []
        unaligned: list[str] = []
        no_affinity = list(available)
    else:
        aligned = [d for d in available if affinity.nodes.intersection(numa_of.get(d, ()))]
        no_affinity = [d for d in available if not numa_of.get(d)]
        unaligned = [d for d in available if d not in aligned and d not in no_affinity]
    if needed < len(aligned):
        if preferred is not None:
            pick = preferred(sorted(set(aligned) | set(allocated)), list(allocated), needed)
            if take_from(set(pick) & set(aligned)):
                return allocated
        if take_from(aligned):
            return allocated
        raise AllocationError("unexpectedly allocated less resources than required")
    if take_from(aligned):
        return allocated
    if preferred is not None:
        pick = preferred(sorted(set(available) | set(allocated)), list(allocated), needed)
        if take_from(set(pick) & set(available)):
            return allocated
    if take_from(unaligned) or take_from(no_affinity):
        return allocated
    raise AllocationError(
        f"unexpectedly allocated less resources than required. Requested: {needed}, "
        f"Got: {len(allocated)}"
    )

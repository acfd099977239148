"""The kubelet's CPU, topology and memory manager settings of a node, checked against the
node's CPUs and NUMA nodes, with their defaults filled in.

The checks are the ones the kubelet makes at start (so a bad profile fails here, located,
not as a kubelet that exits): reserved CPUs and reserved memory name CPUs and NUMA nodes
the node has, options only go with the policy that takes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox.profile import model
from sandbox.profile.cpulist import format_cpulist, parse_cpulist
from sandbox.profile.spec import Loc, NumaInfo

Problems = list[tuple[Loc, str]]

MIB = 2**20
DEFAULT_RESERVED_CPUS = "0"  # the node's first CPU
DEFAULT_RESERVED_MEMORY = ((0, 512 * MIB),)  # (NUMA node, bytes)


@dataclass(frozen=True)
class KubeletSettings:
    """The ``NodeSpec`` fields of the same names."""

    topology_manager_policy: str
    topology_manager_scope: str
    topology_manager_policy_options: tuple[tuple[str, str], ...]
    cpu_manager_policy: str
    cpu_manager_policy_options: tuple[tuple[str, str], ...]
    reserved_system_cpus: str
    memory_manager_policy: str
    reserved_memory: tuple[tuple[int, int], ...]


def kubelet_settings(node: model.Node, ncpus: int, numa: tuple[NumaInfo, ...], loc: Loc,
                     problems: Problems) -> KubeletSettings:
    k = node.kubelet
    kloc: Loc = (*loc, "kubelet")
    topology_options = _options(k.topology_manager_policy_options)
    given = k.topology_manager_policy_options
    allowed = given.max_allowable_numa_nodes if given is not None else None
    if allowed is not None and k.topology_manager_policy != "none" and allowed < len(numa):
        problems.append(((*kloc, "topologyManagerPolicyOptions", "max-allowable-numa-nodes"),
                         f"{allowed} is less than the node's {len(numa)} NUMA nodes (the "
                         f"kubelet refuses such a node)"))
    cpu_options = _options(k.cpu_manager_policy_options)
    cpu_policy = _cpu_policy(k, ncpus)
    reserved_cpus = ""
    if cpu_policy == "none":
        # The none policy refuses any option; reservedSystemCPUs would be dropped silently.
        if cpu_options:
            problems.append(((*kloc, "cpuManagerPolicyOptions"),
                             "only used with cpuManagerPolicy static"))
        if k.reserved_system_cpus is not None:
            problems.append(((*kloc, "reservedSystemCPUs"),
                             "only used with cpuManagerPolicy static"))
    else:
        reserved_cpus = _reserved_cpus(k, ncpus, kloc, problems)
    reserved_memory: tuple[tuple[int, int], ...] = ()
    if k.memory_manager_policy == "None":
        if k.reserved_memory is not None:
            problems.append(((*kloc, "reservedMemory"),
                             "only used with memoryManagerPolicy Static"))
    elif k.reserved_memory is None:
        reserved_memory = DEFAULT_RESERVED_MEMORY
    else:
        reserved_memory = _reserved_memory(k.reserved_memory, numa, kloc, problems)
    return KubeletSettings(
        topology_manager_policy=k.topology_manager_policy,
        topology_manager_scope=k.topology_manager_scope,
        topology_manager_policy_options=topology_options,
        cpu_manager_policy=cpu_policy,
        cpu_manager_policy_options=cpu_options,
        reserved_system_cpus=reserved_cpus,
        memory_manager_policy=k.memory_manager_policy,
        reserved_memory=reserved_memory,
    )


def _cpu_policy(k: model.Kubelet, ncpus: int) -> str:
    """The CPU manager policy: the profile's, static by default, but none on a node of one
    CPU that states no CPU manager setting: static would have to reserve its only CPU, and
    none is safe there (the kubepods cpuset the kubelet then writes is CPU 0, which every
    host has)."""
    stated = {"cpu_manager_policy", "cpu_manager_policy_options",
              "reserved_system_cpus"} & k.model_fields_set
    if ncpus == 1 and not stated:
        return "none"
    return k.cpu_manager_policy


def _options(given: model.Strict | None) -> tuple[tuple[str, str], ...]:
    """The options given, by the kubelet's names, valued as the kubelet reads them."""
    if given is None:
        return ()
    values = given.model_dump(by_alias=True, exclude_none=True)
    return tuple(sorted((name, str(v).lower() if isinstance(v, bool) else str(v))
                        for name, v in values.items()))


def _reserved_cpus(k: model.Kubelet, ncpus: int, kloc: Loc, problems: Problems) -> str:
    """The static policy's reserved CPUs as a canonical cpulist; "" after a problem."""
    at: Loc = (*kloc, "reservedSystemCPUs")
    text = k.reserved_system_cpus if k.reserved_system_cpus is not None else (
        DEFAULT_RESERVED_CPUS)
    try:
        # bounded by ncpus (no range past the node is expanded) and by the field's length
        cpus = set(parse_cpulist(text, ncpus))
    except ValueError as exc:
        problems.append((at, str(exc)))
        return ""
    if not cpus:
        # cpu_manager.go: "the static policy requires systemreserved.cpu + kubereserved.cpu
        # to be greater than zero"
        problems.append((at, "names no CPU; the static policy needs at least one reserved"))
        return ""
    if len(cpus) == ncpus:
        if k.reserved_system_cpus is None:  # static stated on a node of one CPU
            problems.append(((*kloc, "cpuManagerPolicy"), "static reserves a CPU and the "
                             "node has only one; use cpuManagerPolicy none"))
        else:
            every = format_cpulist(range(ncpus))
            problems.append((at, f"reserves every CPU of the node ({every}); leave at least "
                             f"one for pods"))
        return ""
    return format_cpulist(cpus)


def _reserved_memory(entries: list[model.ReservedMemory], numa: tuple[NumaInfo, ...],
                     kloc: Loc, problems: Problems) -> tuple[tuple[int, int], ...]:
    """(NUMA node, bytes) by NUMA node, each checked against the node's NUMA nodes."""
    at: Loc = (*kloc, "reservedMemory")
    if not entries:
        # policy_static.go: the Static policy refuses a total reservation of 0
        problems.append((at, "the Static policy needs memory reserved on at least one NUMA "
                             "node"))
        return ()
    have = ", ".join(str(n.id) for n in numa)
    seen: dict[int, int] = {}
    out: list[tuple[int, int]] = []
    for i, entry in enumerate(entries):
        if entry.numa_node >= len(numa):
            problems.append(((*at, i, "numaNode"),
                             f"no NUMA node {entry.numa_node} (have {have})"))
            continue
        if entry.numa_node in seen:
            problems.append(((*at, i, "numaNode"), f"NUMA node {entry.numa_node} is already "
                             f"reserved by reservedMemory[{seen[entry.numa_node]}]"))
            continue
        seen[entry.numa_node] = i
        if entry.memory == 0 or entry.memory % MIB:
            problems.append(((*at, i, "memory"), f"must be a whole number of MiB above 0 "
                             f"(like 512Mi or 1Gi), got {entry.memory} bytes"))
            continue
        numa_memory = numa[entry.numa_node].memory
        if entry.memory > numa_memory:
            problems.append(((*at, i, "memory"), f"{entry.memory // MIB}Mi is more than NUMA "
                             f"node {entry.numa_node}'s memory ({numa_memory // MIB}Mi)"))
            continue
        out.append((entry.numa_node, entry.memory))
    return tuple(sorted(out))

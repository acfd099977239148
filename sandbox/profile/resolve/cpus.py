"""Logical CPUs and which NUMA node each belongs to.

Linux's usual enumeration on x86: all first threads of every core, socket by socket, then
all second threads, so cpuN and cpuN+cores are hyperthread siblings. NUMA nodes take the
CPUs the profile lists, or else an even split of sockets (or of the cores of a socket).
"""

from __future__ import annotations

from sandbox.profile import model
from sandbox.profile.cpulist import parse_cpulist
from sandbox.profile.resolve import limits
from sandbox.profile.spec import Loc, LogicalCpu

Problems = list[tuple[Loc, str]]
Layout = list[tuple[int, int, int, int]]  # (cpu id, socket, core, thread), by cpu id


def cpu_layout(node: model.Node, loc: Loc, problems: Problems) -> Layout | None:
    """Every logical CPU's (id, socket, core, thread); None (a problem) past the limit."""
    cpu = node.cpu
    ncores = cpu.sockets * cpu.cores_per_socket
    ncpus = ncores * cpu.threads_per_core
    if ncpus > limits.MAX_CPUS:
        problems.append(((*loc, "cpu"), f"{cpu.sockets} x {cpu.cores_per_socket} x "
                         f"{cpu.threads_per_core} = {ncpus} logical CPUs; at most "
                         f"{limits.MAX_CPUS}"))
        return None
    layout = [
        (t * ncores + s * cpu.cores_per_socket + c, s, c, t)
        for t in range(cpu.threads_per_core)
        for s in range(cpu.sockets)
        for c in range(cpu.cores_per_socket)
    ]
    layout.sort()
    return layout


def numa_entries(node: model.Node) -> list[model.NumaNode]:
    """The profile's NUMA nodes, or one per socket."""
    return node.numa.nodes or [model.NumaNode(id=s, cpus=None) for s in range(node.cpu.sockets)]


def assign_cpus(node: model.Node, entries: list[model.NumaNode], layout: Layout, loc: Loc,
                problems: Problems) -> dict[int, int]:
    """cpu id -> NUMA node, checking the NUMA node ids and CPU lists."""
    numa_loc: Loc = (*loc, "numa", "nodes")
    for k, n in enumerate(entries):
        if n.id != k:
            problems.append(
                ((*numa_loc, k, "id"),
                 f"NUMA node ids must be 0..{len(entries) - 1} in order, got {n.id}")
            )
    given = [n.cpus is not None for n in entries]
    if any(given) and not all(given):
        k = given.index(False)
        problems.append(((*numa_loc, k), "cpus must be given for every NUMA node or for none"))
        return {}
    if all(given):
        return _given_cpus(entries, len(layout), numa_loc, problems)
    return _derived_cpus(node.cpu, len(entries), layout, numa_loc, problems)


def _given_cpus(entries: list[model.NumaNode], ncpus: int, numa_loc: Loc,
                problems: Problems) -> dict[int, int]:
    cpu_of: dict[int, int] = {}
    for k, n in enumerate(entries):
        assert n.cpus is not None
        try:
            listed = parse_cpulist(n.cpus, ncpus)
        except ValueError as exc:
            problems.append(((*numa_loc, k, "cpus"), str(exc)))
            continue
        for c in listed:
            if c >= ncpus:
                problems.append(
                    ((*numa_loc, k, "cpus"), f"CPU {c} does not exist (have 0-{ncpus - 1})")
                )
                break
            if c in cpu_of:
                problems.append(
                    ((*numa_loc, k, "cpus"), f"CPU {c} is already in NUMA node {cpu_of[c]}")
                )
                break
            cpu_of[c] = k
    missing = [c for c in range(ncpus) if c not in cpu_of]
    if missing and len(problems) == 0:
        problems.append(((*numa_loc,), f"CPUs {missing[0]}.. belong to no NUMA node"))
    return cpu_of


def _derived_cpus(cpu: model.Cpu, count: int, layout: Layout, numa_loc: Loc,
                  problems: Problems) -> dict[int, int]:
    cpu_of: dict[int, int] = {}
    if count % cpu.sockets == 0:
        per_socket = count // cpu.sockets
        if cpu.cores_per_socket % per_socket:
            problems.append(
                (numa_loc, f"{cpu.cores_per_socket} cores per socket do not split evenly "
                 f"into {per_socket} NUMA nodes per socket; give cpus")
            )
        else:
            chunk = cpu.cores_per_socket // per_socket
            for cid, s, c, _t in layout:
                cpu_of[cid] = s * per_socket + c // chunk
    elif cpu.sockets % count == 0:
        group = cpu.sockets // count
        for cid, s, _c, _t in layout:
            cpu_of[cid] = s // group
    else:
        problems.append(
            (numa_loc, f"cannot derive CPUs for {count} NUMA nodes from "
             f"{cpu.sockets} sockets; give cpus")
        )
    return cpu_of


def logical_cpus(layout: Layout, cpu_of: dict[int, int]) -> tuple[LogicalCpu, ...]:
    return tuple(LogicalCpu(cid, s, c, t, cpu_of.get(cid, 0)) for cid, s, c, t in layout)

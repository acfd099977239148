"""From a profile as written to a fully defaulted cluster description (``spec``).

``resolve(profile)`` checks every cross-field rule and fills every default
deterministically, one concern per module:

    cpus      logical CPU numbering, which NUMA node each CPU belongs to
    memory    memory per NUMA node, hugepages, NUMA distances
    devices   catalogue models with the profile's overrides; kernel minors
    pci       host bridges, root and switch ports, bus numbers, addresses, IOMMU groups
    pcitree   the complete PCI tree: VFs, sysfs paths, bridge bus ranges, port types
    replicas  per-replica identities: serials, UUIDs, MACs, GUIDs, netdev names
    kubelet   the kubelet's CPU, topology and memory manager settings against the node
    limits    what one node and one profile may hold

The result is the frozen dataclasses of ``sandbox.profile.spec``. Every problem is
collected (with the field path it belongs to) and raised together as ``ResolveFailed``.

``check_device(device, loc)`` runs only the checks that read nothing but one device entry
(its catalogue model, SR-IOV, partitions...): what the loader still checks of a device
whose node entry did not validate, and so cannot be resolved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sandbox.profile import model
from sandbox.profile.resolve import cpus, limits, memory, system
from sandbox.profile.resolve.devices import Draft, device_model
from sandbox.profile.resolve.kubelet import kubelet_settings
from sandbox.profile.resolve.pci import PciPlanner
from sandbox.profile.resolve.pcitree import plan_tree
from sandbox.profile.resolve.replicas import replica
from sandbox.profile.spec import Cluster, CpuSpec, Loc, NodeSpec

__all__ = ["ResolveFailed", "check_device", "resolve"]

Problems = list[tuple[Loc, str]]


class ResolveFailed(Exception):
    def __init__(self, problems: Sequence[tuple[Loc, str]]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(m for _, m in self.problems))


def resolve(profile: model.Profile, origin: Callable[[Loc], Loc] | None = None) -> Cluster:
    """``origin`` maps a field path of ``profile`` to the document's, where they differ:
    the loader resolves the parts of a document that validated, renumbered."""
    where = origin or (lambda loc: loc)
    problems: Problems = []
    nodes: list[NodeSpec] = []
    seen_names: dict[str, int] = {}
    for i, node in enumerate(profile.nodes):
        loc: Loc = ("nodes", i)
        if node.name in seen_names:
            problems.append(
                ((*loc, "name"),
                 f"duplicate node name {node.name!r} (also "
                 f"nodes[{where(('nodes', seen_names[node.name]))[1]}])")
            )
        seen_names.setdefault(node.name, i)
        nodes += _replicas(profile.metadata.name, node, loc, problems)
    replicas = sum(node.count for node in profile.nodes)
    if replicas > limits.MAX_NODES:
        problems.append((("nodes",), f"{replicas} nodes (replicas included); at most "
                                     f"{limits.MAX_NODES}"))
    seen_replicas: set[str] = set()
    for n in nodes:
        if n.name in seen_replicas and not problems:
            i = next(k for k, m in enumerate(profile.nodes) if m.name == n.base_name)
            problems.append(
                (("nodes", i, "name"), f"replica name {n.name!r} clashes with another node")
            )
        seen_replicas.add(n.name)
    if problems:
        raise ResolveFailed([(where(loc), message) for loc, message in problems])
    return Cluster(profile.metadata.name, profile.metadata.description, tuple(nodes))


def check_device(device: model.Device, loc: Loc) -> Problems:
    problems: Problems = []
    device_model(device, loc, problems)
    return problems


def _replicas(profile_name: str, node: model.Node, loc: Loc,
              problems: Problems) -> list[NodeSpec]:
    """Every replica of one node entry; none when the entry has a problem."""
    before = len(problems)
    resolved = _resolve_node(node, loc, problems)
    if resolved is None or len(problems) > before:
        return []
    template, drafts = resolved
    first = replica(profile_name, node, template, drafts, 0)
    size_problem = _too_big(first)
    if size_problem:
        problems.append(((*loc, "devices"), size_problem))
        return []
    return [first] + [replica(profile_name, node, template, drafts, r)
                      for r in range(1, node.count)]


def _too_big(node: NodeSpec) -> str | None:
    """Why a resolved node is past the devices or PCI functions limit, or None."""
    if len(node.devices) > limits.MAX_DEVICES:
        return f"{len(node.devices)} devices on one node; at most {limits.MAX_DEVICES}"
    functions = 0
    for d in node.devices:
        functions += len(d.functions)
        if d.gpu is not None:
            functions += len(d.gpu.vf_addresses)
        if d.nic is not None:
            functions += sum(len(v) for v in d.nic.vf_addresses)
    if functions > limits.MAX_FUNCTIONS:
        return (f"{functions} PCI functions on one node (SR-IOV VFs included); at most "
                f"{limits.MAX_FUNCTIONS}")
    return None


def _resolve_node(
    node: model.Node, loc: Loc, problems: Problems
) -> tuple[NodeSpec, list[Draft]] | None:
    """The replica-independent part of a node entry (devices still drafts), or None."""
    layout = cpus.cpu_layout(node, loc, problems)
    if layout is None:
        return None
    entries = cpus.numa_entries(node)
    cpu_of = cpus.assign_cpus(node, entries, layout, loc, problems)
    numa, total = memory.numa_nodes(node, entries, cpu_of, len(layout), loc, problems)
    k = kubelet_settings(node, len(layout), numa, loc, problems)
    pci = PciPlanner(node, len(entries), loc, problems)
    devices = pci.place_devices()
    if devices is None:
        return None
    taken = {f.address for d in devices for f in d.functions}
    taken |= {a for d in devices if d.nic is not None for vfs in d.nic.vf_addresses for a in vfs}
    taken |= {a for d in devices if d.gpu is not None for a in d.gpu.vf_addresses}
    host = pci.root_complex(taken)
    tree = plan_tree(pci.bridges + ([host] if host is not None else []), devices)
    swap = system.swap_bytes(node, loc, problems)
    cpu = node.cpu
    return NodeSpec(
        name=node.name,
        base_name=node.name,
        index=0,
        role=node.role,
        labels=tuple(sorted(node.labels.items())),
        topology_manager_policy=k.topology_manager_policy,
        topology_manager_scope=k.topology_manager_scope,
        topology_manager_policy_options=k.topology_manager_policy_options,
        cpu_manager_policy=k.cpu_manager_policy,
        cpu_manager_policy_options=k.cpu_manager_policy_options,
        reserved_system_cpus=k.reserved_system_cpus,
        memory_manager_policy=k.memory_manager_policy,
        reserved_memory=k.reserved_memory,
        cpu=CpuSpec(cpu.sockets, cpu.cores_per_socket, cpu.threads_per_core, cpu.vendor,
                    cpu.model, cpu.family, cpu.model_number, cpu.mhz),
        cpus=cpus.logical_cpus(layout, cpu_of),
        numa=numa,
        memory=total,
        host_bridges=tuple(pci.host_bridges),
        pci=tree,
        devices=(),
        swap=swap,
    ), devices

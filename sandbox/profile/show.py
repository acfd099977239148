"""The human view of a resolved cluster (``sandbox show``); the machine views are the
fully defaulted profile (``defaults``) and the resolved spec (``spec``)."""

from __future__ import annotations

from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.model import NO_NUMA_NODE
from sandbox.profile.spec import Cluster, DeviceSpec, NodeSpec
from sandbox.textui import size, table


def describe_device(d: DeviceSpec) -> str:
    extra = ""
    if d.gpu is not None:
        extra = size(d.gpu.memory)
        if d.gpu.partitions:
            extra += f", partitions {'/'.join(p.name for p in d.gpu.partitions.profiles)}"
    elif d.nic is not None:
        extra = f"{d.nic.ports}x{d.nic.speed // 1000}G {d.nic.link_layer}"
        if d.nic.total_vfs:
            extra += f", VFs {d.nic.num_vfs}/{d.nic.total_vfs}"
        if d.nic.rdma:
            extra += ", RDMA"
    elif d.fpga is not None:
        extra = f"{d.fpga.flavor}, {d.fpga.ports} port(s)"
    elif d.generic is not None and d.generic.dev_nodes:
        extra = ", ".join("/dev/" + n.name for n in d.generic.dev_nodes)
    return extra


def kubelet_text(node: NodeSpec) -> str:
    """The kubelet's managers in one line: ``topology manager: single-numa-node/container;
    cpu manager: static (reserved 0); memory manager: None``."""

    def options(pairs: tuple[tuple[str, str], ...]) -> list[str]:
        return [f"{k}={v}" for k, v in pairs]

    topology = f"{node.topology_manager_policy}/{node.topology_manager_scope}"
    if node.topology_manager_policy_options:
        topology += f" ({', '.join(options(node.topology_manager_policy_options))})"
    cpu = node.cpu_manager_policy
    if node.cpu_manager_policy == "static":
        details = [f"reserved {node.reserved_system_cpus}",
                   *options(node.cpu_manager_policy_options)]
        cpu += f" ({'; '.join(details)})"
    mem = node.memory_manager_policy
    if node.reserved_memory:
        mem += " (reserved " + ", ".join(f"{size(b)} on NUMA {n}"
                                         for n, b in node.reserved_memory) + ")"
    return f"topology manager: {topology}; cpu manager: {cpu}; memory manager: {mem}"


def node_text(node: NodeSpec) -> str:
    c = node.cpu
    out = [
        f"node {node.name}  ({node.role}; {kubelet_text(node)})",
        f"  CPU     {c.sockets} socket(s) x {c.cores_per_socket} cores x {c.threads_per_core} "
        f"threads = {len(node.cpus)} CPUs, {c.vendor} {c.model}",
        f"  memory  {size(node.memory)} in {len(node.numa)} NUMA node(s)",
    ]
    if node.labels:
        out.append("  labels  " + ", ".join(f"{k}={v}" for k, v in node.labels))
    groups: list[tuple[int, str]] = []
    for numa in node.numa:
        pages = ", ".join(f"{kb}kB x {n}" for kb, n in numa.hugepages) or "none"
        groups.append((numa.id, f"  NUMA {numa.id}  CPUs {format_cpulist(numa.cpus) or '-'}  "
                       f"memory {size(numa.memory)}  hugepages {pages}  distances "
                       f"{list(numa.distances)}"))
    if any(d.numa_node == NO_NUMA_NODE for d in node.devices):
        groups.append((NO_NUMA_NODE, "  no NUMA affinity (numa_node -1)  local CPUs: all "
                       f"({format_cpulist(c.id for c in node.cpus)})"))
    for numa_id, head in groups:
        out.append("")
        out.append(head)
        rows = [
            (d.id, d.kind, d.model_name, describe_device(d), d.address,
             d.health + (f" ({d.health_reason})" if d.health != "healthy" else ""))
            for d in node.devices
            if d.numa_node == numa_id
        ]
        if rows:
            out.append(table(("ID", "TYPE", "MODEL", "DETAILS", "PCI ADDRESS", "HEALTH"),
                             rows, indent="    "))
        else:
            out.append("    (no devices)")
    return "\n".join(out)


def cluster_text(cluster: Cluster) -> str:
    head = f"profile {cluster.name}" + (f": {cluster.description}" if cluster.description else "")
    return "\n\n".join([head, *(node_text(n) for n in cluster.nodes)]) + "\n"

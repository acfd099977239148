"""The KubeletConfiguration (kubelet.config.k8s.io/v1beta1) keys of a node's CPU, topology
and memory managers, from its resolved spec; every runtime that starts a kubelet merges
them into its own configuration.

    topology_config(node, eviction_memory_mib) -> {"cpuManagerPolicy": ..., ...}

Why each key is as it is (the kubelet source facts are in docs/kubelet-topology-notes.md):

- ``cpuManagerPolicy`` is ``static`` unless the profile says otherwise: under ``none``
  the kubelet writes every CPU it knows into the kubepods cpuset itself
  (``node_container_manager_linux.go``), and emulated ids the host lacks make the kernel
  refuse that write (ERANGE), so the kubelet cannot start.
- ``reservedSystemCPUs`` is always set under ``static``: the static policy requires a
  non-zero CPU reservation ("the static policy requires systemreserved.cpu +
  kubereserved.cpu to be greater than zero", ``cpu_manager.go``); the kubelet turns the
  list into systemReserved cpu (``server.go``). The resolver checked that its CPUs exist.
  ``cpuManagerPolicyOptions`` only under ``static`` (the none policy refuses options).
- ``topologyManagerPolicyOptions`` gains ``max-allowable-numa-nodes`` = the node's NUMA
  node count when that is more than 8 and the policy is not ``none``: the topology
  manager refuses a machine with more than ``defaultMaxAllowableNUMANodes`` (8) otherwise.
- Under the memory manager's ``Static`` policy, ``reservedMemory`` must add up to exactly
  kubeReserved memory + systemReserved memory + evictionHard ``memory.available``
  (``validateReservedMemory``), so ``kubeReserved`` memory is set to the reservation less
  the caller's eviction threshold, and the caller sets no systemReserved memory. The
  threshold is the caller's: the native runtime's evictionHard has ``memory.available:
  100Mi``; kind's has none and, with mergeDefaultEvictionSettings off, its threshold is 0.
"""

from __future__ import annotations

from typing import Any

from sandbox.errors import RuntimeBackendError
from sandbox.profile.spec import NodeSpec

MAX_DEFAULT_NUMA_NODES = 8  # the topology manager's defaultMaxAllowableNUMANodes
MIB = 2**20


def topology_config(node: NodeSpec, eviction_memory_mib: int) -> dict[str, Any]:
    """The KubeletConfiguration keys of ``node``'s CPU, topology and memory managers, for
    a kubelet whose evictionHard ``memory.available`` is ``eviction_memory_mib`` MiB.
    RuntimeBackendError when the node's reserved memory is below that threshold."""
    out: dict[str, Any] = {"cpuManagerPolicy": node.cpu_manager_policy}
    if node.cpu_manager_policy == "static":
        if node.cpu_manager_policy_options:
            out["cpuManagerPolicyOptions"] = dict(node.cpu_manager_policy_options)
        out["reservedSystemCPUs"] = node.reserved_system_cpus
    out["topologyManagerPolicy"] = node.topology_manager_policy
    out["topologyManagerScope"] = node.topology_manager_scope
    topology_options = dict(node.topology_manager_policy_options)
    if (len(node.numa) > MAX_DEFAULT_NUMA_NODES and node.topology_manager_policy != "none"
            and "max-allowable-numa-nodes" not in topology_options):
        topology_options["max-allowable-numa-nodes"] = str(len(node.numa))
    if topology_options:
        out["topologyManagerPolicyOptions"] = dict(sorted(topology_options.items()))
    out["memoryManagerPolicy"] = node.memory_manager_policy
    if node.memory_manager_policy == "Static":
        total_mib = sum(b for _, b in node.reserved_memory) // MIB
        if total_mib < eviction_memory_mib:
            raise RuntimeBackendError(
                "kubelet config",
                f"node {node.name}: kubelet.reservedMemory adds up to {total_mib}Mi, less "
                f"than this runtime's eviction threshold (evictionHard memory.available "
                f"{eviction_memory_mib}Mi), which the memory manager's Static policy "
                f"counts in it; reserve at least {eviction_memory_mib}Mi in "
                f"kubelet.reservedMemory")
        out["reservedMemory"] = [{"numaNode": n, "limits": {"memory": f"{b // MIB}Mi"}}
                                 for n, b in node.reserved_memory]
        out["kubeReserved"] = {"memory": f"{total_mib - eviction_memory_mib}Mi"}
    return out

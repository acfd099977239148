"""The fully defaulted profile: a profile document that states every default the resolver
filled in (``sandbox show -o yaml|json``), as ``kubectl get -o yaml`` gives back an object
with the server's defaults in it.

    defaulted_profile(profile, cluster) -> dict   # apiVersion, kind, camelCase keys

The document validates and resolves to the same cluster as ``profile`` (tests compare
the resolved specs): every value stated is the resolved one, read from the first replica
of each node entry and the first device of each device entry. Left as written, because
stating them would change what they resolve to:

- ``pciAddresses``: a device at a given address sits on its host bridge's bus, one
  placed by the resolver behind a root port of its own;
- ``macBase``: derived per replica, not one base for all;
- ``kubelet`` policy options: some defaults depend on the node (the kubelet's
  ``max-allowable-numa-nodes``), and are the runtime's to fill in;
- ``afuIds`` of an FPGA whose catalogue model has none (Xilinx), ``sriov`` of a device
  that states none (a model without SR-IOV refuses the field).
"""

from __future__ import annotations

from typing import Any

from sandbox.profile import catalogue, model
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.resolve.devices import DEFAULT_NAMES
from sandbox.profile.spec import Cluster, DeviceSpec, NodeSpec

_UNITS = (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def quantity(nbytes: int) -> str | int:
    """Bytes as the profile writes them: ``80Gi`` where a binary unit divides, else bytes."""
    for unit, factor in _UNITS:
        if nbytes and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return nbytes


def _hex(value: int, digits: int) -> str:
    return f"0x{value:0{digits}x}"


def defaulted_profile(profile: model.Profile, cluster: Cluster) -> dict[str, Any]:
    """``profile`` (which resolved to ``cluster``) with every default stated."""
    nodes = []
    for i, node in enumerate(profile.nodes):
        spec = cluster.node(node.name, 0)
        assert spec is not None, f"{node.name}: not in the cluster resolved from the profile"
        nodes.append(_node(node, spec, i))
    return {
        "apiVersion": model.API_VERSION,
        "kind": model.KIND,
        "metadata": {"name": profile.metadata.name,
                     "description": profile.metadata.description},
        "nodes": nodes,
    }


def _node(node: model.Node, spec: NodeSpec, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": node.name,
        "count": node.count,
        "role": node.role,
        "labels": dict(node.labels),
        "kubelet": _kubelet(node.kubelet, spec),
        "cpu": node.cpu.model_dump(by_alias=True),
        "memory": quantity(spec.memory),
        "swap": quantity(spec.swap),
    }
    if spec.system is not None:
        s = spec.system
        out["system"] = {
            "vendor": s.sys_vendor, "product": s.product_name, "version": s.product_version,
            "board": {"vendor": s.board_vendor, "name": s.board_name,
                      "version": s.board_version},
            "bios": {"vendor": s.bios_vendor, "version": s.bios_version, "date": s.bios_date},
            "chassisType": s.chassis_type,
        }
    given_numa = node.numa.nodes or []
    out["numa"] = {
        "nodes": [
            {"id": n.id, "cpus": format_cpulist(n.cpus), "memory": quantity(n.memory),
             # as written: 2Mi and 2048Ki are two pools of one size to the resolver
             "hugepages": dict(given_numa[k].hugepages) if k < len(given_numa) else {}}
            for k, n in enumerate(spec.numa)
        ],
        "distances": [list(n.distances) for n in spec.numa],
    }
    out["pci"] = {
        # every host bridge, those the devices' given addresses add included, in the
        # resolver's order (a bridge's bus range ends below the next one's)
        "hostBridges": [{"domain": _hex(h.domain, 4), "bus": _hex(h.bus, 2),
                         "numaNode": numa_ref(h.numa_node)} for h in spec.host_bridges],
        "switches": [{**s.model_dump(by_alias=True), "numaNode": numa_ref(s.numa_node)}
                     for s in node.pci.switches],
    }
    host = next((f for f in spec.pci if f.class_code == catalogue.HOST_BRIDGE_CLASS), None)
    if host is not None:
        out["pci"]["rootComplex"] = {"vendorId": _hex(host.vendor_id, 4),
                                     "deviceId": _hex(host.device_id, 4)}
    first: dict[int, DeviceSpec] = {}
    for d in spec.devices:
        j = d.source[-1]
        if d.source[:-1] == ("nodes", i, "devices") and isinstance(j, int):
            first.setdefault(j, d)
    out["devices"] = [_device(dev, first[j]) for j, dev in enumerate(node.devices)]
    return out


def _kubelet(k: model.Kubelet, spec: NodeSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "topologyManagerPolicy": spec.topology_manager_policy,
        "topologyManagerScope": spec.topology_manager_scope,
    }
    if k.topology_manager_policy_options is not None:
        out["topologyManagerPolicyOptions"] = k.topology_manager_policy_options.model_dump(
            by_alias=True, exclude_none=True)
    out["cpuManagerPolicy"] = spec.cpu_manager_policy
    if spec.cpu_manager_policy == "static":
        if k.cpu_manager_policy_options is not None:
            out["cpuManagerPolicyOptions"] = k.cpu_manager_policy_options.model_dump(
                by_alias=True, exclude_none=True)
        out["reservedSystemCPUs"] = spec.reserved_system_cpus
    out["memoryManagerPolicy"] = spec.memory_manager_policy
    if spec.memory_manager_policy == "Static":
        out["reservedMemory"] = [{"numaNode": n, "memory": quantity(b)}
                                 for n, b in spec.reserved_memory]
    return out


def numa_ref(numa_node: int) -> int | str:
    """A NUMA node as the profile writes it: its id, or ``none`` for -1 (no affinity)."""
    return "none" if numa_node == model.NO_NUMA_NODE else numa_node


def _device(dev: model.Device, d: DeviceSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"type": dev.type}
    if not isinstance(dev, model.Generic):
        out["vendor"] = dev.vendor
    out["model"] = dev.model
    out["name"] = dev.name or DEFAULT_NAMES[dev.type]
    out["count"] = dev.count
    out["numaNode"] = numa_ref(dev.numa_node)
    if dev.pci_addresses is not None:
        out["pciAddresses"] = list(dev.pci_addresses)
    if dev.switch is not None:
        out["switch"] = dev.switch
    out["health"] = d.health
    if d.health_reason is not None:
        out["healthReason"] = d.health_reason
    if isinstance(dev, model.Gpu):
        assert d.gpu is not None
        out["memory"] = quantity(d.gpu.memory)
        if d.gpu.partitions is not None:
            p = d.gpu.partitions
            out["partitions"] = {
                "memorySlices": p.memory_slices, "computeSlices": p.compute_slices,
                "profiles": [{"name": q.name, "memorySlices": q.memory_slices,
                              "computeSlices": q.compute_slices, "memory": quantity(q.memory)}
                             for q in p.profiles],
                "modes": list(p.modes),
            }
        if dev.sriov is not None:
            out["sriov"] = {"totalVFs": d.gpu.total_vfs, "numVFs": d.gpu.num_vfs}
        out["drm"] = dev.drm
    elif isinstance(dev, model.Nic):
        assert d.nic is not None
        out["ports"] = d.nic.ports
        out["speed"] = d.nic.speed
        if dev.mac_base is not None:
            out["macBase"] = dev.mac_base
        if dev.sriov is not None:
            out["sriov"] = {"totalVFs": d.nic.total_vfs, "numVFs": d.nic.num_vfs}
            if dev.sriov.vf_driver is not None:
                out["sriov"]["vfDriver"] = d.nic.vf_driver
        out["linkLayer"] = d.nic.link_layer
        out["rdma"] = d.nic.rdma
    elif isinstance(dev, model.Fpga):
        assert d.fpga is not None
        out["ports"] = d.fpga.ports
        if all(d.fpga.afu_ids):
            out["afuIds"] = list(d.fpga.afu_ids)
    elif isinstance(dev, model.Nvme):
        assert d.nvme is not None
        out["capacity"] = quantity(d.nvme.capacity)
        out["namespaces"] = d.nvme.namespaces
        out["lbaSize"] = d.nvme.lba_size
    else:
        out["vendorId"] = _hex(dev.vendor_id, 4)
        out["deviceId"] = _hex(dev.device_id, 4)
        out["classCode"] = _hex(dev.class_code, 6)
        if dev.driver is not None:
            out["driver"] = dev.driver
        out["devNodes"] = [n.model_dump(by_alias=True) for n in dev.dev_nodes]
    return out

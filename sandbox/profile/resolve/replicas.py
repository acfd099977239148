"""Replicas of a node entry: the same layout, with identities of their own (serials,
UUIDs, MACs, InfiniBand GUIDs) seeded from profile name + replica name + device id, and
the names the kernel would give (netdevs, RDMA devices, generic device nodes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid as uuidlib

from sandbox.profile import catalogue, model
from sandbox.profile.resolve.devices import Draft, replace
from sandbox.profile.resolve.system import system_spec
from sandbox.profile.spec import DeviceSpec, DevNodeSpec, GenericSpec, NodeSpec, PciFunction


def replica_name(name: str, count: int, index: int) -> str:
    return name if count == 1 else f"{name}-{index}"


def seeded(*parts: object) -> bytes:
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()


def replica(
    profile_name: str, node: model.Node, template: NodeSpec, drafts: list[Draft], r: int
) -> NodeSpec:
    name = replica_name(node.name, node.count, r)
    devices: list[DeviceSpec] = []
    rdma_counter = 0
    for draft in sorted(drafts, key=lambda d: d.functions[0].address):
        seed = (profile_name, name, draft.id)
        raw = seeded(*seed, "uuid")
        uid = str(uuidlib.UUID(bytes=raw[:16], version=4))
        serial = str(int.from_bytes(seeded(*seed, "serial")[:8], "big") % 10**13).zfill(13)
        nic = draft.nic
        if nic is not None:
            if draft.mac_base is not None:
                base = int(draft.mac_base.replace(":", ""), 16) + (r << 8)
            else:
                tail = int.from_bytes(seeded(*seed, "mac")[:3], "big") & 0xFFFFF0
                base = int(_oui(draft).replace(":", ""), 16) << 24 | tail
            macs = [_format_mac(base + p) for p in range(nic.ports)]
            netdevs = tuple(
                _netdev_name(f, nic.link_layer) for f in draft.functions
            )
            guids = tuple(
                ":".join(f"{b:02x}" for b in seeded(*seed, "guid", p)[:8]) for p in range(nic.ports)
            )
            rdma_devs: tuple[str, ...] = ()
            if nic.rdma:
                prefix = "mlx5_" if draft.vendor == "mellanox" else "irdma"
                rdma_devs = tuple(f"{prefix}{rdma_counter + p}" for p in range(nic.ports))
                rdma_counter += nic.ports
            nic = replace(nic, macs=tuple(macs), netdevs=netdevs, rdma_devs=rdma_devs,
                           node_guids=guids)
        devices.append(
            DeviceSpec(
                id=draft.id, kind=draft.kind, vendor=draft.vendor, model=draft.model,
                model_name=draft.model_name, numa_node=draft.numa_node,
                functions=tuple(draft.functions), serial=serial,
                uuid=("GPU-" + uid) if draft.vendor == "nvidia" else uid,
                health=draft.health, health_reason=draft.health_reason, source=draft.source,
                gpu=draft.gpu, nic=nic, fpga=draft.fpga, nvme=draft.nvme,
                generic=_expand_generic(draft),
            )
        )
    devices.sort(key=lambda d: _id_key(d.id))
    # Everything else (CPUs, NUMA, PCI tree, kubelet settings...) is the template's.
    return dataclasses.replace(
        template, name=name, index=r, devices=tuple(devices),
        system=system_spec(node, seeded(profile_name, name, "dmi", "uuid"),
                           seeded(profile_name, name, "dmi", "serial")),
    )


def _id_key(device_id: str) -> tuple[str, int]:
    stem = device_id.rstrip("0123456789")
    return stem, int(device_id[len(stem):] or 0)


def _format_mac(value: int) -> str:
    value &= (1 << 48) - 1
    return ":".join(f"{(value >> s) & 0xFF:02x}" for s in range(40, -8, -8))


def _oui(draft: Draft) -> str:
    models = catalogue.NICS.get(draft.vendor, {})
    entry = models.get(draft.model)
    return entry.oui if entry else "02:00:00"


def _netdev_name(fn: PciFunction, link_layer: str = "ethernet") -> str:
    """systemd's predictable path name for a PCI function (udev's net_id builtin):
    ``en`` for Ethernet, ``ib`` for IPoIB, then ``[P<domain>]p<bus>s<slot>[f<function>]``.

    Ethernet names always carry ``f<function>`` (as they always have here); IPoIB names,
    as udev gives them, only on a multi-function slot or a function other than 0
    (``ibp23s0`` on a single-port ConnectX, ``ibp23s0f1`` on a dual-port one's second)."""
    address = fn.address
    bus, slot, func = int(address[5:7], 16), int(address[8:10], 16), int(address[11])
    domain = int(address[0:4], 16)
    ib = link_layer == "infiniband"
    kind = "ib" if ib else "en"
    prefix = f"{kind}P{domain}p" if domain else f"{kind}p"
    suffix = f"f{func}" if not ib or func or fn.multifunction else ""
    return f"{prefix}{bus}s{slot}{suffix}"


def _expand_generic(draft: Draft) -> GenericSpec | None:
    if draft.generic is None:
        return None
    index = int(draft.id[len(draft.id.rstrip("0123456789")):] or 0)
    return GenericSpec(tuple(
        DevNodeSpec(n.name.replace("{i}", str(index)), n.major, n.minor + index
                    if "{i}" in n.name else n.minor)
        for n in draft.generic.dev_nodes
    ))

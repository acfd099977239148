"""The node's complete PCI tree, planned once: every bridge, physical function and
POSSIBLE SR-IOV virtual function, with its directory under ``sys/devices``, the bus range
behind each bridge, each bridge's PCIe port type and which slots are multifunction.

It is independent of the devices' runtime states, so a bridge's config space never
changes when a device below it is unplugged or VFs are toggled; the tree builder
(``sandbox.fakehw.builder._pci``) renders what is present and plans nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sandbox.profile import catalogue
from sandbox.profile.resolve.devices import Draft
from sandbox.profile.spec import PciFunction

ROOT_PORT, SWITCH_UPSTREAM, SWITCH_DOWNSTREAM = 4, 5, 6  # PCIe capability port types

_FIELDS = frozenset(f.name for f in dataclasses.fields(PciFunction))
if hasattr(PciFunction, "__post_init__") or hasattr(PciFunction, "__slots__"):
    raise TypeError("pcitree._evolve copies a PciFunction's __dict__ and skips __init__")


def _evolve(f: PciFunction, **changes: Any) -> PciFunction:
    """``dataclasses.replace(f, **changes)`` without calling ``__init__`` (PciFunction
    has nothing to run there: the check above): ~4x faster, and a node's plan makes
    two per function, 10^4 and more for NICs with many VFs (~40 % of a fuzzed
    profile's load, resolve and build went to ``replace``)."""
    if not _FIELDS.issuperset(changes):
        raise TypeError(f"PciFunction has no field {sorted(set(changes) - _FIELDS)}")
    new = object.__new__(PciFunction)
    new.__dict__.update(f.__dict__)
    new.__dict__.update(changes)
    return new


def plan_tree(bridges: list[PciFunction], drafts: list[Draft]) -> tuple[PciFunction, ...]:
    """Every function of the node in address order; the drafts' physical functions are
    replaced by their planned versions."""
    fns: list[PciFunction] = list(bridges)
    for d in drafts:
        d.functions = [_evolve(f, owner=d.id) for f in d.functions]
        fns += d.functions
        fns += _virtual_functions(d)
    fns.sort(key=lambda f: f.address)
    by_addr = {f.address: f for f in fns}
    paths: dict[str, str] = {}
    for f in fns:
        _path_of(f.address, by_addr, paths)
    secondary, subordinate = _bus_ranges(fns, by_addr)
    slots: dict[tuple[int, int, int], int] = {}
    for f in fns:
        if f.physfn is None:
            slots[_slot(f)] = slots.get(_slot(f), 0) + 1
    planned = {}
    for f in fns:
        changes: dict[str, object] = {
            "path": paths[f.address],
            "multifunction": f.physfn is None and slots[_slot(f)] > 1,
        }
        if f.class_code == catalogue.BRIDGE_CLASS:
            sec = secondary.get(f.address, 0)
            changes["secondary_bus"] = sec
            changes["subordinate_bus"] = max(sec, subordinate.get(f.address, sec))
            changes["port_type"] = _port_type(f, by_addr)
        planned[f.address] = _evolve(f, **changes)
    for d in drafts:
        d.functions = [planned[f.address] for f in d.functions]
    return tuple(planned[f.address] for f in fns)


def _virtual_functions(d: Draft) -> list[PciFunction]:
    """Every possible VF of a device: its PF's identity, the VF device id and driver of
    the NIC model (an Intel GPU's VFs keep the PF's), one IOMMU group each."""
    if d.nic is not None and d.nic.total_vfs:
        addresses, groups = d.nic.vf_addresses, d.nic.vf_iommu_groups
        device_id: int | None = d.nic.vf_device_id
        driver: str | None = d.nic.vf_driver
    elif d.gpu is not None and d.gpu.total_vfs:
        addresses, groups = (d.gpu.vf_addresses,), (d.gpu.vf_iommu_groups,)
        device_id = driver = None
    else:
        return []
    out: list[PciFunction] = []
    for p, pf in enumerate(d.functions):
        vfs = addresses[p] if p < len(addresses) else ()
        pf_groups = groups[p] if p < len(groups) else ()
        for v, addr in enumerate(vfs):
            out.append(_evolve(
                pf, address=addr,
                device_id=pf.device_id if device_id is None else device_id,
                driver=pf.driver if driver is None else driver,
                iommu_group=pf_groups[v] if v < len(pf_groups) else pf.iommu_group,
                physfn=pf.address, vf_index=v,
            ))
    return out


def _path_of(addr: str, by_addr: dict[str, PciFunction], paths: dict[str, str]) -> str:
    known = paths.get(addr)
    if known is not None:
        return known
    f = by_addr[addr]
    parent = f.parent if f.parent in by_addr else None
    base = _path_of(parent, by_addr, paths) if parent else f"sys/devices/{f.host_bridge}"
    paths[addr] = path = f"{base}/{addr}"
    return path


def _bus_ranges(fns: list[PciFunction], by_addr: dict[str, PciFunction]
                ) -> tuple[dict[str, int], dict[str, int]]:
    """Each bridge's secondary bus (the lowest below it) and subordinate (the highest)."""
    sec: dict[str, int] = {}
    sub: dict[str, int] = {}
    for f in fns:
        if f.parent not in by_addr:
            continue
        sec[f.parent] = min(sec.get(f.parent, 0xFF), f.bus)
        a: str | None = f.parent
        while a is not None and a in by_addr:
            sub[a] = max(sub.get(a, 0), f.bus)
            a = by_addr[a].parent
    return sec, sub


def _port_type(f: PciFunction, by_addr: dict[str, PciFunction]) -> int:
    """A root port hangs off the host bridge, a switch's upstream port off a root port,
    its downstream ports off the upstream port."""
    parent = by_addr.get(f.parent) if f.parent else None
    if parent is None:
        return ROOT_PORT
    return SWITCH_UPSTREAM if parent.parent is None else SWITCH_DOWNSTREAM


def _slot(f: PciFunction) -> tuple[int, int, int]:
    return f.domain, f.bus, int(f.address[8:10], 16)

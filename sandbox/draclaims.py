"""What a running cluster's claims hold, and what is left (``sandbox dra claims``).

``usage`` joins ResourceSlices and ResourceClaims (plain JSON objects) into the devices
allocated per claim and, per counter set and consumable capacity, how much is used and
left; ``read_usage`` reads both from a cluster. What the driver would publish for a
profile's node: ``draconfig``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sandbox.errors import SandboxError


@dataclass(frozen=True)
class Allocated:
    """One device allocated to one claim."""

    claim: str  # namespace/name
    pods: tuple[str, ...]  # the pods the claim is reserved for
    request: str
    driver: str
    pool: str  # our driver's pool is its node's name
    device: str
    consumed: tuple[tuple[str, str], ...]  # what the device takes from shared counters or
    # from its own consumable capacity, e.g. (("memory", "10Gi"), ("bandwidth", "3G"))
    counter_sets: tuple[str, ...] = ()  # the counter sets it takes from (a GPU's, by name)


@dataclass(frozen=True)
class Left:
    """One shared counter (of a GPU's counter set) or one consumable capacity (of a
    device that allows multiple allocations, such as a NIC's bandwidth): how much there
    is, how much allocations use. Every one a slice publishes, in use or not."""

    pool: str
    owner: str  # the counter set, or the device
    name: str  # the counter or the capacity
    total: Decimal
    used: Decimal


@dataclass(frozen=True)
class Usage:
    allocated: tuple[Allocated, ...]
    counters: tuple[Left, ...]
    capacity: tuple[Left, ...]


def usage(slices: Sequence[Mapping[str, Any]], claims: Sequence[Mapping[str, Any]]) -> Usage:
    """What the cluster's ResourceClaims hold of its ResourceSlices (resource.k8s.io/v1
    objects as plain data): every allocated device with what it consumes, and per shared
    counter and per consumable capacity how much is left."""
    from kubernetes.utils.quantity import parse_quantity

    devices: dict[tuple[str, str, str], Mapping[str, Any]] = {}
    counters: dict[tuple[str, str, str], Decimal] = {}
    capacity: dict[tuple[str, str, str], Decimal] = {}
    for s in slices:
        spec = s.get("spec", {})
        driver, pool = spec.get("driver", ""), spec.get("pool", {}).get("name", "")
        for cs in spec.get("sharedCounters") or []:
            for name, c in (cs.get("counters") or {}).items():
                counters[(pool, cs["name"], name)] = parse_quantity(c["value"])
        for d in spec.get("devices") or []:
            devices[(driver, pool, d["name"])] = d
            if d.get("allowMultipleAllocations"):  # consumable capacity (DRAConsumableCapacity)
                for name, cap in (d.get("capacity") or {}).items():
                    capacity[(pool, d["name"], name)] = parse_quantity(cap["value"])
    used_counters = dict.fromkeys(counters, Decimal(0))
    used_capacity = dict.fromkeys(capacity, Decimal(0))
    allocated = []
    for c in claims:
        meta, status = c.get("metadata", {}), c.get("status") or {}
        pods = tuple(r["name"] for r in status.get("reservedFor") or [])
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        for r in results:
            device = devices.get((r["driver"], r["pool"], r["device"]), {})
            consumed = []
            sets = tuple(dict.fromkeys(cc["counterSet"]
                                       for cc in device.get("consumesCounters") or []))
            for cc in device.get("consumesCounters") or []:
                for name, v in (cc.get("counters") or {}).items():
                    key = (r["pool"], cc["counterSet"], name)
                    used_counters[key] = used_counters.get(key, Decimal(0)) + parse_quantity(
                        v["value"])
                    consumed.append((name, str(v["value"])))
            for name, v in (r.get("consumedCapacity") or {}).items():
                key = (r["pool"], r["device"], name)
                if key not in capacity:  # a device no slice has now (unplugged)
                    total = (device.get("capacity") or {}).get(name, {}).get("value", "0")
                    capacity[key] = parse_quantity(total)
                used_capacity[key] = used_capacity.get(key, Decimal(0)) + parse_quantity(v)
                consumed.append((name, str(v)))
            allocated.append(Allocated(
                f"{meta.get('namespace', '')}/{meta.get('name', '')}", pods, r["request"],
                r["driver"], r["pool"], r["device"], tuple(consumed), sets))
    return Usage(
        tuple(sorted(allocated, key=lambda a: (a.claim, a.request, a.device))),
        tuple(Left(*k, counters[k], used_counters[k]) for k in sorted(counters)),
        tuple(Left(*k, capacity[k], used_capacity[k]) for k in sorted(capacity)),
    )


def read_usage(kubeconfig: str) -> Usage:
    """``usage`` of the cluster ``kubeconfig`` names."""
    from sandbox.kubeapi import Kube

    try:
        with Kube.from_kubeconfig(kubeconfig) as api:
            slices = api.items("/apis/resource.k8s.io/v1/resourceslices")
            claims = api.items("/apis/resource.k8s.io/v1/resourceclaims")
    except Exception as exc:  # noqa: BLE001 - ApiError, connection errors, ...
        raise SandboxError(f"cannot read ResourceSlices and ResourceClaims: "
                           f"{str(exc).strip().splitlines()[0]}") from exc
    return usage(slices, claims)


def quantity(value: Decimal) -> str:
    """A quantity as people write it: 10Gi, 3G, 7."""
    if value == 0:
        return "0"
    for suffix, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("T", 10**12),
                           ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)

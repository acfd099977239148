"""From discovered devices to the ResourceSlices of one node's pool (resource.k8s.io/v1).

Pure: ``build_pool(devices, config)`` derives what the pool offers (partitions from the
driver config), ``resource_slices(pool, node, generation)`` lays it out as API objects
(plain dicts, exactly what is sent to the API server).

Layout of a pool (one per node, named after the node):

- Counter slices first (only when a GPU is partitionable): ``sharedCounters``, one counter
  set per partitionable GPU, named like the GPU, with counters ``memory-slices``,
  ``compute-slices`` and ``memory`` (bytes). At most 8 sets per slice.
- Device slices: at most 64 devices each (the API's limit for devices with taints,
  counters or multiple allocations). A partitionable GPU is one whole-GPU device that
  consumes ALL its counters plus one device per possible partition instance
  (``gpu-<BDF>-<profile>-<k>``) consuming its share, so the scheduler never hands out
  partitions that together exceed the GPU, nor a partition next to the whole GPU.
- NIC physical functions allow multiple allocations and offer ``bandwidth`` (bits/s) as
  consumable capacity (default 1G per claim, any multiple of 1M up to the link speed).
- Unhealthy devices carry a taint ``hwsandbox.dev/unhealthy=<reason>`` (see discovery).
- Devices of the types in ``skip_node_operations`` (alpha, gate DRAOptionalNodeOperations)
  go to slices of their own with ``skipNodeOperations: ["*"]``: the control plane allocates
  them and the kubelet calls neither NodePrepareResources nor NodeUnprepareResources (the
  field is per slice). They carry the attribute ``controlPlaneOnly: true`` so a DeviceClass
  can select them.

Attributes: the standard ``resource.kubernetes.io/{pciBusID,pcieRoot,numaNode}`` plus, in
the driver's domain, ``type`` (gpu | gpu-partition | nic | vf | fpga), ``vendor``,
``productID`` (vendor:device), ``model``, ``uuid`` and kind-specific ones.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hwplugins.dra.config import EMPTY, DriverConfig, PartitionProfile
from hwplugins.dra.discovery import NO_EXECUTE, AttrValue, Device, dns_label

DRIVER = "dra.hwsandbox.dev"
API_VERSION = "resource.k8s.io/v1"
TAINT_KEY = "hwsandbox.dev/unhealthy"
STANDARD = "resource.kubernetes.io/"
MAX_DEVICES_PER_SLICE = 64
MAX_COUNTER_SETS_PER_SLICE = 8
NIC_DEFAULT_BANDWIDTH = 10**9
NIC_BANDWIDTH_STEP = 10**6


@dataclass(frozen=True)
class PoolDevice:
    """One device of the pool: its API object and the physical device behind it."""

    name: str
    type: str  # gpu | gpu-partition | nic | vf | fpga
    source: Device
    body: Mapping[str, Any]  # the resource.k8s.io/v1 Device
    profile: PartitionProfile | None = None
    mode: str = ""
    skip_node_operations: bool = False  # laid out in a slice with skipNodeOperations


@dataclass(frozen=True)
class Pool:
    counter_sets: tuple[Mapping[str, Any], ...]
    devices: tuple[PoolDevice, ...]

    def device(self, name: str) -> PoolDevice | None:
        return next((d for d in self.devices if d.name == name), None)


def binary_quantity(n: int) -> str:
    for suffix, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


def decimal_quantity(n: int) -> str:
    for suffix, factor in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


def _attr(value: AttrValue) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value[:64]}


def _attributes(dev: Device, type_: str, model: str,
                extra: Iterable[tuple[str, AttrValue]] = ()) -> dict[str, Any]:  # fmt: skip
    attrs: dict[str, AttrValue] = {
        "type": type_,
        "vendor": dev.vendor,
        "productID": dev.pci_id,
        f"{STANDARD}pciBusID": dev.pci_address,
    }
    if model:
        attrs["model"] = model
    if dev.uuid:
        attrs["uuid"] = dev.uuid
    if dev.pcie_root:
        attrs[f"{STANDARD}pcieRoot"] = dev.pcie_root
    if dev.numa_node is not None:
        attrs[f"{STANDARD}numaNode"] = dev.numa_node
    for key, value in (*dev.attributes, *extra):
        if value != "":
            attrs[key] = value
    return {k: _attr(v) for k, v in sorted(attrs.items())}


def _taints(dev: Device) -> list[dict[str, str]]:
    if dev.healthy:
        return []
    worst = next((p for p in dev.problems if p.effect == NO_EXECUTE), dev.problems[0])
    return [{"key": TAINT_KEY, "value": worst.reason, "effect": worst.effect}]


def _counters(memory_slices: int, compute_slices: int, memory: int) -> dict[str, Any]:
    counters = {"memory-slices": memory_slices, "compute-slices": compute_slices}
    if memory:
        counters["memory"] = memory
    return {k: {"value": binary_quantity(v) if k == "memory" else str(v)}
            for k, v in counters.items()}  # fmt: skip


def _gpu(dev: Device, config: DriverConfig, groups: bool) -> tuple[list[PoolDevice], Any]:
    model_cfg = config.model(dev.pci_id)
    model = dev.model or model_cfg.name
    memory = dev.memory or model_cfg.memory
    parts = model_cfg.partitions
    body: dict[str, Any] = {
        "name": dev.name,
        "attributes": _attributes(dev, "gpu", model, [("partitionable", parts is not None)]),
    }
    if memory:
        body["capacity"] = {"memory": {"value": binary_quantity(memory)}}
    taints = _taints(dev)
    if taints:
        body["taints"] = taints
    if parts is None or not memory:
        return [PoolDevice(dev.name, "gpu", dev, body)], None
    counter_set = {"name": dev.name,
                   "counters": _counters(parts.memory_slices, parts.compute_slices, memory)}
    body["consumesCounters"] = [{"counterSet": dev.name, "counters": counter_set["counters"]}]
    out = [PoolDevice(dev.name, "gpu", dev, body)]
    modes = parts.modes if groups else parts.modes[:1]
    for mode in modes:
        for profile in parts.profiles:
            for k in range(profile.instances(parts.memory_slices, parts.compute_slices)):
                suffix = f"-{mode}" if len(modes) > 1 else ""
                name = f"{dev.name}-{dns_label(profile.name)}{suffix}-{k}"
                consume: dict[str, Any] = {
                    "counterSet": dev.name,
                    "counters": _counters(profile.memory_slices, profile.compute_slices,
                                          profile.memory),
                }  # fmt: skip
                if groups and parts.compatibility_groups(mode):
                    consume["compatibilityGroups"] = list(parts.compatibility_groups(mode))
                capacity = {"memorySlices": {"value": str(profile.memory_slices)},
                            "computeSlices": {"value": str(profile.compute_slices)}}
                if profile.memory:
                    capacity["memory"] = {"value": binary_quantity(profile.memory)}
                extra: list[tuple[str, AttrValue]] = [
                    ("profile", profile.name), ("mode", mode), ("parent", dev.name)]
                part: dict[str, Any] = {
                    "name": name,
                    "attributes": _attributes(dev, "gpu-partition", model, extra),
                    "capacity": capacity,
                    "consumesCounters": [consume],
                }
                if taints:
                    part["taints"] = taints
                out.append(PoolDevice(name, "gpu-partition", dev, part, profile, mode))
    return out, counter_set


def _nic(dev: Device) -> PoolDevice:
    body: dict[str, Any] = {"name": dev.name, "attributes": _attributes(dev, dev.kind, dev.model)}
    if dev.kind == "nic" and dev.bandwidth:
        bw = dev.bandwidth
        body["allowMultipleAllocations"] = True
        body["capacity"] = {"bandwidth": {
            "value": decimal_quantity(bw),
            "requestPolicy": {
                "default": decimal_quantity(min(NIC_DEFAULT_BANDWIDTH, bw)),
                "validRange": {"min": decimal_quantity(NIC_BANDWIDTH_STEP),
                               "max": decimal_quantity(bw),
                               "step": decimal_quantity(NIC_BANDWIDTH_STEP)},
            },
        }}  # fmt: skip
    taints = _taints(dev)
    if taints:
        body["taints"] = taints
    return PoolDevice(dev.name, dev.kind, dev, body)


def _control_plane_only(dev: PoolDevice) -> PoolDevice:
    attrs = {**dev.body["attributes"], "controlPlaneOnly": _attr(True)}
    body = {**dev.body, "attributes": dict(sorted(attrs.items()))}
    return replace(dev, body=body, skip_node_operations=True)


def build_pool(devices: Sequence[Device], config: DriverConfig = EMPTY,
               compatibility_groups: bool = False,
               skip_node_operations: Collection[str] = ()) -> Pool:  # fmt: skip
    """What the node offers. ``compatibility_groups`` (alpha in 1.37, gate
    DRADeviceCompatibilityGroups) offers every partition mode of a GPU, each partition in
    the group of its mode, so modes never mix on one GPU; off, only the first mode.
    ``skip_node_operations``: device types (e.g. ``vf``) published for the control plane
    only (alpha in 1.37, gate DRAOptionalNodeOperations; see the module doc)."""
    counter_sets: list[Mapping[str, Any]] = []
    out: list[PoolDevice] = []
    for dev in devices:
        if dev.kind == "gpu":
            gpu_devices, counter_set = _gpu(dev, config, compatibility_groups)
            out += gpu_devices
            if counter_set is not None:
                counter_sets.append(counter_set)
        elif dev.kind in ("nic", "vf"):
            out.append(_nic(dev))
        else:
            body: dict[str, Any] = {
                "name": dev.name, "attributes": _attributes(dev, dev.kind, dev.model)}
            if not dev.healthy:
                body["taints"] = _taints(dev)
            out.append(PoolDevice(dev.name, dev.kind, dev, body))
    skip = set(skip_node_operations)
    out = [_control_plane_only(d) if d.type in skip else d for d in out]
    return Pool(tuple(counter_sets), tuple(out))


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def slice_specs(pool: Pool, node: str, driver: str = DRIVER) -> list[dict[str, Any]]:
    """The spec of every slice, without the pool generation and count (see resource_slices)."""
    specs: list[dict[str, Any]] = []
    for sets in _chunks(pool.counter_sets, MAX_COUNTER_SETS_PER_SLICE):
        specs.append({"driver": driver, "nodeName": node, "sharedCounters": list(sets)})
    for skip in (False, True):
        devices = [d for d in pool.devices if d.skip_node_operations == skip]
        for devs in _chunks(devices, MAX_DEVICES_PER_SLICE):
            spec: dict[str, Any] = {"driver": driver, "nodeName": node,
                                    "devices": [d.body for d in devs]}  # fmt: skip
            if skip:
                spec["skipNodeOperations"] = ["*"]
            specs.append(spec)
    if not specs:  # an empty pool still tells the scheduler "nothing here"
        specs.append({"driver": driver, "nodeName": node})
    return specs


def slice_name(node: str, driver: str, index: int) -> str:
    return f"{node}-{driver}-{index}"


def resource_slices(pool: Pool, node: str, generation: int = 1,
                    driver: str = DRIVER) -> list[dict[str, Any]]:  # fmt: skip
    specs = slice_specs(pool, node, driver)
    out = []
    for i, spec in enumerate(specs):
        spec = {**spec, "pool": {"name": node, "generation": generation,
                                 "resourceSliceCount": len(specs)}}  # fmt: skip
        out.append({
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": slice_name(node, driver, i)},
            "spec": spec,
        })  # fmt: skip
    return out

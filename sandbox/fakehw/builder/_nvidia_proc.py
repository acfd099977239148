"""The sandbox-owned NVML state file, ``proc/driver/nvidia/hwsandbox/nvml``.

Our ``libnvidia-ml.so.1`` (sandbox/nvml) takes GPU identity from the tree's
``proc/driver/nvidia/gpus/<BDF>/information`` and PCI device directory, and from this file
what sysfs cannot hold: memory size, compute capability, architecture, MIG mode, MIG
profiles and devices, driver and CUDA versions, and the GPU's fault as an Xid. It is part of
the tree, so every rebuild after a control-socket change rewrites it with the rest: NVML
callers see the same health and hotplug as every other reader. Format: docs/nvml.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from sandbox.fakehw import mig as migrule
from sandbox.fakehw.tree import (
    SIGNS,
    DeviceState,
    GpuInstance,
    Health,
    MigGeometry,
    MigProfile,
)
from sandbox.profile import catalogue
from sandbox.profile.spec import DeviceSpec, PartitionProfileSpec, PartitionSpec

STATE_PATH = "proc/driver/nvidia/hwsandbox/nvml"
FORMAT = 1
CUDA_DRIVER_VERSION = 12040  # CUDA 12.4, what driver 550 reports (major*1000 + minor*10)
MiB = 1024**2

# The Xid of each unhealthy reason is in tree.SIGNS, the one table every reader's view of a
# reason comes from (docs/nvml.md); a lost GPU (unplugged, removed) is Xid 79, "GPU has
# fallen off the bus".
XID_LOST = 79

# NVML enum values (published): nvmlDeviceArchitecture_t and nvmlBrandType_t.
ARCH_TURING, ARCH_AMPERE, ARCH_ADA, ARCH_HOPPER = 6, 7, 8, 9
BRAND_TESLA, BRAND_NVIDIA = 2, 14
# GPU-instance (and compute-instance) profile ids by compute slices: 1,2,3,4,7,8,6 -> 0..6
PROFILE_ID_OF_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


@dataclass(frozen=True)
class ModelFacts:
    compute_capability: str
    arch: int
    sms: int
    brand: int


MODEL_FACTS = {
    "h100-sxm5-80gb": ModelFacts("9.0", ARCH_HOPPER, 132, BRAND_NVIDIA),
    "a100-sxm4-80gb": ModelFacts("8.0", ARCH_AMPERE, 108, BRAND_NVIDIA),
    "a100-sxm4-40gb": ModelFacts("8.0", ARCH_AMPERE, 108, BRAND_NVIDIA),
    "a100-pcie-40gb": ModelFacts("8.0", ARCH_AMPERE, 108, BRAND_NVIDIA),
    "l40s": ModelFacts("8.9", ARCH_ADA, 142, BRAND_NVIDIA),
    "t4": ModelFacts("7.5", ARCH_TURING, 40, BRAND_TESLA),
}
DEFAULT_FACTS = ModelFacts("8.0", ARCH_AMPERE, 108, BRAND_NVIDIA)


@dataclass(frozen=True)
class MigDevice:
    gi: int
    profile: PartitionProfileSpec
    start: int  # first memory slice
    ci: bool = True  # its compute instance exists (a MIG device); else a bare GPU instance


def xid_of(state: DeviceState, present: bool) -> int:
    if not present or not state.plugged:
        return XID_LOST
    if state.health is Health.UNHEALTHY:
        return SIGNS[state.reason].xid if state.reason is not None else XID_LOST
    return 0


def mig_capable(dev: DeviceSpec) -> bool:
    entry = catalogue.GPUS.get(dev.vendor, {}).get(dev.model)
    gpu = dev.gpu
    return (entry is not None and entry.memory_slices > 0) or (
        gpu is not None and gpu.partitions is not None and "mig" in gpu.partitions.modes)


def mig_enabled(dev: DeviceSpec) -> bool:
    gpu = dev.gpu
    return gpu is not None and gpu.partitions is not None and "mig" in gpu.partitions.modes


def mig_mode(dev: DeviceSpec, state: DeviceState) -> bool:
    """Whether ``dev`` is in MIG mode now (its profile's mode, unless NVML changed it)."""
    geo = geometry(dev)
    return migrule.mode_of(geo, state) if geo is not None else mig_enabled(dev)


def _usable(p: PartitionSpec) -> list[PartitionProfileSpec]:
    return [q for q in p.profiles if q.compute_slices in PROFILE_ID_OF_SLICES
            and q.memory_slices <= p.memory_slices and q.compute_slices <= p.compute_slices]


def mig_layout(p: PartitionSpec) -> list[MigDevice]:
    """The MIG devices a GPU in MIG mode holds: a balanced layout. The profiles smaller
    than the whole GPU, largest first, once each while they fit; then the smallest again
    until no slice is left (an A100 80GB with 1g/2g/3g/7g: 3g.40gb + 2g.20gb + 2 x
    1g.10gb). A profile list with only the whole-GPU profile gives that one device."""
    usable = _usable(p)
    partial = [q for q in usable if q.memory_slices < p.memory_slices
               and q.compute_slices < p.compute_slices] or usable
    order = sorted(partial, key=lambda q: (-q.compute_slices, -q.memory_slices, q.name))
    mem, comp = p.memory_slices, p.compute_slices
    chosen: list[PartitionProfileSpec] = []
    for q in order:
        if q.memory_slices <= mem and q.compute_slices <= comp:
            chosen.append(q)
            mem -= q.memory_slices
            comp -= q.compute_slices
    if order:
        smallest = order[-1]
        while smallest.memory_slices <= mem and smallest.compute_slices <= comp and \
                len(chosen) < 7:
            chosen.append(smallest)
            mem -= smallest.memory_slices
            comp -= smallest.compute_slices
    out, start = [], 0
    for k, q in enumerate(chosen[:7]):
        out.append(MigDevice(k + 1, q, start))
        start += q.memory_slices
    return out


def geometry(dev: DeviceSpec) -> MigGeometry | None:
    """A MIG GPU's slices, profiles, and the mode and instances its profile starts with
    (None: no partitions to make instances of)."""
    gpu = dev.gpu
    if dev.vendor != "nvidia" or gpu is None or gpu.partitions is None or \
            not mig_capable(dev):
        return None
    part = gpu.partitions
    usable = _usable(part)
    profiles = tuple(MigProfile(PROFILE_ID_OF_SLICES[q.compute_slices], q.name,
                                q.compute_slices, q.memory_slices) for q in usable)
    layout = tuple(GpuInstance(m.gi, PROFILE_ID_OF_SLICES[m.profile.compute_slices], m.start)
                   for m in mig_layout(part))
    return MigGeometry(part.memory_slices, part.compute_slices, profiles,
                       mig_enabled(dev), layout)


def mig_devices(dev: DeviceSpec, state: DeviceState) -> list[MigDevice]:
    """The GPU instances ``dev`` holds in ``state`` (none with MIG mode off)."""
    geo = geometry(dev)
    gpu = dev.gpu
    if geo is None or gpu is None or gpu.partitions is None:
        return []
    by_id = {PROFILE_ID_OF_SLICES[q.compute_slices]: q for q in _usable(gpu.partitions)}
    return [MigDevice(g.gi, by_id[g.profile], g.start, g.ci)
            for g in migrule.instances(geo, state) if g.profile in by_id]


def mig_uuid(parent_uuid: str, gi: int) -> str:
    h = hashlib.blake2b(f"{parent_uuid}/mig/{gi}".encode(), digest_size=16).hexdigest()
    return f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def state_text(gpus: list[DeviceSpec], present: Mapping[str, str],
               states: Mapping[str, DeviceState], driver_version: str) -> str:
    """The state file for the node's NVIDIA ``gpus``; ``present`` maps the PCI addresses in
    the tree (an absent GPU is ``state=lost``)."""
    lines = [
        "# hw-sandbox NVML state: sandbox-owned, read by our libnvidia-ml.so.1 (docs/nvml.md)",
        f"format {FORMAT}",
        f"driver {driver_version}",
        f"cuda {CUDA_DRIVER_VERSION}",
    ]
    for dev in sorted(gpus, key=lambda d: d.address):
        gpu = dev.gpu
        if gpu is None:
            continue
        facts = MODEL_FACTS.get(dev.model, DEFAULT_FACTS)
        here = dev.address in present
        state = states.get(dev.id, DeviceState())
        lost = not here or not state.plugged
        enabled = mig_mode(dev, state)
        lines.append(
            f"gpu {dev.address} memory={gpu.memory} cc={facts.compute_capability} "
            f"arch={facts.arch} brand={facts.brand} sm={facts.sms} "
            f"mig-capable={int(mig_capable(dev))} mig={int(enabled)} "
            f"state={'lost' if lost else 'ok'} xid={xid_of(state, here)} id={dev.id}"
        )
        part = gpu.partitions
        if part is None or not enabled:
            continue
        for q in _usable(part):
            count = min(part.compute_slices // q.compute_slices,
                        part.memory_slices // q.memory_slices)  # fmt: skip
            lines.append(
                f"profile {dev.address} id={PROFILE_ID_OF_SLICES[q.compute_slices]} "
                f"name={q.name} slices={q.compute_slices} memory-slices={q.memory_slices} "
                f"memory-mb={q.memory // MiB} count={count} "
                f"sm={facts.sms * q.compute_slices // part.compute_slices}"
            )
        for m in mig_devices(dev, state):
            q = m.profile
            pid = PROFILE_ID_OF_SLICES[q.compute_slices]
            # a GPU instance without its compute instance is no MIG device: NVML lists it
            # among the GPU instances only (docs/nvml.md, "Dynamic MIG")
            head = f"mig {dev.address} gi={m.gi} ci=0" if m.ci else \
                f"gpu-instance {dev.address} gi={m.gi}"
            lines.append(
                f"{head} profile={pid} ci-profile={pid} "
                f"start={m.start} size={q.memory_slices} slices={q.compute_slices} "
                f"memory-mb={q.memory // MiB} "
                f"sm={facts.sms * q.compute_slices // part.compute_slices} "
                f"name={q.name} uuid={mig_uuid(dev.uuid, m.gi)}"
            )
    return "\n".join(lines) + "\n"

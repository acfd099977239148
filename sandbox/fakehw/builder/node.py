"""``build_tree``: one node of a resolved profile, plus device states, becomes a whole
fake root (``sys/``, ``dev/``, ``proc/``).

Pure and deterministic: no I/O, and the output depends only on the ``NodeSpec`` and the
states, so unplugging and re-plugging a device gives a byte-identical tree. Each
subsystem lives in its own helper module (``_cpu``, ``_pci``, ``_gpu``, ``_net``,
``_fpga``); this module orders them and adds what is shared (basic ``/dev`` nodes, vfio,
generic devices, device records). ``docs/sysfs-reference.md`` lists every attribute.

Health uses real kernel interfaces only (see ``Reason`` and ``SIGNS``):

- aer-fatal: ``aer_dev_fatal`` counts an uncorrectable internal error (TOTAL_ERR_FATAL 1).
- link-down: a NIC's interfaces go ``operstate`` down, ``carrier`` 0, ``speed`` -1 (and its
  RDMA ports DOWN/Polling); any other device reports a Surprise Down (SDES) fatal AER
  error and ``current_link_speed`` "Unknown", ``current_link_width`` 0.
- port-down: the NIC's RDMA ports go ``1: DOWN`` / ``3: Disabled`` (a NIC without RDMA
  takes its interfaces down instead).
- row-remap-pending, row-remap-failure, ecc-contained, ecc-uncontained (a GPU's ECC
  errors): ``aer_dev_fatal`` as for aer-fatal; NVML's state file carries their own Xid.
- removed, or ``plugged=False``: the device, its VFs, class/driver/module links, IOMMU
  group entries, ``/dev`` nodes and ``sys/dev/char`` links are all absent.
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass

from sandbox.fakehw.builder import _cpu, _fpga, _gpu, _net, _nvidia_proc, _nvme, _pci
from sandbox.fakehw.builder._common import Ctx, present
from sandbox.fakehw.builder._system import add_system
from sandbox.fakehw.tree import DeviceRecord, DeviceState, Dir, Tree, TreeError
from sandbox.profile.devnames import MEM_MAJOR, VFIO_GROUP_MAJOR, VFIO_MINOR
from sandbox.profile.spec import DeviceSpec, NodeSpec


@dataclass(frozen=True)
class _Static:
    """What depends on the node alone, computed once per NodeSpec and reused by rebuilds."""

    system: Dir  # the root with CPUs, NUMA nodes, proc/cpuinfo, proc/meminfo, /dev basics
    plan: _pci.PciPlan
    memos: OrderedDict[Hashable, str]  # Ctx.memo's, shared by the node's builds
    # The node under its profile's states, so a partial build starts from them and only
    # redoes the devices whose states it is given (a dict copy instead of a loop over all).
    devices: dict[str, DeviceSpec]
    states: dict[str, DeviceState]
    vf_counts: dict[str, int]
    present: dict[str, str]  # PCI address -> directory of every present function


_static: dict[int, tuple[weakref.ref[NodeSpec], _Static]] = {}
_static_lock = threading.Lock()


def _static_of(node: NodeSpec) -> _Static:
    key = id(node)
    with _static_lock:
        hit = _static.get(key)
    if hit is not None and hit[0]() is node:
        return hit[1]
    ctx = Ctx(node, {})
    _base_devices(ctx)
    _cpu.add_cpus(ctx)
    _cpu.add_numa(ctx)
    add_system(ctx)  # memory blocks, bus links, swaps, DMI, IOMMU units
    plan = _pci.plan_pci(node)
    vf_counts: dict[str, int] = {}
    for d in node.devices:
        vf_counts.update(_vf_counts(d, ctx.states[d.id]))
    static = _Static(
        ctx.tree.root, plan, OrderedDict(), {d.id: d for d in node.devices}, dict(ctx.states),
        vf_counts, _pci.present_functions(plan.functions, ctx.states, vf_counts),
    )  # fmt: skip

    def forget(_ref: weakref.ref[NodeSpec]) -> None:
        with _static_lock:
            _static.pop(key, None)

    ref = weakref.ref(node, forget)
    with _static_lock:
        _static[key] = (ref, static)
    return static


def build_tree(node: NodeSpec, states: Mapping[str, DeviceState] | None = None) -> Tree:
    """The whole fake root of ``node`` with devices in ``states`` (default: the profile's).

    The tree's ``partial`` is ``build_partial`` for this node, so the live server can
    rebuild just the devices a change touches."""
    tree = _paused_gc(node, states, None)
    tree.partial = functools.partial(build_partial, node)
    return tree


def build_partial(
    node: NodeSpec, states: Mapping[str, DeviceState] | None, devices: Collection[str]
) -> Tree:
    """Only what the states of ``devices`` decide: their own entries (PCI functions, class
    and bus links, /dev nodes, ...) and, whole, every entry that several devices' states
    decide together (an IOMMU group, the NVML state file, the KFD topology). Nothing else:
    no CPUs, bridges or drivers. Two partial builds of the same devices under two states
    differ exactly where the whole trees differ (tests/fakehw/test_tree_partial.py checks this
    for every device and change of the shipped profiles)."""
    return _paused_gc(node, states, frozenset(devices))


def _paused_gc(
    node: NodeSpec, states: Mapping[str, DeviceState] | None, only: frozenset[str] | None
) -> Tree:
    # The tree is acyclic (plain refcounting frees it); pausing the cyclic GC while
    # hundreds of thousands of containers are allocated halves the build time.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _build(node, states, only)
    finally:
        if paused:
            gc.enable()


def _build(
    node: NodeSpec, states: Mapping[str, DeviceState] | None, only: frozenset[str] | None
) -> Tree:
    static = _static_of(node)
    plan = static.plan
    if only is None:
        ctx = Ctx(node, states)
        ctx.graft(static.system)
        vf_counts: dict[str, int] = {}  # physical function address -> VFs enabled on it
        for d in node.devices:
            vf_counts.update(_vf_counts(d, ctx.states[d.id]))
        pci = _pci.add_pci(ctx, plan, vf_counts)
    else:
        ctx = Ctx(node, states, only, defaults=static.states)
        given = [static.devices[k] for k in states or {} if k in static.devices]
        vf_counts = dict(static.vf_counts)
        present = dict(static.present)
        for d in given:  # redo what these devices' states decide
            for f in d.functions:
                vf_counts.pop(f.address, None)
            vf_counts.update(_vf_counts(d, ctx.states[d.id]))
        for d in given:
            owned = plan.by_owner.get(d.id, [])
            for f in owned:
                present.pop(f.address, None)
            present.update(_pci.present_functions(owned, ctx.states, vf_counts))
        pci = _pci.add_pci(ctx, plan, vf_counts, present)
    ctx.memos = static.memos
    ctx.pci_dirs = pci
    gpus = [d for d in node.devices if d.kind == "gpu" and d.gpu is not None]
    nvidia = [d for d in gpus if d.vendor == "nvidia"]
    if _joint(ctx, nvidia):  # the NVML state file and MIG capabilities cover every GPU
        _gpu.add_nvidia(ctx, nvidia, pci, plan)
    drm = [d for d in gpus if d.gpu is not None and d.gpu.drm_index >= 0]
    if drm:
        _gpu.add_drm_common(ctx, drm)
    # VFs get DRM minors after every physical GPU's, numbered over all POSSIBLE VFs.
    vf_minor = len(drm)
    for d in drm:
        assert d.gpu is not None
        fn = pci.get(d.address)
        if fn is not None and ctx.emits(d.id):
            _gpu.add_drm(ctx, d.gpu.drm_index, d.address, fn)
            if d.vendor == "amd":
                _gpu.add_amd_attrs(ctx, d, fn)
            for v in range(vf_counts.get(d.address, 0)):
                vf = d.gpu.vf_addresses[v]
                _gpu.add_drm(ctx, vf_minor + v, vf, pci[vf])
        vf_minor += d.gpu.total_vfs
    amd = [d for d in drm if d.vendor == "amd"]
    if _joint(ctx, amd):  # KFD node numbers count the present GPUs
        _gpu.add_kfd(ctx, amd, pci)
    _net.add_nics(ctx, [d for d in node.devices if d.nic is not None], pci, plan, vf_counts)
    _fpga.add_fpgas(ctx, [d for d in node.devices if d.fpga is not None], pci)
    _nvme.add_nvmes(ctx, [d for d in node.devices if d.nvme is not None], pci)
    generic = [d for d in node.devices if d.generic is not None]
    if _joint(ctx, generic):  # generic devices may share a /dev node
        _generic(ctx, generic, pci)
    _vfio(ctx, plan, pci)  # a group's node stays while any of its functions is present
    for d in node.devices:
        if not ctx.emits(d.id):
            continue
        ctx.tree.devices[d.id] = DeviceRecord(
            d.id,
            d.kind,
            d.vendor,
            d.model,
            d.address,
            d.numa_node,
            _dev_nodes(d),
            ctx.states[d.id],
            _nvidia_proc.geometry(d),
        )
    return ctx.tree


def _joint(ctx: Ctx, devs: list[DeviceSpec]) -> bool:
    """Whether entries decided by all of ``devs`` together belong in this build."""
    return ctx.only is None or any(d.id in ctx.only for d in devs)


def _vf_counts(dev: DeviceSpec, state: DeviceState) -> dict[str, int]:
    """VFs enabled per physical function: the port's count, else the device's, else the
    profile's. ValueError (the control API's refusal) for a count on a device without
    SR-IOV, on a port it does not have, or past its sriov_totalvfs."""
    info = _pci.vf_info(dev)
    if state.num_vfs is not None or state.port_vfs:  # as the kernel refuses the write
        if info is None:
            raise ValueError(f"{dev.id} has no SR-IOV (no sriov_numvfs)")
        for port, _ in state.port_vfs:
            if port >= len(dev.functions):
                raise ValueError(f"{dev.id} has {len(dev.functions)} port(s), no port {port}")
        for port in range(len(dev.functions)):
            n = state.vfs_of(port)
            if n is not None and not 0 <= n <= info.total:
                raise ValueError(f"num_vfs {n} exceeds sriov_totalvfs {info.total}")
    if info is None or not present(state):
        return {}
    out = {}
    for port, pf in enumerate(dev.functions):
        n = state.vfs_of(port)
        out[pf.address] = max(0, min(info.enabled if n is None else n, info.total))
    return out


def _base_devices(ctx: Ctx) -> None:
    """The memory devices every root has; containers and tools expect /dev/null."""
    for name, minor in (("null", 3), ("zero", 5), ("full", 7), ("random", 8), ("urandom", 9)):
        sysdir = f"sys/devices/virtual/mem/{name}"
        ctx.chardev(name, MEM_MAJOR, minor, sysdir)
        ctx.link(f"sys/class/mem/{name}", sysdir)
    vfio = "sys/devices/virtual/misc/vfio"
    ctx.chardev("vfio/vfio", 10, VFIO_MINOR, vfio)
    ctx.link("sys/class/misc/vfio", vfio)


def _vfio(ctx: Ctx, plan: _pci.PciPlan, pci: dict[str, str]) -> None:
    """A /dev/vfio/<group> node per IOMMU group with a function bound to vfio-pci."""
    groups = sorted({f.iommu_group for f in plan.functions if f.driver == "vfio-pci"})
    live = {f.iommu_group for f in plan.functions if f.driver == "vfio-pci" and f.address in pci}
    for minor, group in enumerate(groups):
        if group not in live:
            continue
        sysdir = f"sys/devices/virtual/vfio/{group}"
        ctx.chardev(f"vfio/{group}", VFIO_GROUP_MAJOR, minor, sysdir)
        ctx.link(f"sys/class/vfio/{group}", sysdir)


def _generic(ctx: Ctx, devs: list[DeviceSpec], pci: dict[str, str]) -> None:
    """A generic device's nodes, each a class device below its PCI function: ``accel/accel0``
    becomes ``<BDF>/accel/accel0`` (class ``accel``); a bare name gets class ``generic``."""
    shared: set[str] = set()
    for d in devs:
        fn = pci.get(d.address)
        if fn is None or d.generic is None:
            continue
        for n in d.generic.dev_nodes:
            cls, _, name = n.name.rpartition("/")
            cls = cls.replace("/", "!") or "generic"
            sysdir = f"{fn}/{cls}/{name}"
            if n.name in shared:
                continue  # two generic devices naming the same node share it
            if ctx.exists(f"dev/{n.name}"):
                raise TreeError(f"dev/{n.name}: already a device node of another device")
            shared.add(n.name)
            ctx.chardev(n.name, n.major, n.minor, sysdir)
            ctx.link(f"{sysdir}/device", fn)
            ctx.link(f"sys/class/{cls}/{name}", sysdir)


def _dev_nodes(d: DeviceSpec) -> tuple[str, ...]:
    """The dev/ paths that belong to this device alone (shared ones like nvidiactl excluded)."""
    if d.gpu is not None:
        own = (f"dev/nvidia{d.gpu.minor}",) if d.vendor == "nvidia" else ()
        if d.gpu.drm_index < 0:
            return own
        card, render = _gpu.drm_minors(d.gpu.drm_index)
        return (*own, f"dev/dri/card{card}", f"dev/dri/renderD{render}")
    if d.nic is not None:
        out: list[str] = []
        for ibdev in d.nic.rdma_devs:
            i = int(ibdev[len(ibdev.rstrip("0123456789")) :] or 0)
            out += [
                f"dev/infiniband/uverbs{i}",
                f"dev/infiniband/umad{i}",
                f"dev/infiniband/issm{i}",
            ]
        return tuple(out)
    if d.fpga is not None:
        if d.fpga.flavor != "dfl":
            return ()
        return (
            f"dev/dfl-fme.{d.fpga.region}",
            *(f"dev/dfl-port.{d.fpga.first_port + k}" for k in range(d.fpga.ports)),
        )
    if d.nvme is not None:
        return _nvme.dev_nodes(d)
    if d.generic is not None:
        return tuple(f"dev/{n.name}" for n in d.generic.dev_nodes)
    return ()

"""GPUs: NVIDIA device nodes and ``proc/driver/nvidia``; DRM cards for AMD and Intel, and
for NVIDIA GPUs whose profile asks for nvidia-drm (``drm: true``) (``class/drm``,
``<BDF>/drm``, ``/dev/dri`` and its by-path links); AMD's KFD topology
(``class/kfd/kfd/topology/nodes``), ``/dev/kfd`` and partition attributes
(Documentation/ABI/testing/sysfs-class-drm, drivers/gpu/drm/amd/amdkfd/kfd_topology.c,
Documentation/gpu/amdgpu/driver-misc.rst)."""

from __future__ import annotations

import hashlib

from sandbox.fakehw.builder import _nvidia_proc
from sandbox.fakehw.builder._common import RW, Ctx
from sandbox.fakehw.builder._pci import PciPlan
from sandbox.profile import catalogue
from sandbox.profile.devnames import (
    DRM_MAJOR,
    KFD_MAJOR,
    NVIDIA_CAPS_MAJOR,
    NVIDIA_MAJOR,
    NVIDIA_UVM_MAJOR,
    NVIDIACTL_MINOR,
)
from sandbox.profile.spec import DeviceSpec

NVIDIA_DRIVER_VERSION = "550.54.15"
KFD = "sys/devices/virtual/kfd/kfd"
TOPOLOGY = f"{KFD}/topology/nodes"
# AMD models whose GPUs talk to each other over XGMI (KFD io link type 11), else PCIe (2).
XGMI_MODELS = frozenset({"mi300x", "mi250x"})


def irq_of(plan: PciPlan, address: str) -> int:
    return 24 + plan.ordinal[address] % 200


def add_nvidia(ctx: Ctx, gpus: list[DeviceSpec], pci: dict[str, str], plan: PciPlan) -> None:
    """The NVIDIA driver registers its nodes with register_chrdev and nvidia-modprobe
    mknods them: there is no sysfs class device and so no ``sys/dev/char`` link."""
    if not gpus:
        return
    ctx.chardev("nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR, None)
    ctx.chardev("nvidia-uvm", NVIDIA_UVM_MAJOR, 0, None)
    ctx.chardev("nvidia-uvm-tools", NVIDIA_UVM_MAJOR, 1, None)
    ctx.file("sys/module/nvidia/version", f"{NVIDIA_DRIVER_VERSION}\n")
    ctx.file(
        "proc/driver/nvidia/version",
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {NVIDIA_DRIVER_VERSION}  "
        "Thu Feb 22 01:44:30 UTC 2024\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n",
    )
    if any(_nvidia_proc.mig_mode(g, ctx.states[g.id]) for g in gpus):
        base = "proc/driver/nvidia/capabilities/mig"
        ctx.file(f"{base}/config", "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
        ctx.file(
            f"{base}/monitor", "DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
        )
        ctx.chardev("nvidia-caps/nvidia-cap1", NVIDIA_CAPS_MAJOR, 1, None, mode=0o400)
        ctx.chardev("nvidia-caps/nvidia-cap2", NVIDIA_CAPS_MAJOR, 2, None, mode=0o444)
        _mig_caps(ctx, [d for d in gpus if d.address in pci])
    # Sandbox-owned, for our NVML (docs/nvml.md): rebuilt with the tree on every change.
    # Keyed by what it reads: a change's partial builds (old and new states) and the
    # next change's reuse the text instead of formatting every GPU's line again.
    ids = {g.id for g in gpus}
    key = ("nvml", tuple(sorted((k, v) for k, v in ctx.given.items() if k in ids)))
    ctx.file(_nvidia_proc.STATE_PATH, ctx.memo(
        key, lambda: _nvidia_proc.state_text(gpus, pci, ctx.states, NVIDIA_DRIVER_VERSION)))
    for dev in gpus:
        gpu = dev.gpu
        if gpu is None or dev.address not in pci or not ctx.emits(dev.id):
            continue
        ctx.chardev(f"nvidia{gpu.minor}", NVIDIA_MAJOR, gpu.minor, None)
        ctx.file(
            f"proc/driver/nvidia/gpus/{dev.address}/information",
            f"Model: \t\t {dev.model_name}\n"
            f"IRQ:   \t\t {irq_of(plan, dev.address)}\n"
            f"GPU UUID: \t {dev.uuid}\n"
            "Video BIOS: \t 96.00.99.00.01\n"
            "Bus Type: \t PCIe\n"
            "DMA Size: \t 52 bits\n"
            "DMA Mask: \t 0xfffffffffffff\n"
            f"Bus Location: \t {dev.address}\n"
            f"Device Minor: \t {gpu.minor}\n"
            f"GPU Firmware: \t {NVIDIA_DRIVER_VERSION}\n"
            "GPU Excluded:\t No\n",
        )


def _mig_caps(ctx: Ctx, gpus: list[DeviceSpec]) -> None:
    """The access capabilities of each MIG GPU and compute instance (the instances our NVML
    reports, as the profile lays them out or NVML's lifecycle calls left them, docs/nvml.md):
    ``proc/driver/nvidia-caps/mig-minors`` names each one's
    nvidia-caps minor, ``proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<N>[/ci<M>]/
    access`` and ``dev/nvidia-caps/nvidia-cap<minor>`` hold them, as the driver's
    nvidia-caps module lays them out (15 GPU instances of 8 compute instances per GPU)."""
    lines = ["config 1", "monitor 2"]

    def cap(path: str, name: str, minor: int) -> None:
        lines.append(f"{name} {minor}")
        ctx.file(f"proc/driver/nvidia/capabilities/{path}",
                 f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
        ctx.chardev(f"nvidia-caps/nvidia-cap{minor}", NVIDIA_CAPS_MAJOR, minor, None,
                    mode=0o444)

    for dev in sorted(gpus, key=lambda d: d.gpu.minor if d.gpu else 0):
        gpu = dev.gpu
        if gpu is None:
            continue
        for m in _nvidia_proc.mig_devices(dev, ctx.states[dev.id]):
            gi_minor = 3 + gpu.minor * 15 * 9 + m.gi * 9
            cap(f"gpu{gpu.minor}/mig/gi{m.gi}/access", f"gpu{gpu.minor}/gi{m.gi}/access", gi_minor)
            if m.ci:
                cap(f"gpu{gpu.minor}/mig/gi{m.gi}/ci0/access",
                    f"gpu{gpu.minor}/gi{m.gi}/ci0/access", gi_minor + 1)
    ctx.file("proc/driver/nvidia-caps/mig-minors", "\n".join(lines) + "\n")


def drm_minors(index: int) -> tuple[int, int]:
    """(card minor, render minor) of the index-th DRM device in probe order.

    The first 64 take the legacy ranges (cardN = N, renderD128+N); after that kernels
    6.8+ hand out extended minors from 192 upwards, primary then render, per device.
    """
    if index < 64:
        return index, 128 + index
    k = 192 + 2 * (index - 64)
    return k, k + 1


def add_drm_common(ctx: Ctx, gpus: list[DeviceSpec]) -> None:
    """What a node with DRM devices has once: ``class/drm/version``, ``/dev/dri/by-path``
    and, for NVIDIA GPUs with DRM nodes, the ``nvidia_drm`` module (a DRM driver on top of
    ``nvidia``, the PCI driver: it binds no PCI function)."""
    ctx.file("sys/class/drm/version", "drm 1.1.0 20060810\n")
    ctx.dir("dev/dri/by-path")
    if ctx.emits(None) and any(d.vendor == "nvidia" for d in gpus):
        ctx.files("sys/module/nvidia_drm", {"initstate": "live\n", "refcnt": "0\n",
                                            "version": f"{NVIDIA_DRIVER_VERSION}\n"})
        ctx.file("sys/module/nvidia_drm/parameters/modeset", "N\n")
        ctx.dir("sys/module/nvidia_drm/holders")


def add_drm(ctx: Ctx, index: int, address: str, fn_path: str) -> None:
    card, render = drm_minors(index)
    for name, minor in ((f"card{card}", card), (f"renderD{render}", render)):
        sysdir = f"{fn_path}/drm/{name}"
        ctx.chardev(f"dri/{name}", DRM_MAJOR, minor, sysdir, "DEVTYPE=drm_minor\n")
        ctx.link(f"{sysdir}/device", fn_path)
        ctx.link(f"{sysdir}/subsystem", "sys/class/drm")
        ctx.link(f"sys/class/drm/{name}", sysdir)
    ctx.link(f"dev/dri/by-path/pci-{address}-card", f"dev/dri/card{card}")
    ctx.link(f"dev/dri/by-path/pci-{address}-render", f"dev/dri/renderD{render}")


def gfx_name(version: int) -> str:
    """KFD's gfx_target_version (major*10000 + minor*100 + stepping) as ``gfx942``."""
    major, minor, step = version // 10000, version // 100 % 100, version % 100
    return f"gfx{major}{minor}{step:x}"


def _partitioned(dev: DeviceSpec) -> bool:
    entry = catalogue.GPUS.get(dev.vendor, {}).get(dev.model)
    return entry is not None and entry.memory_slices > 0


def add_amd_attrs(ctx: Ctx, dev: DeviceSpec, fn_path: str) -> None:
    gpu = dev.gpu
    assert gpu is not None
    ctx.files(
        fn_path,
        {
            "mem_info_vram_total": f"{gpu.memory}\n",
            "mem_info_vram_used": "0\n",
            "gpu_busy_percent": "0\n",
            "unique_id": f"{int(dev.serial) & 0xFFFFFFFFFFFFFFFF:016x}\n",
            "product_name": f"{dev.model_name}\n",
            "serial_number": f"{dev.serial}\n",
        },
    )
    if _partitioned(dev):
        ctx.files(
            fn_path,
            {
                "available_compute_partition": "SPX, DPX, QPX, CPX\n",
                "available_memory_partition": "NPS1, NPS4\n",
            },
        )
        ctx.file(f"{fn_path}/current_compute_partition", "SPX\n", RW)
        ctx.file(f"{fn_path}/current_memory_partition", "NPS1\n", RW)


def _props(items: list[tuple[str, int]]) -> str:
    return "".join(f"{k} {v}\n" for k, v in items)


def _gpu_id(address: str) -> int:
    return int.from_bytes(hashlib.blake2b(address.encode(), digest_size=2).digest(), "big") | 1


def _io_link(frm: int, to: int, link_type: int, weight: int) -> str:
    return _props(
        [
            ("type", link_type),
            ("version_major", 0),
            ("version_minor", 0),
            ("node_from", frm),
            ("node_to", to),
            ("weight", weight),
            ("min_latency", 0),
            ("max_latency", 0),
            ("min_bandwidth", 312),
            ("max_bandwidth", 64000 if link_type == 11 else 32000),
            ("recommended_transfer_size", 0),
            ("recommended_sdma_engine_id_mask", 0),
            ("flags", 3),
        ]
    )


def add_kfd(ctx: Ctx, gpus: list[DeviceSpec], pci: dict[str, str]) -> None:
    """KFD topology: one node per NUMA node (CPU), then one per present AMD GPU."""
    if not gpus:
        return
    ctx.chardev("kfd", KFD_MAJOR, 0, KFD)
    ctx.link("sys/class/kfd/kfd", KFD)
    ctx.link(f"{KFD}/subsystem", "sys/class/kfd")
    ctx.files(
        f"{KFD}/topology",
        {
            "generation_id": "1\n",
            "system_properties": "platform_oem 0\nplatform_id 0\nplatform_rev 0\n",
        },
    )
    node = ctx.node
    live = [d for d in gpus if d.address in pci]
    ncpu_nodes = len(node.numa)
    gpu_node = {d.id: ncpu_nodes + i for i, d in enumerate(live)}
    for n in node.numa:
        base = f"{TOPOLOGY}/{n.id}"
        # amdkfd links a GPU without NUMA affinity (numa_node -1) to CPU node 0
        attached = [d for d in live if max(d.numa_node, 0) == n.id]
        ctx.files(
            base,
            {
                "gpu_id": "0\n",
                "name": "\n",
                "properties": _props(
                    [
                        ("cpu_cores_count", len(n.cpus)),
                        ("simd_count", 0),
                        ("mem_banks_count", 1),
                        ("caches_count", 0),
                        ("io_links_count", len(attached)),
                        ("p2p_links_count", 0),
                        ("cpu_core_id_base", min(n.cpus, default=0)),
                        ("simd_id_base", 0),
                        ("max_waves_per_simd", 0),
                        ("lds_size_in_kb", 0),
                        ("gds_size_in_kb", 0),
                        ("num_gws", 0),
                        ("wave_front_size", 0),
                        ("array_count", 0),
                        ("simd_arrays_per_engine", 0),
                        ("cu_per_simd_array", 0),
                        ("simd_per_cu", 0),
                        ("max_slots_scratch_cu", 0),
                        ("gfx_target_version", 0),
                        ("vendor_id", 0),
                        ("device_id", 0),
                        ("location_id", 0),
                        ("domain", 0),
                        ("drm_render_minor", 0),
                        ("hive_id", 0),
                        ("num_sdma_engines", 0),
                        ("num_sdma_xgmi_engines", 0),
                        ("num_sdma_queues_per_engine", 0),
                        ("num_cp_queues", 0),
                        ("max_engine_clk_ccompute", node.cpu.mhz),
                    ]
                ),
            },
        )
        ctx.file(
            f"{base}/mem_banks/0/properties",
            _props(
                [
                    ("heap_type", 0),
                    ("size_in_bytes", n.memory),
                    ("flags", 0),
                    ("width", 64),
                    ("mem_clk_max", 4800),
                ]
            ),
        )
        ctx.dir(f"{base}/caches")
        ctx.dir(f"{base}/p2p_links")
        ctx.dir(f"{base}/io_links")
        for k, d in enumerate(attached):
            ctx.file(f"{base}/io_links/{k}/properties", _io_link(n.id, gpu_node[d.id], 2, 20))
    for d in live:
        gpu = d.gpu
        assert gpu is not None
        idx = gpu_node[d.id]
        base = f"{TOPOLOGY}/{idx}"
        f = d.functions[0]
        devfn = int(f.address[8:10], 16) << 3 | int(f.address[11])
        peers = [p for p in live if p.id != d.id]
        xgmi = d.model in XGMI_MODELS
        ctx.files(
            base,
            {
                "gpu_id": f"{_gpu_id(d.address)}\n",
                "name": f"{gfx_name(gpu.gfx_target_version)}\n",
                "properties": _props(
                    [
                        ("cpu_cores_count", 0),
                        ("simd_count", gpu.simd_count),
                        ("mem_banks_count", 1),
                        ("caches_count", 0),
                        ("io_links_count", 1),
                        ("p2p_links_count", len(peers)),
                        ("cpu_core_id_base", 0),
                        ("simd_id_base", 0x80001000 + 0x100 * (idx - 1)),
                        ("max_waves_per_simd", 8),
                        ("lds_size_in_kb", 64),
                        ("gds_size_in_kb", 0),
                        ("num_gws", 64),
                        ("wave_front_size", 64),
                        ("array_count", 4),
                        ("simd_arrays_per_engine", 1),
                        ("cu_per_simd_array", 10),
                        ("simd_per_cu", 4),
                        ("max_slots_scratch_cu", 32),
                        ("gfx_target_version", gpu.gfx_target_version),
                        ("vendor_id", f.vendor_id),
                        ("device_id", f.device_id),
                        ("location_id", f.bus << 8 | devfn),
                        ("domain", f.domain),
                        ("drm_render_minor", drm_minors(gpu.minor)[1]),
                        ("hive_id", 0x5A5A0001 if xgmi else 0),
                        ("num_sdma_engines", 2),
                        ("num_sdma_xgmi_engines", 6 if xgmi else 0),
                        ("num_sdma_queues_per_engine", 8),
                        ("num_cp_queues", 24),
                        ("max_engine_clk_fcompute", 2100),
                        ("local_mem_size", 0),
                        ("fw_version", 177),
                        ("capability", 0x2E8A780),
                        ("debug_prop", 0x4A7),
                        ("sdma_fw_version", 19),
                        ("unique_id", int(d.serial)),
                        ("num_xcc", 8 if d.model == "mi300x" else 1),
                        ("max_engine_clk_ccompute", node.cpu.mhz),
                    ]
                ),
            },
        )
        ctx.file(
            f"{base}/mem_banks/0/properties",
            _props(
                [
                    ("heap_type", 1),
                    ("size_in_bytes", gpu.memory),
                    ("flags", 0),
                    ("width", 4096),
                    ("mem_clk_max", 1300),
                ]
            ),
        )
        ctx.dir(f"{base}/caches")
        ctx.file(f"{base}/io_links/0/properties", _io_link(idx, max(d.numa_node, 0), 2, 20))
        ctx.dir(f"{base}/p2p_links")
        for k, p in enumerate(peers):
            ctx.file(
                f"{base}/p2p_links/{k}/properties",
                _io_link(idx, gpu_node[p.id], 11 if xgmi else 2, 15 if xgmi else 40),
            )

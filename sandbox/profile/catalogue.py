"""Real hardware models a profile can name, with their real PCI identities.

IDs are public facts (the PCI ID registry, vendor datasheets); memory sizes are the
models' stated capacity. A profile names a model by its key (``h100-sxm5-80gb``); the
``generic`` device type is the escape hatch for anything not listed here.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class GpuModel:
    name: str
    vendor_id: int
    device_id: int
    class_code: int
    memory: int
    driver: str
    subsystem_vendor_id: int
    subsystem_device_id: int
    # MIG-like partitioning the model supports natively (memory slices, compute slices).
    memory_slices: int = 0
    compute_slices: int = 0
    gfx_target_version: int = 0  # AMD KFD topology
    simd_count: int = 0  # AMD KFD topology
    link_speed: str = "16.0 GT/s PCIe"
    link_width: int = 16
    max_vfs: int = 0  # SR-IOV virtual functions (Intel Flex/Max); VFs share the device id


@dataclass(frozen=True)
class NicModel:
    name: str
    vendor_id: int
    device_id: int
    vf_device_id: int
    class_code: int  # 0x020000 Ethernet; InfiniBand ports report 0x020700
    driver: str
    vf_driver: str
    speed: int  # Mb/s per port
    max_vfs: int
    rdma: bool
    oui: str  # MAC prefix the vendor uses
    link_speed: str = "16.0 GT/s PCIe"
    link_width: int = 16


@dataclass(frozen=True)
class FpgaModel:
    name: str
    vendor_id: int
    device_id: int
    class_code: int
    driver: str
    flavor: str  # dfl | generic
    ports: int
    afu_id: str
    bitstream_id: str


@dataclass(frozen=True)
class NvmeModel:
    name: str  # the controller's model number (Identify Controller MN), as sysfs shows it
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int
    subsystem_device_id: int
    capacity: int  # bytes, the stated capacity (IDEMA: 3.84 TB = 7501476528 sectors)
    firmware: str  # Identify Controller FR
    serial_prefix: str  # how the vendor's serial numbers start
    link_speed: str = "16.0 GT/s PCIe"
    link_width: int = 4


NVIDIA, AMD, INTEL, MELLANOX, XILINX = 0x10DE, 0x1002, 0x8086, 0x15B3, 0x10EE
SAMSUNG, KIOXIA = 0x144D, 0x1E0F
NVME_CLASS = 0x010802  # mass storage, non-volatile memory controller, NVM Express
TB_3_84 = 7501476528 * 512

GPUS: dict[str, dict[str, GpuModel]] = {
    "nvidia": {
        "h100-sxm5-80gb": GpuModel("NVIDIA H100 80GB HBM3", NVIDIA, 0x2330, 0x030200, 80 * GiB,
                                   "nvidia", NVIDIA, 0x16C1, 8, 7, link_speed="32.0 GT/s PCIe"),
        "a100-sxm4-80gb": GpuModel("NVIDIA A100-SXM4-80GB", NVIDIA, 0x20B2, 0x030200, 80 * GiB,
                                   "nvidia", NVIDIA, 0x1463, 8, 7),
        "a100-sxm4-40gb": GpuModel("NVIDIA A100-SXM4-40GB", NVIDIA, 0x20B0, 0x030200, 40 * GiB,
                                   "nvidia", NVIDIA, 0x134F, 8, 7),
        "a100-pcie-40gb": GpuModel("NVIDIA A100-PCIE-40GB", NVIDIA, 0x20F1, 0x030200, 40 * GiB,
                                   "nvidia", NVIDIA, 0x145F, 8, 7),
        "l40s": GpuModel("NVIDIA L40S", NVIDIA, 0x26B9, 0x030200, 48 * GiB,
                         "nvidia", NVIDIA, 0x1851),
        "t4": GpuModel("Tesla T4", NVIDIA, 0x1EB8, 0x030200, 16 * GiB,
                       "nvidia", NVIDIA, 0x12A2, link_speed="8.0 GT/s PCIe"),
    },
    "amd": {
        "mi300x": GpuModel("AMD Instinct MI300X", AMD, 0x74A1, 0x120000, 192 * GiB, "amdgpu",
                           AMD, 0x74A1, 8, 8, gfx_target_version=90402, simd_count=1216,
                           link_speed="32.0 GT/s PCIe"),
        "mi250x": GpuModel("AMD Instinct MI250X", AMD, 0x740C, 0x038000, 64 * GiB, "amdgpu",
                           AMD, 0x0B0C, gfx_target_version=90010, simd_count=440),
        "mi210": GpuModel("AMD Instinct MI210", AMD, 0x740F, 0x038000, 64 * GiB, "amdgpu",
                          AMD, 0x0C34, gfx_target_version=90010, simd_count=416),
    },
    "intel": {
        "flex-170": GpuModel("Intel Data Center GPU Flex 170", INTEL, 0x56C0, 0x038000,
                             16 * GiB, "i915", INTEL, 0x4905, max_vfs=31),
        "flex-140": GpuModel("Intel Data Center GPU Flex 140", INTEL, 0x56C1, 0x038000,
                             12 * GiB, "i915", INTEL, 0x4904, max_vfs=12),
        "max-1550": GpuModel("Intel Data Center GPU Max 1550", INTEL, 0x0BD5, 0x038000,
                             128 * GiB, "xe", INTEL, 0x0000, max_vfs=63),
        "max-1100": GpuModel("Intel Data Center GPU Max 1100", INTEL, 0x0BDA, 0x038000,
                             48 * GiB, "xe", INTEL, 0x0000, max_vfs=63),
    },
}

NICS: dict[str, dict[str, NicModel]] = {
    "mellanox": {
        "connectx-6": NicModel("Mellanox ConnectX-6", MELLANOX, 0x101B, 0x101C, 0x020000,
                               "mlx5_core", "mlx5_core", 100_000, 127, True, "b8:ce:f6"),
        "connectx-6dx": NicModel("Mellanox ConnectX-6 Dx", MELLANOX, 0x101D, 0x101E, 0x020000,
                                 "mlx5_core", "mlx5_core", 100_000, 127, True, "0c:42:a1"),
        "connectx-7": NicModel("Mellanox ConnectX-7", MELLANOX, 0x1021, 0x101E, 0x020000,
                               "mlx5_core", "mlx5_core", 400_000, 127, True, "a0:88:c2",
                               link_speed="32.0 GT/s PCIe"),
    },
    "intel": {
        "e810-c": NicModel("Intel Ethernet Controller E810-C", INTEL, 0x1592, 0x1889, 0x020000,
                           "ice", "iavf", 100_000, 256, True, "b4:96:91"),
        "x710": NicModel("Intel Ethernet Controller X710", INTEL, 0x1572, 0x154C, 0x020000,
                         "i40e", "iavf", 10_000, 64, False, "3c:fd:fe",
                         link_speed="8.0 GT/s PCIe", link_width=8),
    },
}

# NVMe drives GPU servers are sold with; PCI ids from the PCI ID registry (144d:a824
# "NVMe SSD Controller PM173X", 144d:a80a "PM9A1/PM9A3/980PRO", 8086:0b60 "NVMe DC SSD
# [3DNAND, Sentinel Rock Controller]", 1e0f:0003 "NVMe SSD Controller Cx6").
NVMES: dict[str, dict[str, NvmeModel]] = {
    "samsung": {
        "pm1733": NvmeModel("SAMSUNG MZWLJ3T8HBLS-00007", SAMSUNG, 0xA824, SAMSUNG, 0xA801,
                            TB_3_84, "EPK9CB5Q", "S4YNNE0R"),
        "pm9a3": NvmeModel("SAMSUNG MZQL23T8HCLS-00A07", SAMSUNG, 0xA80A, SAMSUNG, 0xA813,
                           TB_3_84, "GDC5602Q", "S64HNE0T"),
    },
    "intel": {
        "d7-p5510": NvmeModel("INTEL SSDPF2KX038TZ", INTEL, 0x0B60, INTEL, 0x8008, TB_3_84,
                              "JCV10100", "PHAX"),
    },
    "kioxia": {
        "cm6": NvmeModel("KIOXIA KCM6XRUL3T84", KIOXIA, 0x0003, KIOXIA, 0x0001, TB_3_84,
                         "0106", "X0U0A0"),
    },
}

FPGAS: dict[str, dict[str, FpgaModel]] = {
    "intel": {
        "pac-a10": FpgaModel("Intel PAC Arria 10 GX", INTEL, 0x09C4, 0x120000, "dfl-pci", "dfl",
                             1, "d8424dc4a4a3c413f89e433683f9040b", "0x123402506c1a"),
        "pac-n3000": FpgaModel("Intel PAC N3000", INTEL, 0x0B30, 0x120000, "dfl-pci", "dfl",
                               1, "9aeffe5f84570612c76a4cfb7a6f7e4f", "0x2300011001030f"),
        "pac-d5005": FpgaModel("Intel PAC D5005", INTEL, 0x0B2B, 0x120000, "dfl-pci", "dfl",
                               1, "a4f8a2c0f3a14b6d8bd5c7a1b0e6f9d2", "0x2300011001040f"),
    },
    "xilinx": {
        "alveo-u250": FpgaModel("Xilinx Alveo U250", XILINX, 0x5004, 0x120000, "xclmgmt",
                                "generic", 1, "", ""),
        "alveo-u200": FpgaModel("Xilinx Alveo U200", XILINX, 0x5000, 0x120000, "xclmgmt",
                                "generic", 1, "", ""),
    },
}

AMD_CPU = 0x1022  # AMD's CPU and chipset functions (0x1002 is AMD/ATI graphics)

# Root ports and switch ports the builder places above devices: the CPU vendor's PCIe root
# port (Intel Sapphire Rapids 8086:352a; AMD Genoa-class "GPP Bridge" 1022:14ab) and
# Broadcom PEX switch ports: plausible, real IDs.
ROOT_PORT = (INTEL, 0x352A)
ROOT_PORTS = {"GenuineIntel": ROOT_PORT, "AuthenticAMD": (AMD_CPU, 0x14AB)}
SWITCH_UPSTREAM = (0x1000, 0xC030)
SWITCH_DOWNSTREAM = (0x1000, 0xC030)
BRIDGE_CLASS = 0x060400


# The host bridge function 0000:00:00.0 ("Host bridge", class 0x060000) of the root complex:
# Intel Xeon Scalable "Sky Lake-E DMI3 Registers" 8086:2020; AMD EPYC "Starship/Matisse
# Root Complex" 1022:1480 (both named by pci.ids, so lspci shows them).
HOST_BRIDGE_CLASS = 0x060000
ROOT_COMPLEX = (INTEL, 0x2020)
ROOT_COMPLEXES = {"GenuineIntel": ROOT_COMPLEX, "AuthenticAMD": (AMD_CPU, 0x1480)}


def root_port(cpu_vendor: str) -> tuple[int, int]:
    """(vendor, device) of the PCIe root ports of a CPU vendor (Intel's for any other)."""
    return ROOT_PORTS.get(cpu_vendor, ROOT_PORT)


def root_complex(cpu_vendor: str) -> tuple[int, int]:
    """(vendor, device) of the host bridge function 0000:00:00.0 of a CPU vendor's root
    complex (Intel's for any other)."""
    return ROOT_COMPLEXES.get(cpu_vendor, ROOT_COMPLEX)


@dataclass(frozen=True)
class CacheLevel:
    level: int
    type: str  # Data | Instruction | Unified
    size_kb: int
    ways: int
    scope: str  # core | ccx (cores_per_ccx cores of one socket) | package


@dataclass(frozen=True)
class CacheLayout:
    name: str
    levels: tuple[CacheLevel, ...]
    l3_kb_per_core: int = 0  # package-wide L3 that grows with the cores (Intel)
    cores_per_ccx: int = 0  # AMD: cores sharing one L3 (a CCX)


# Per CPU generation, from the vendors' datasheets: Intel Xeon Sapphire Rapids (L3 1.875
# MiB per core, socket-wide); AMD Zen 2 (16 MiB L3 per 4-core CCX), Zen 3 and Zen 4 (32 MiB
# L3 per 8-core CCX; Zen 4 has 1 MiB L2), Zen 5 (48 KiB L1d).
INTEL_SPR = CacheLayout("sapphire-rapids", (
    CacheLevel(1, "Data", 48, 12, "core"), CacheLevel(1, "Instruction", 32, 8, "core"),
    CacheLevel(2, "Unified", 2048, 16, "core"), CacheLevel(3, "Unified", 0, 15, "package"),
), l3_kb_per_core=1920)
AMD_ZEN2 = CacheLayout("zen2", (
    CacheLevel(1, "Data", 32, 8, "core"), CacheLevel(1, "Instruction", 32, 8, "core"),
    CacheLevel(2, "Unified", 512, 8, "core"), CacheLevel(3, "Unified", 16384, 16, "ccx"),
), cores_per_ccx=4)
AMD_ZEN3 = CacheLayout("zen3", (
    CacheLevel(1, "Data", 32, 8, "core"), CacheLevel(1, "Instruction", 32, 8, "core"),
    CacheLevel(2, "Unified", 512, 8, "core"), CacheLevel(3, "Unified", 32768, 16, "ccx"),
), cores_per_ccx=8)
AMD_ZEN4 = CacheLayout("zen4", (
    CacheLevel(1, "Data", 32, 8, "core"), CacheLevel(1, "Instruction", 32, 8, "core"),
    CacheLevel(2, "Unified", 1024, 8, "core"), CacheLevel(3, "Unified", 32768, 16, "ccx"),
), cores_per_ccx=8)
AMD_ZEN5 = CacheLayout("zen5", (
    CacheLevel(1, "Data", 48, 12, "core"), CacheLevel(1, "Instruction", 32, 8, "core"),
    CacheLevel(2, "Unified", 1024, 16, "core"), CacheLevel(3, "Unified", 32768, 16, "ccx"),
), cores_per_ccx=8)


def cache_layout(vendor: str, family: int, model_number: int) -> CacheLayout:
    """The cache layout of a CPU by CPUID vendor, family and model: AMD family 0x17 is Zen
    2, 0x19 models below 0x10 Zen 3 (Milan), 0x19 from 0x10 Zen 4 (Genoa, Bergamo), 0x1a
    Zen 5; anything else gets Sapphire Rapids'."""
    if vendor == "AuthenticAMD":
        if family == 0x17:
            return AMD_ZEN2
        if family == 0x19:
            return AMD_ZEN3 if model_number < 0x10 else AMD_ZEN4
        if family >= 0x1A:
            return AMD_ZEN5
    return INTEL_SPR


# -- what a fault shows ----------------------------------------------------------------
GPU_ECC_REASONS = ("row-remap-pending", "row-remap-failure", "ecc-contained",
                   "ecc-uncontained")


def fault_reasons(kind: str, vendor: str | None) -> tuple[str, ...]:
    """The unhealthy reasons a device of this type shows where a reader looks
    (docs/health.md): every PCI device its AER counters (aer-fatal), its PCIe link
    (link-down; a NIC its network link) and falling off the bus (removed); a NIC its ports
    (port-down), an NVIDIA GPU its NVLink (port-down: NVML Xid 74); a GPU its ECC errors.
    Any other reason would show nothing, or another fault under its name."""
    out = ["aer-fatal", "link-down"]
    if kind == "nic" or (kind == "gpu" and vendor == "nvidia"):
        out.append("port-down")
    out.append("removed")
    if kind == "gpu":
        out += GPU_ECC_REASONS
    return tuple(out)


"""A minimal plausible sysfs/dev/proc tree for N NVIDIA GPUs on 2 NUMA nodes, for plugin tests.

Stand-in until tests switch to the real builder (``sandbox.fakehw``): regular files for
attributes, relative symlinks for the bus view, placeholder files for device nodes. Only
what the reference device plugin reads, laid out as on a real node.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

AER_FATAL_NAMES = (
    "Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF",
    "MalfTLP", "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP",
    "AtomicOpBlocked", "TLPBlockedErr", "PoisonTLPBlocked",
)  # fmt: skip


@dataclass(frozen=True)
class FakeGpu:
    bdf: str
    uuid: str
    minor: int
    numa_node: int
    sys_dir: Path  # the real (non-link) device directory


def aer_text(fatal: int) -> str:
    lines = [f"{name} {fatal if name == 'MalfTLP' else 0}" for name in AER_FATAL_NAMES]
    return "\n".join([*lines, f"TOTAL_ERR_FATAL {fatal}"]) + "\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_nvidia_tree(root: Path, gpus: int = 8, numa_nodes: int = 2) -> list[FakeGpu]:
    """Write GPUs 0..gpus-1, the first half on NUMA 0, the rest spread over later nodes."""
    per_node = -(-gpus // numa_nodes)
    made = []
    bus_dir = root / "sys" / "bus" / "pci" / "devices"
    bus_dir.mkdir(parents=True, exist_ok=True)
    # A host bridge the plugin must ignore.
    bridge = root / "sys" / "devices" / "pci0000:00" / "0000:00:00.0"
    for name, value in (("vendor", "0x8086"), ("device", "0x09a2"), ("class", "0x060000"),
                        ("numa_node", "0")):  # fmt: skip
        _write(bridge / name, value + "\n")
    os.symlink("../../../devices/pci0000:00/0000:00:00.0", bus_dir / "0000:00:00.0")
    for i in range(gpus):
        node = i // per_node
        bus = 0x17 + 0x10 * i
        bdf = f"0000:{bus:02x}:00.0"
        port = f"0000:00:{i + 1:02x}.0"
        real = root / "sys" / "devices" / "pci0000:00" / port / bdf
        attrs = {
            "vendor": "0x10de",
            "device": "0x2330",
            "subsystem_vendor": "0x10de",
            "subsystem_device": "0x16c1",
            "class": "0x030200",
            "revision": "0xa1",
            "numa_node": str(node),
            "local_cpulist": f"{node * 16}-{node * 16 + 15}",
            "modalias": "pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00",
            "aer_dev_fatal": aer_text(0).rstrip("\n"),
        }
        for name, value in attrs.items():
            _write(real / name, value + "\n")
        os.symlink(f"../../../devices/pci0000:00/{port}/{bdf}", bus_dir / bdf)
        uuid = f"GPU-{i:08x}-4820-abfc-e83e-94318197576e"
        info = root / "proc" / "driver" / "nvidia" / "gpus" / bdf / "information"
        _write(
            info,
            f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t {100 + i}\nGPU UUID: \t {uuid}\n"
            f"Video BIOS: \t 96.00.74.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
            f"DMA Mask: \t 0xfffffffffffff\nBus Location: \t {bdf}\nDevice Minor: \t {i}\n"
            f"GPU Excluded:\t No\n",
        )
        _write(root / "dev" / f"nvidia{i}", "")
        made.append(FakeGpu(bdf, uuid, i, node, real))
    for shared in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        _write(root / "dev" / shared, "")
    return made


def set_aer_fatal(gpu: FakeGpu, count: int) -> None:
    """Raise (or clear) the device's fatal AER counters, as the kernel would on an error."""
    tmp = gpu.sys_dir / "aer_dev_fatal.tmp"
    tmp.write_text(aer_text(count))
    tmp.replace(gpu.sys_dir / "aer_dev_fatal")  # atomic: a reader never sees half a file


def remove_gpu(root: Path, gpu: FakeGpu) -> None:
    """Hot-unplug: the device directory, its bus link and its /dev node vanish."""
    shutil.rmtree(gpu.sys_dir)
    (root / "sys" / "bus" / "pci" / "devices" / gpu.bdf).unlink()
    (root / "dev" / f"nvidia{gpu.minor}").unlink()

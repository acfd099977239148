"""Building a node's tree: pure functions of a resolved node and its device states.

    build_tree(node, states) -> Tree   the whole fake root (``sys/``, ``dev/``, ``proc/``)
    build_partial(...)                 one device's part of it (what a change rebuilds)

``node`` orders the subsystems; each lives in its own private module (``_cpu``, ``_pci``,
``_gpu``, ``_net``, ``_nvme``, ``_fpga``, ``_system``; ``_nvidia_proc`` the NVML state
file under ``proc/driver/nvidia`` that our NVML library reads; ``_common`` what they share).
No I/O: serving the tree is ``fakehw.serve``, writing it to a directory ``fakehw.render``.
"""

from sandbox.fakehw.builder._gpu import NVIDIA_DRIVER_VERSION
from sandbox.fakehw.builder.node import build_partial, build_tree

__all__ = ["NVIDIA_DRIVER_VERSION", "build_partial", "build_tree"]

"""The reference DRA driver: ResourceSlices from a node's /sys and /dev, and a kubelet plugin.

    discovery     devices (hwplugins.devices) -> GPUs, NICs, FPGAs named, with health problems
    config        the driver config (GPU memory, partition schemes) keyed by PCI id
    slices        devices -> a pool's ResourceSlices (counters, partitions, taints); pure
    devtypes      the device types (gpu, gpu-partition, nic, vf, fpga) alone
    publisher     ResourceSlices to the API server (official kubernetes client)
    state         prepared claims: CDI spec files and the JSON checkpoint
    kubeletplugin gRPC: Registration, DRAPlugin v1 + v1beta1, DRAResourceHealth v1 + v1alpha1
                  (sockets: hwplugins.kubeletsock)
    driver        the process: rescan loop, publisher, kubelet plugin (python -m hwplugins.dra)

Never imports the sandbox: it reads only the files a real driver would read. The names
below are imported on first use (``hwplugins.lazy``): ``devtypes.TYPES`` alone needs no more.
"""

from typing import TYPE_CHECKING

from hwplugins import lazy

if TYPE_CHECKING:
    from hwplugins.dra.config import (
        ConfigError,
        DriverConfig,
        config_from_devices,
        load_config,
        parse_config,
    )
    from hwplugins.dra.discovery import Device, Problem, discover, from_scan
    from hwplugins.dra.slices import (
        DRIVER,
        TAINT_KEY,
        Pool,
        PoolDevice,
        build_pool,
        resource_slices,
    )
else:
    __getattr__ = lazy.exports(__name__, {
        "config": ["ConfigError", "DriverConfig", "config_from_devices", "load_config",
                   "parse_config"],
        "discovery": ["Device", "Problem", "discover", "from_scan"],
        "slices": ["DRIVER", "TAINT_KEY", "Pool", "PoolDevice", "build_pool",
                   "resource_slices"],
    })  # fmt: skip

__all__ = [
    "DRIVER",
    "TAINT_KEY",
    "ConfigError",
    "Device",
    "DriverConfig",
    "Pool",
    "PoolDevice",
    "Problem",
    "build_pool",
    "config_from_devices",
    "discover",
    "from_scan",
    "load_config",
    "parse_config",
    "resource_slices",
]

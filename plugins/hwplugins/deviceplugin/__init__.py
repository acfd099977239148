"""Reference device plugin: PCI devices under a root's sys/ and dev/ become extended resources.

    discovery  devices (hwplugins.devices) -> resources: Device (id, resource, health, nodes)
    packing    GetPreferredAllocation's NUMA packing, a pure function
    config     the optional JSON config (extra rules, ignore list, PreStart options)
    server     one v1beta1 DevicePlugin server per resource, kept served and registered
               (hwplugins.kubeletsock)

Run it as ``python -m hwplugins.deviceplugin --root DIR --kubelet-dir DIR``. The names
below are imported on first use (``hwplugins.lazy``): ``discover`` alone needs no gRPC.
"""

from typing import TYPE_CHECKING

from hwplugins import lazy

if TYPE_CHECKING:
    from hwplugins.deviceplugin.config import Config, ConfigError, load_config
    from hwplugins.deviceplugin.discovery import (
        DEFAULT_RULES,
        HEALTHY,
        UNHEALTHY,
        Device,
        Rule,
        discover,
        group,
    )
    from hwplugins.deviceplugin.packing import pack
    from hwplugins.deviceplugin.server import ResourcePlugin, run
else:
    __getattr__ = lazy.exports(__name__, {
        "config": ["Config", "ConfigError", "load_config"],
        "discovery": ["DEFAULT_RULES", "HEALTHY", "UNHEALTHY", "Device", "Rule", "discover",
                      "group"],
        "packing": ["pack"],
        "server": ["ResourcePlugin", "run"],
    })  # fmt: skip

__all__ = [
    "DEFAULT_RULES",
    "HEALTHY",
    "UNHEALTHY",
    "Config",
    "ConfigError",
    "Device",
    "ResourcePlugin",
    "Rule",
    "discover",
    "group",
    "load_config",
    "pack",
    "run",
]

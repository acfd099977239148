"""A kubelet stand-in for plugin tests: device manager, plugin watcher, conformance check.

devicemanager  Registration server on <dir>/kubelet.sock; plugin clients; restart();
               allocate() with TopologyManager policies; snapshot(); the protocol log
resources      what it shows: resources, devices, health, allocations, events (values)
topology       NUMA hints, policy merge and device choice (pure)
pluginwatcher  plugins_registry: GetInfo / NotifyRegistrationStatus; DRA prepare calls
conformance    check(plugin_cmd): grade a plugin's kubelet protocol behaviour
livenode       check_on_node: a stock plugin graded on a profile's node served live
nodeview       the plugin's mount namespace: the tree at /sys, /dev, /proc/driver, the
               harness at /var/lib/kubelet/device-plugins
junit          a check's report as JUnit XML
"""

from typing import TYPE_CHECKING

from sandbox import lazy
from sandbox.errors import AllocationError, KubeletError, TopologyAffinityError

if TYPE_CHECKING:
    from sandbox.kubelet.conformance import CheckReport, CheckResult, check
    from sandbox.kubelet.devicemanager import DeviceManager
    from sandbox.kubelet.pluginwatcher import Claim, PluginWatcher, RegisteredPlugin
    from sandbox.kubelet.resources import (
        Allocation,
        DeviceInfo,
        Event,
        ResourceState,
        Snapshot,
        is_extended_resource_name,
    )
    from sandbox.kubelet.topology import Hint, Policy
else:
    __getattr__ = lazy.exports(__name__, {
        "conformance": ["CheckReport", "CheckResult", "check"],
        "devicemanager": ["DeviceManager"],
        "pluginwatcher": ["Claim", "PluginWatcher", "RegisteredPlugin"],
        "resources": ["Allocation", "DeviceInfo", "Event", "ResourceState", "Snapshot",
                      "is_extended_resource_name"],
        "topology": ["Hint", "Policy"],
    })

__all__ = [
    "Allocation",
    "AllocationError",
    "CheckReport",
    "CheckResult",
    "Claim",
    "DeviceInfo",
    "DeviceManager",
    "Event",
    "Hint",
    "KubeletError",
    "PluginWatcher",
    "Policy",
    "RegisteredPlugin",
    "ResourceState",
    "Snapshot",
    "TopologyAffinityError",
    "check",
    "is_extended_resource_name",
]

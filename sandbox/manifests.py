"""The plugin manifests the sandbox bundles (``plugins/manifests``), with what each shows."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sandbox.errors import SandboxError


@dataclass(frozen=True)
class PluginManifest:
    name: str
    file: str
    kind: str  # device-plugin | dra-driver
    shows: str
    profiles: str
    nvml: bool = False  # its pods load our libnvidia-ml.so.1 from each node (docs/nvml.md)

    def text(self) -> str:
        repo = Path(__file__).resolve().parents[1] / "plugins" / "manifests" / self.file
        if repo.is_file():
            return repo.read_text()
        return resources.files("sandbox.data.manifests").joinpath(self.file).read_text()


PLUGINS = (
    PluginManifest("hw-sandbox-device-plugin", "hw-sandbox-device-plugin.yaml", "device-plugin",
                   "our reference plugin: every profile device, NUMA-aware, health from sysfs",
                   "any"),
    PluginManifest("hw-sandbox-dra-driver", "hw-sandbox-dra-driver.yaml", "dra-driver",
                   "our reference DRA driver: ResourceSlices with partitions, NIC bandwidth,"
                   " health taints", "any (partition schemes: `sandbox dra config`)"),
    PluginManifest("sample-device-plugin", "sample-device-plugin.yaml", "device-plugin",
                   "Kubernetes' sample plugin: 2 fixed devices, kubelet protocol only", "any"),
    PluginManifest("generic-device-plugin", "generic-device-plugin.yaml", "device-plugin",
                   "squat's generic plugin: devices matched by globs under the fake /dev",
                   "8gpu-2numa, sriov-rdma"),
    PluginManifest("intel-gpu-plugin", "intel-gpu-plugin.yaml", "device-plugin",
                   "Intel's GPU plugin: cards from /sys/class/drm and /dev/dri",
                   "intel-flex-sriov"),
    PluginManifest("intel-fpga-plugin", "intel-fpga-plugin.yaml", "device-plugin",
                   "Intel's FPGA plugin: DFL ports from /sys/class/fpga_region, af or region"
                   " mode", "fpga-dfl"),
    PluginManifest("intel-qat-plugin", "intel-qat-plugin.yaml", "device-plugin",
                   "Intel's QAT plugin: QAT VFs on vfio-pci and their /dev/vfio groups",
                   "qat-vfio"),
    PluginManifest("nvidia-device-plugin", "nvidia-device-plugin.yaml", "device-plugin",
                   "NVIDIA's plugin and gpu-feature-discovery, unmodified, through our NVML"
                   " (docs/nvml.md)", "8gpu-2numa (any NVIDIA profile)", nvml=True),
    PluginManifest("amd-rocm-plugin", "amd-rocm-plugin.yaml", "device-plugin",
                   "AMD's ROCm plugin: amdgpu driver dirs and KFD topology", "amd-mi300x"),
    PluginManifest("dra-example-driver", "dra-example-driver.yaml", "dra-driver",
                   "kubernetes-sigs' DRA example driver: fake GPUs as ResourceSlices",
                   "any (needs DRA)"),
)


def find_plugin(name: str) -> PluginManifest:
    for plugin in PLUGINS:
        if plugin.name == name:
            return plugin
    known = ", ".join(p.name for p in PLUGINS)
    raise SandboxError(f"no bundled plugin {name!r} (have: {known})")

"""The plugin manifests the sandbox bundles (``plugins/manifests``), with what each shows,
and the templates ``sandbox plugins template`` fills for a plugin author's own image
(``plugin_template``).

Every file is read from ``plugins/manifests`` in a checkout, else from the package data
``sandbox.data.manifests`` (the same directory, shipped in the wheel): ``manifest_text``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sandbox.errors import SandboxError


def manifest_text(file: str) -> str:
    """The text of ``plugins/manifests/<file>``, in a checkout or an installed wheel."""
    repo = Path(__file__).resolve().parents[1] / "plugins" / "manifests" / file
    if repo.is_file():
        return repo.read_text()
    return resources.files("sandbox.data.manifests").joinpath(file).read_text()


@dataclass(frozen=True)
class PluginManifest:
    name: str
    file: str
    kind: str  # device-plugin | dra-driver
    shows: str
    profiles: str
    nvml: bool = False  # its pods load our libnvidia-ml.so.1 from each node (docs/nvml.md)

    def text(self) -> str:
        return manifest_text(self.file)


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
    PluginManifest("nvidia-dra-driver", "nvidia-dra-driver.yaml", "dra-driver",
                   "NVIDIA's DRA driver (gpu-kubelet-plugin), unmodified, through our NVML and"
                   " a driver root of ours: GPUs as ResourceSlices, claims by CDI",
                   "8gpu-2numa (any NVIDIA profile; needs DRA)", nvml=True),
    PluginManifest("amd-rocm-plugin", "amd-rocm-plugin.yaml", "device-plugin",
                   "AMD's ROCm plugin: amdgpu driver dirs and KFD topology", "amd-mi300x"),
    PluginManifest("dra-example-driver", "dra-example-driver.yaml", "dra-driver",
                   "kubernetes-sigs' DRA example driver: fake GPUs as ResourceSlices",
                   "any (needs DRA)"),
    PluginManifest("dra-driver-cpu", "dra-driver-cpu.yaml", "dra-driver",
                   "kubernetes-sigs' CPU DRA driver: the profile's CPUs as ResourceSlices "
                   "(NUMA node, socket, core, L3), cpusets through NRI",
                   "8gpu-2numa (any; needs DRA, containerd NRI)"),
    PluginManifest("sriov-network-device-plugin", "sriov-network-device-plugin.yaml",
                   "device-plugin", "k8snetworkplumbingwg's SR-IOV network device plugin: VF "
                   "pools by vendor/device/driver, netdevs checked over netlink",
                   "sriov-rdma (any with NIC VFs)"),
)


def find_plugin(name: str) -> PluginManifest:
    for plugin in PLUGINS:
        if plugin.name == name:
            return plugin
    known = ", ".join(p.name for p in PLUGINS)
    raise SandboxError(f"no bundled plugin {name!r} (have: {known})")


# `sandbox plugins template`: the files it fills, and the words in them it replaces
DEVICE_PLUGIN_TEMPLATE = "template-device-plugin.yaml"
DRA_DRIVER_TEMPLATE = "template-dra-driver.yaml"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_WORD = re.compile(r"__[A-Z]+__")


def check_dns_label(value: str, what: str) -> str:
    """``value`` if it is a DNS-1123 label (what a DaemonSet's name must be to serve as its
    pods' label and a namespace's name), else SandboxError saying what is allowed."""
    if not _DNS_LABEL.fullmatch(value):
        raise SandboxError(
            f"invalid {what} {value!r}: use a DNS-1123 label (lowercase letters, digits and "
            "'-', starting and ending with a letter or digit, at most 63 characters)")
    return value


def name_from_image(image: str) -> str:
    """A DaemonSet name from an image reference: its last path component without tag or
    digest (``registry:5000/acme/gpu_plugin:v1`` -> ``gpu-plugin``)."""
    last = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    name = re.sub(r"[^a-z0-9-]+", "-", last.lower()).strip("-")[:63].rstrip("-")
    if not name:
        raise SandboxError(f"cannot make a name from the image {image!r}: give --name")
    return name


def _check_image(image: str) -> str:
    if not image or image != image.strip() or any(c.isspace() for c in image) \
            or image.startswith("-"):
        raise SandboxError(f"invalid image reference {image!r}: give one like "
                           "registry.example.com/team/my-plugin:v1 or my-plugin:dev")
    return image


def plugin_template(image: str, name: str | None = None, namespace: str = "kube-system",
                    command: Sequence[str] = (), args: Sequence[str] = (),
                    dra: bool = False) -> str:
    """The commented manifest of a plugin author's own image on the sandbox's nodes: the
    device plugin template (``dra``: the DRA driver's) with its ``__WORDS__`` filled in.
    ``command``/``args`` empty: the image's ENTRYPOINT/CMD run. SandboxError for a name,
    namespace or image Kubernetes would refuse."""
    _check_image(image)
    name = check_dns_label(name if name is not None else name_from_image(image), "name")
    check_dns_label(namespace, "namespace")
    file = DRA_DRIVER_TEMPLATE if dra else DEVICE_PLUGIN_TEMPLATE
    text = manifest_text(file)
    values = {"__NAME__": name, "__NAMESPACE__": namespace, "__IMAGE__": json.dumps(image)}
    lines = []
    for line in text.splitlines(keepends=True):
        indent = line[:len(line) - len(line.lstrip())]
        body = line.strip()
        for key, flag, items, runs in (("command", "--command", command, "ENTRYPOINT"),
                                       ("args", "--args", args, "CMD")):
            if body == f"# __{key.upper()}__":
                # JSON strings are YAML flow scalars: any argument comes through as given
                line = (f"{indent}{key}: {json.dumps(list(items))}\n" if items else
                        f"{indent}# {key}: []   # not set ({flag}): the image's {runs} runs\n")
        if not line.lstrip().startswith("#"):
            for word, value in values.items():
                line = line.replace(word, value)
        lines.append(line)
    out = "".join(lines)
    left = sorted({m for line in out.splitlines() if not line.lstrip().startswith("#")
                   for m in _WORD.findall(line)})
    if left:  # a template word this code does not know: the two must change together
        raise SandboxError(f"{file}: unfilled {', '.join(left)}")
    return out

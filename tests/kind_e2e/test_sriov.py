"""The SR-IOV Network Device Plugin (k8snetworkplumbingwg, at the commit sriov-network-operator
pins), unmodified, in kind on sriov-rdma. A module of its own: the module's clusters stay up
until its end, and a fourth kind cluster beside test_plugins.py's three does not fit a
2-core machine (kubeadm timed out)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.kind_e2e.conftest import KindSandbox
from tests.support.thirdparty import plugin_binary, static_image

SRIOV_IMAGE = "localhost/hw-sandbox/sriov-network-device-plugin:v3.5.1-13-ga5a7395"
CX6_VF = "intel.com/cx6dx_vf"


def test_sriov_network_device_plugin_gives_a_pod_a_vf(
        sandbox_factory: Callable[..., KindSandbox]) -> None:
    """The SR-IOV network device plugin, unmodified, on sriov-rdma: its pod (hostNetwork) is
    in the node container's namespace, where the agent made the tree's netdevs real links,
    so it keeps every VF; a pod asking for one gets its PCI address in the plugin's env."""
    sb = sandbox_factory("sriov-rdma.yaml", "hwsb-e2e-sriov", "--no-device-plugin")
    pci_ids = Path("/usr/share/misc/pci.ids")
    assert pci_ids.is_file(), f"{pci_ids} missing: run scripts/install-system-deps"
    archive = static_image(plugin_binary("sriov-network-device-plugin"), SRIOV_IMAGE,
                           "/usr/bin/sriovdp", {"/usr/share/misc/pci.ids": pci_ids})
    subprocess.run(["kind", "load", "image-archive", str(archive), "--name", sb.name],
                   check=True, capture_output=True, env=sb.kenv.env, timeout=300)
    sb.sandbox("plugins", "deploy", "sriov-network-device-plugin", "--name", sb.name)
    sb.wait_resource("net-worker", CX6_VF, (8, 8), timeout=180)
    assert sb.resource("net-worker", "intel.com/e810_vf") == (2, 2)
    vfs = {line.split()[0] for line in subprocess.run(
        ["docker", "exec", f"{sb.name}-worker", "sh", "-c",
         "cd /var/lib/hw-sandbox/root/sys/bus/pci/devices && grep -l 0x101e */device"],
        capture_output=True, text=True, check=True).stdout.replace("/device", "").split()}
    assert len(vfs) == 8, vfs
    out = sb.run_pod({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sriov-vf"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "c", "image": "hw-sandbox:latest", "imagePullPolicy": "Never",
            "command": ["sh", "-c", "echo VF=$PCIDEVICE_INTEL_COM_CX6DX_VF"],
            "resources": {"limits": {CX6_VF: "1"}}}]},
    })
    vf = re.search(r"VF=(\S+)", out)
    assert vf, out
    assert vf.group(1) in vfs, out

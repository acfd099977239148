"""The bundled manifest plugins/manifests/nvidia-device-plugin.yaml on the native runtime,
as a user deploys it: NVIDIA's device plugin and gpu-feature-discovery v0.18.0
(UNMODIFIED) in pods of the real kubelet and containerd, through our NVML, instead of our
reference plugin.

The image the manifest names is made here from NVIDIA's binaries and the glibc they link
(tests/support/nvidia.py; there is no registry) and imported into the sandbox's containerd.
`sandbox plugins deploy nvidia-device-plugin` then links the host's /var/lib/hw-sandbox/
root and nvml (the manifest's hostPaths) to the sandbox's node tree and a copy of our
NVML, and applies the manifest (gpu-feature-discovery's output moved from the host's /etc
to /var/lib/hw-sandbox/features.d). The kubelet advertises 8/8 nvidia.com/gpu on the node
object and a 2-GPU pod sees exactly those 2 /dev/nvidiaN. Every `down` of the session
checks the links are gone (conftest.Footprint).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from cluster import (
    NativeCluster,
    check_two_gpu_pod,
    kubectl,
    pods_state,
    resource_counts,
    wait_until,
)

from sandbox.runtimes.native import kubelet_root
from sandbox.runtimes.native.hostpaths import HOST_STATE
from tests.plugins.test_nvidia_plugin import tree_gpus
from tests.support.nvidia import IMAGE, nvml_library, write_nvidia_image

GPU = "nvidia.com/gpu"
MANIFEST_NAMES = ("nvidia-device-plugin", "gpu-feature-discovery")


def _plugin_pods(cluster: NativeCluster) -> str:
    out = [pods_state(cluster, "kube-system", f"app.kubernetes.io/name={name}", tail=30)
           for name in MANIFEST_NAMES]
    return "\n".join(o for o in out if o) or "no pods of the manifest"


def test_bundled_manifest_brings_nvidias_plugin_to_the_node(
        nvidia_cluster: NativeCluster, tmp_path: Path) -> None:
    cluster = nvidia_cluster
    archive = write_nvidia_image(tmp_path / "nvidia-device-plugin.oci.tar")
    cluster.ctr("images", "import", str(archive))
    assert IMAGE in cluster.ctr("images", "ls", "-q").split()

    out = cluster.sandbox_cli("plugins", "deploy", "nvidia-device-plugin")
    placed = cluster.state_dir / "nvml" / "libnvidia-ml.so.1"
    assert f"our NVML for the node's pods: {placed}" in out, out
    assert placed.read_bytes() == nvml_library().read_bytes()
    for name, target in (("root", "node-root"), ("nvml", "nvml"), ("features.d", "features.d"),
                         ("control.sock", "node/control.sock")):
        assert os.readlink(HOST_STATE / name) == str(cluster.state_dir / target), out
    # our nvidia-smi beside it, answering from the node's tree as the host sees it there
    listed = subprocess.run([str(HOST_STATE / "nvml" / "nvidia-smi"), "-L"], capture_output=True,
                            text=True, timeout=60, check=True,
                            env={"HWSANDBOX_NVML_ROOT": str(HOST_STATE / "root")}).stdout
    assert sorted(re.findall(r"\(UUID: (GPU-[0-9a-f-]+)\)", listed)) == \
        sorted(tree_gpus(HOST_STATE / "root")), listed  # fmt: skip
    def phases() -> str:
        return kubectl(cluster, "-n", "kube-system", "get", "pods", "-l",
                        "app.kubernetes.io/name=nvidia-device-plugin", "-o",
                        "jsonpath={.items[*].status.phase}")  # fmt: skip

    try:
        # The pod first: the node's counts alone may still be an earlier plugin's (the
        # kubelet posts them every 10 s), and would let the test run ahead of this one.
        wait_until("NVIDIA's plugin pod to run", lambda: phases() == "Running", 180,
                   describe=lambda: _plugin_pods(cluster))
        wait_until(f"{GPU} 8/8 on the node", lambda: resource_counts(cluster, GPU) == (8, 8),
                   180, describe=lambda: f"{resource_counts(cluster, GPU)}\n"
                   f"{_plugin_pods(cluster)}")
        assert "nvidia-gpu.sock" in os.listdir(kubelet_root() / "device-plugins")

        check_two_gpu_pod(cluster, "nvm2")

        # gpu-feature-discovery, from the same manifest, labels what our NVML says; its
        # label file is in the sandbox's state dir, not the host's /etc
        gfd = cluster.state_dir / "features.d" / "gfd"
        wait_until("gpu-feature-discovery writes its labels",
                   lambda: gfd.is_file() and gfd.stat().st_size > 0, 120,
                   describe=lambda: _plugin_pods(cluster))
        labels = gfd.read_text().splitlines()
        for want in ("nvidia.com/gpu.count=8", "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
                     "nvidia.com/gpu.memory=81920", "nvidia.com/gpu.compute.major=9"):
            assert want in labels, labels
    finally:
        for name in MANIFEST_NAMES:
            kubectl(cluster, "-n", "kube-system", "delete", "daemonset", name,
                     "--ignore-not-found", "--wait=true")
        wait_until("the manifest's pods are gone", lambda: _plugin_pods(cluster)
                   == "no pods of the manifest", 120, describe=lambda: _plugin_pods(cluster))

"""NVIDIA's gpu-feature-discovery v0.18.0, UNMODIFIED, labels a live fake node through our
NVML: run once (``--oneshot``) with its labels written to a file, they match the profile.

It reads /sys (PCI devices, for vGPU detection) at the real path, so it runs in a private
mount namespace with the tree's sys bound there (tests/support/thirdparty.py).
"""

from __future__ import annotations

import subprocess

import pytest

from tests.support.nvidia import nvidia_binary, nvml_env
from tests.support.thirdparty import (
    Bind,
    in_private_mounts,
    live_node,
    require_private_mounts,
    short_dir,
)

pytestmark = [pytest.mark.root, pytest.mark.fuse, pytest.mark.network]


def _labels(profile: str, node: str, *flags: str) -> dict[str, str]:
    binary = nvidia_binary("gpu-feature-discovery")
    require_private_mounts()
    with live_node(profile, node) as live, short_dir("gfd-") as base:
        out = base / "labels"
        cmd = in_private_mounts(
            [str(binary), "--oneshot", "--no-timestamp", "--output-file", str(out),
             "--machine-type-file", str(base / "product_name"), *flags],
            [Bind(str(live.root / "sys"), "/sys")],
        )  # fmt: skip
        (base / "product_name").write_text("hw-sandbox\n")
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                                env=nvml_env(live, base / "nvml.log"))  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        log = base / "nvml.log"
        # every NVML call it made is implemented (our NVML logs the others)
        assert "unimplemented" not in (log.read_text() if log.exists() else ""), log.read_text()
        pairs = (line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
        return {k: v for k, v in pairs}


def test_gfd_labels_the_h100_node() -> None:
    labels = _labels("8gpu-2numa.yaml", "gpu-worker")
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.memory"] == str(80 * 1024)  # MiB, from the profile model
    assert labels["nvidia.com/gpu.compute.major"] == "9"
    assert labels["nvidia.com/gpu.compute.minor"] == "0"
    assert labels["nvidia.com/gpu.family"] == "hopper"
    assert labels["nvidia.com/mig.capable"] == "true"  # H100 can, MIG mode off here
    assert labels["nvidia.com/cuda.driver-version.full"] == "550.54.15"
    assert labels["nvidia.com/cuda.runtime-version.full"] == "12.4"
    assert labels["nvidia.com/gpu.machine"] == "hw-sandbox"
    assert not any(k.startswith("nvidia.com/mig-") for k in labels)


def test_gfd_labels_mig_devices_with_the_mixed_strategy() -> None:
    labels = _labels("mig-partitions.yaml", "mig-worker", "--mig-strategy", "mixed")
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert labels["nvidia.com/gpu.count"] == "4"
    assert labels["nvidia.com/gpu.family"] == "ampere"
    assert labels["nvidia.com/gpu.compute.major"] == "8"
    assert labels["nvidia.com/mig.capable"] == "true"
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    # each A100 in the balanced layout: 3g.40gb + 2g.20gb + 2 x 1g.10gb
    assert {k: v for k, v in labels.items() if k.endswith(".count") and "mig-" in k} == {
        "nvidia.com/mig-3g.40gb.count": "4",
        "nvidia.com/mig-2g.20gb.count": "4",
        "nvidia.com/mig-1g.10gb.count": "8",
    }
    assert labels["nvidia.com/mig-3g.40gb.memory"] == "40960"
    assert labels["nvidia.com/mig-3g.40gb.slices.gi"] == "3"
    assert labels["nvidia.com/mig-3g.40gb.product"] == "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb"

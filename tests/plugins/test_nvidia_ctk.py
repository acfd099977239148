"""NVIDIA's ``nvidia-ctk cdi generate`` (nvidia-container-toolkit v1.20.0, UNMODIFIED, built
by scripts/build-plugins) on a node as the sandbox serves it: the live FUSE tree is its
device root (and, in a private mount namespace, the host's /proc/driver, where it reads MIG
minors), and its driver root is the one ``python -m sandbox.nvml --driver-root`` lays out
(our NVML under the node's driver version, our nvidia-smi). No file is added by hand.

The spec has one device per GPU by index and by UUID with exactly that GPU's /dev/nvidiaN
(the tree's major and minor), the driver's control nodes and our library and nvidia-smi
as mounts; on mig-partitions, one device per MIG device (by ``gpu:mig`` index and MIG
UUID) with its parent's node and its two nvidia-caps access nodes; after an unplug, the
GPU is gone from a new spec. NVML is asked nothing it does not implement.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sandbox.nvml import driver_root
from sandbox.nvml.build import driver_version
from tests.plugins.test_nvidia_plugin import tree_gpus
from tests.support.nvidia import nvidia_ctk, nvml_library
from tests.support.thirdparty import (
    Bind,
    LiveNode,
    in_private_mounts,
    live_node,
    require_private_mounts,
)

pytestmark = [pytest.mark.root, pytest.mark.fuse]

LIBDIR = "usr/lib/x86_64-linux-gnu"


def generate(live: LiveNode, work: Path) -> dict[str, Any]:
    """``nvidia-ctk cdi generate`` against ``live``; the spec, parsed."""
    require_private_mounts()
    nvml_library()  # fails with its own hint when gcc is missing
    driver = driver_root(work / "driver", driver_version(live.root))
    spec, log = work / "spec.yaml", work / "nvml.log"
    argv = in_private_mounts(
        ["env", f"LD_LIBRARY_PATH={driver / LIBDIR}", f"HWSANDBOX_NVML_ROOT={live.root}",
         f"HWSANDBOX_NVML_LOG={log}", str(nvidia_ctk()), "cdi", "generate",
         f"--driver-root={driver}", f"--dev-root={live.root}", f"--output={spec}"],
        [Bind(str(live.root / "proc/driver"), "/proc/driver")],
    )  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Generated CDI spec" in result.stderr
    assert "unimplemented" not in (log.read_text() if log.exists() else "")
    parsed: dict[str, Any] = yaml.safe_load(spec.read_text())
    # the driver's files come from our driver root, under their usual paths
    version = driver_version(live.root)
    mounts = {m["containerPath"]: m["hostPath"] for m in parsed["containerEdits"]["mounts"]}
    assert mounts[f"/{LIBDIR}/libnvidia-ml.so.{version}"] == \
        str(driver / LIBDIR / f"libnvidia-ml.so.{version}")  # fmt: skip
    assert mounts["/usr/bin/nvidia-smi"] == str(driver / "usr/bin/nvidia-smi")
    control = {n["path"] for n in parsed["containerEdits"]["deviceNodes"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= control, control
    return parsed


def nodes(device: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    return [(n["path"], n["hostPath"], n["major"], n.get("minor", 0))
            for n in device["containerEdits"]["deviceNodes"]]  # fmt: skip


def test_a_spec_with_every_gpu_by_index_and_uuid(tmp_path: Path) -> None:
    with live_node("8gpu-2numa.yaml", "gpu-worker") as live:
        gpus = sorted(tree_gpus(live.root).values(), key=lambda g: g.bdf)
        spec = generate(live, tmp_path / "before")
        assert spec["kind"] == "nvidia.com/gpu"
        devices = {d["name"]: d for d in spec["devices"]}
        assert set(devices) == {str(i) for i in range(8)} | {g.uuid for g in gpus} | {"all"}
        for i, g in enumerate(gpus):  # NVML's index: PCI bus order
            want = [(f"/dev/nvidia{g.minor}", str(live.root / f"dev/nvidia{g.minor}"), 195,
                     g.minor)]  # fmt: skip
            assert nodes(devices[str(i)]) == want
            assert nodes(devices[g.uuid]) == want

        with live.client() as client:
            gone = client.devices()["gpu6"]["pci_address"]
            client.unplug("gpu6")
        spec = generate(live, tmp_path / "after")
        names = {d["name"] for d in spec["devices"]}
        assert names == {str(i) for i in range(7)} | {g.uuid for g in gpus if g.bdf != gone} \
            | {"all"}  # fmt: skip


def test_mig_devices_with_their_caps(tmp_path: Path) -> None:
    with live_node("mig-partitions.yaml", "mig-worker") as live:
        state = (live.root / "proc/driver/nvidia/hwsandbox/nvml").read_text()
        migs = re.findall(r"^mig (\S+) gi=(\d+) ci=(\d+) .* uuid=(\S+)$", state, re.MULTILINE)
        minors = {g.bdf: g.minor for g in tree_gpus(live.root).values()}
        spec = generate(live, tmp_path)
        devices = {d["name"]: d for d in spec["devices"]}
        order = sorted(minors)  # NVML's index: PCI bus order
        want_names = {"all"}
        for bdf, gi, ci, uuid in migs:
            want_names.add(uuid)
            parent = minors[bdf]
            got = nodes(devices[uuid])
            assert got[0][:2] == (f"/dev/nvidia{parent}", str(live.root / f"dev/nvidia{parent}"))
            caps = [path for path, _, _, _ in got[1:]]
            assert len(caps) == 2, got  # the GPU instance's and the compute instance's access
            assert all(c.startswith("/dev/nvidia-caps/nvidia-cap") for c in caps), caps
            # the minors the tree's nvidia-caps list gives these instances
            listed = (live.root / "proc/driver/nvidia-caps/mig-minors").read_text()
            for cap, want in ((f"gpu{parent}/gi{gi}/access", caps[0]),
                              (f"gpu{parent}/gi{gi}/ci{ci}/access", caps[1])):  # fmt: skip
                minor = re.search(rf"^{re.escape(cap)} (\d+)$", listed, re.MULTILINE)
                assert minor, cap
                assert want == f"/dev/nvidia-caps/nvidia-cap{minor.group(1)}"
        per_gpu = {bdf: [u for b, _, _, u in migs if b == bdf] for bdf in order}
        for i, bdf in enumerate(order):
            for j, uuid in enumerate(per_gpu[bdf]):
                want_names.add(f"{i}:{j}")
                assert nodes(devices[f"{i}:{j}"]) == nodes(devices[uuid])
        assert set(devices) == want_names

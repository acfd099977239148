"""NVIDIA's DRA driver v0.4.1, unmodified, with the MIG devices of mig-partitions on the
native runtime (issue 23, item 2; the driver's image and deploy as in
test_native_nvidia_dra.py).

The driver finds the MIG devices through our NVML and the tree's /proc/driver/nvidia/
capabilities, which the manifest's shell binds at its fixed path with the tree's
/proc/devices (nvidia-caps' major). It publishes them as devices of type mig with their
profiles; a claim for one 1g.10gb (DeviceClass mig.nvidia.com) runs a pod that sees its
parent's /dev/nvidiaN and that instance's two nvidia-caps nodes. The CDI spec names those
with the tree's own numbers (237:<minor>); the runtime wrapper in front of runc makes
them /dev/null stand-ins (1:3) in the pod, so a profile's numbers never become a real
device node.

Runs on ``mig_nvidia_cluster`` (mig-partitions: 4 A100 80GB with 3g.40gb + 2g.20gb +
2 x 1g.10gb each; no device plugin, no DRA driver of ours).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from cluster import NativeCluster, nvidia_minors, pod_log, wait_until
from nvidia_dra import attr, claim_pod, claim_spec_file, deployed, devices, driver_log

from sandbox.fakehw.control import ControlClient
from sandbox.nvml.build import SMI_NAME
from tests.support.nvidia import nvml_library

MIGS = {"3g.40gb": 4, "2g.20gb": 4, "1g.10gb": 8}  # the profile's, over its 4 GPUs


def _access_minors(root: Path, parent_minor: int) -> set[tuple[int, int]]:
    """(GI access minor, CI access minor) of every compute instance of a GPU, from the
    tree's /proc/driver/nvidia/capabilities (what the driver reads)."""
    def minor(path: Path) -> int:
        found = re.search(r"DeviceFileMinor:\s*(\d+)", path.read_text())
        assert found, path
        return int(found.group(1))

    mig = root / "proc/driver/nvidia/capabilities" / f"gpu{parent_minor}" / "mig"
    return {(minor(gi / "access"), minor(ci / "access"))
            for gi in mig.glob("gi*") for ci in gi.glob("ci*")}


def test_nvidia_dra_driver_publishes_mig_devices_and_a_mig_claim_runs(
        mig_nvidia_cluster: NativeCluster, tmp_path: Path) -> None:
    cluster = mig_nvidia_cluster
    minors = nvidia_minors(cluster)
    with deployed(cluster, tmp_path, sum(MIGS.values())):
        migs = devices(cluster)
        assert {attr(d, "type") for d in migs.values()} == {"mig"}, migs
        profiles = [attr(d, "profile") for d in migs.values()]
        assert {p: profiles.count(p) for p in MIGS} == MIGS, profiles
        assert {attr(d, "parentUUID") for d in migs.values()} == set(minors), migs

        pod = "nvidia-dra-mig"
        command = "ls /dev /dev/nvidia-caps; stat -c 'caps %n %t:%T' /dev/nvidia-caps/*"
        one = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {
            "expression": "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]}
        with claim_pod(cluster, pod, one, command) as (result, uid):
            device = migs[result["device"]]
            assert attr(device, "profile") == "1g.10gb", device
            parent = minors[attr(device, "parentUUID")]
            out = pod_log(cluster, pod)
            words = out.split()
            assert sorted(n for n in words if re.fullmatch(r"nvidia\d+", n)) == \
                [f"nvidia{parent}"], out  # fmt: skip
            caps = re.findall(r"^caps /dev/nvidia-caps/nvidia-cap(\d+) (\w+):(\w+)$", out, re.M)
            assert len(caps) == 2, out
            assert {(major, minor) for _, major, minor in caps} == {("1", "3")}, out
            pair = tuple(sorted(int(n) for n, _, _ in caps))
            pairs = {tuple(sorted(p)) for p in
                     _access_minors(cluster.state_dir / "node-root", parent)}
            assert pair in pairs, (pair, pairs)
            spec = claim_spec_file(cluster, uid).read_text()
            for n in pair:  # the spec has the tree's numbers; the pod got stand-ins
                assert f"/dev/nvidia-caps/nvidia-cap{n}" in spec, spec
            assert "major: 237" in spec, spec


def _instances(cluster: NativeCluster) -> dict[str, list[dict[str, object]]]:
    """GPU -> its GPU instances now, as the node's control API reports them."""
    with ControlClient(cluster.state_dir / "node" / "control.sock") as client:
        return {k: d["mig"] for k, d in client.devices().items() if "mig" in d}


def _smi_migs(cluster: NativeCluster) -> list[str]:
    """The MIG devices our nvidia-smi -L lists, NVML in a process of its own."""
    out = subprocess.run(
        [str(nvml_library().with_name(SMI_NAME)), "-L"], capture_output=True, text=True,
        env={"HWSANDBOX_NVML_ROOT": str(cluster.state_dir / "node-root"),
             "PATH": os.environ["PATH"]}, check=True, timeout=60).stdout  # fmt: skip
    return [line.strip() for line in out.splitlines() if line.strip().startswith("MIG ")]


def test_nvidia_dra_driver_dynamic_mig_creates_an_instance_per_claim(
        mig_nvidia_cluster: NativeCluster, tmp_path: Path) -> None:
    """With the driver's DynamicMIG gate (issue 23, item 4) it destroys the profile's
    instances at start (none is claimed) and publishes every profile at every placement
    (13 per A100 80GB); a claim for a 1g.10gb creates that instance through our NVML, seen
    at once by nvidia-smi in another process, the control API, the capabilities and
    /dev/nvidia-caps; the pod gets it; deleting pod and claim destroys it. `sandbox fault
    reset` puts the profile's layout back for the tests after this one."""
    cluster = mig_nvidia_cluster
    root = cluster.state_dir / "node-root"
    try:
        with deployed(cluster, tmp_path, 4 * 13, "FEATURE_GATES=DynamicMIG=true",
                      "HWSANDBOX_NVML_LOG=-"):  # its log then names any call we lack
            wait_until("the driver to destroy the profile's instances",
                       lambda: not any(_instances(cluster).values()), 60,
                       describe=lambda: f"{_instances(cluster)}\n{driver_log(cluster)[-3000:]}")
            assert _smi_migs(cluster) == []
            migs = devices(cluster)
            assert {attr(d, "type") for d in migs.values()} == {"mig"}, sorted(migs)
            profiles = [attr(d, "profile") for d in migs.values()]
            assert {p: profiles.count(p) for p in set(profiles)} == \
                {"1g.10gb": 28, "2g.20gb": 12, "3g.40gb": 8, "7g.80gb": 4}  # fmt: skip

            pod = "nvidia-dynmig"
            one = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {
                "expression": "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]}
            command = "ls /dev /dev/nvidia-caps"
            with claim_pod(cluster, pod, one, command) as (result, _uid):
                name = result["device"]  # gpu-<minor>-mig-1g10gb-<profile id>-<start>
                found = re.fullmatch(r"gpu-(\d+)-mig-1g10gb-\d+-(\d+)", name)
                assert found, name
                minor, start = int(found.group(1)), int(found.group(2))
                made = {k: v for k, v in _instances(cluster).items() if v}
                assert len(made) == 1, made
                [(gpu, [instance])] = made.items()
                assert (instance["profile"], instance["start"], instance["ci"]) == \
                    ("1g.10gb", start, True), instance  # fmt: skip
                [listed] = _smi_migs(cluster)
                assert listed.startswith("MIG 1g.10gb"), listed
                gi = instance["gi"]
                caps = root / f"proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{gi}"
                assert (caps / "access").is_file()
                assert (caps / "ci0/access").is_file()
                gi_minor = 3 + minor * 15 * 9 + int(str(gi)) * 9
                assert (root / f"dev/nvidia-caps/nvidia-cap{gi_minor + 1}").exists()
                out = pod_log(cluster, pod)
                assert f"nvidia{minor}" in out.split(), out
                assert f"nvidia-cap{gi_minor + 1}" in out.split(), out
            wait_until("the claim's instance destroyed",
                       lambda: not any(_instances(cluster).values()), 60,
                       describe=lambda: f"{_instances(cluster)}\n{driver_log(cluster)[-3000:]}")
            assert _smi_migs(cluster) == []
            assert not (root / f"dev/nvidia-caps/nvidia-cap{gi_minor + 1}").exists()
    finally:
        cluster.sandbox_cli("fault", "reset", cluster.node.name)
    assert sum(len(v) for v in _instances(cluster).values()) == sum(MIGS.values())

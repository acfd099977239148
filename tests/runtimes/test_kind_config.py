"""Generated kind configs are accepted by the real kind binary's config loader.

kind is built from its Go module. Docker is not needed: a stand-in `docker` on PATH
answers kind's provider probes (`docker info`, `docker ps`, the image check) and refuses
everything else, so kind loads, decodes (strictly) and validates the config for real and
then stops at its first real Docker call (creating the network). Reaching that call
means the config passed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from sandbox.profile import load_profile
from sandbox.runtimes.kind.config import HostFacts, kind_config, kind_config_text
from tests.support.gotools import go_install
from tests.support.paths import REPO as ROOT

pytestmark = [pytest.mark.network]

PROFILES = sorted((ROOT / "profiles").glob("*.yaml"))
KIND_VERSION = "v0.32.0"  # writes kubeadm v1beta4 (1.36+); warns, not refuses, on cgroup v1

STUB_DOCKER = """#!/bin/sh
case "$1" in
  -v) echo "Docker version 28.0.0, build stub" ;;
  info)
    case "$*" in
      *Driver*) echo overlay2 ;;
      *SecurityOptions*) echo "'[]'" ;;
      *) echo '{"CgroupDriver":"cgroupfs","CgroupVersion":"1","MemoryLimit":true,'\
'"PidsLimit":true,"CPUShares":true,"SecurityOptions":[]}' ;;
    esac ;;
  ps) ;;
  inspect) echo '[{}]' ;;
  *) echo "STUB-DOCKER: stopped at: $*" >&2; exit 1 ;;
esac
"""


@pytest.fixture(scope="module")
def kind(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    exe = go_install("sigs.k8s.io/kind", KIND_VERSION, "kind")
    stub = tmp_path_factory.mktemp("stub-docker")
    (stub / "docker").write_text(STUB_DOCKER)
    (stub / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"}
    return exe, env


def _create(kind: tuple[Path, dict[str, str]], config: Path) -> str:
    exe, env = kind
    result = subprocess.run(
        [str(exe), "create", "cluster", "--name", "hwsb-validate", "--config", str(config),
         "--image", "kindest/node:v1.34.0"],
        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode != 0
    return result.stderr


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_kind_accepts_generated_config(kind: tuple[Path, dict[str, str]], profile: Path,
                                       tmp_path: Path) -> None:
    cluster = load_profile(profile).cluster
    config = tmp_path / "kind.yaml"
    config.write_text(kind_config_text(cluster, "hwsb", Path("/run/hw-sandbox/hwsb")))
    stderr = _create(kind, config)
    assert "STUB-DOCKER: stopped at: network" in stderr, stderr
    assert "config" not in stderr.lower(), stderr


def test_kind_rejects_a_broken_config(kind: tuple[Path, dict[str, str]],
                                      tmp_path: Path) -> None:
    """The check has teeth: kind's loader really reads what we generate."""
    cluster = load_profile(PROFILES[0]).cluster
    doc = kind_config(cluster, "hwsb", Path("/run/hw-sandbox/hwsb"))
    doc["nodes"][-1]["extraMounts"][0]["propagation"] = "Sideways"
    config = tmp_path / "kind.yaml"
    config.write_text(yaml.safe_dump(doc))
    stderr = _create(kind, config)
    assert 'Unknown MountPropagation: "Sideways"' in stderr


def test_one_kind_node_per_replica_plus_control_plane() -> None:
    cluster = load_profile(ROOT / "profiles" / "workshop-mixed.yaml").cluster
    doc = kind_config(cluster, "ws", Path("/run/hw-sandbox/ws"))
    labels = [n["labels"]["hwsandbox.dev/node"] for n in doc["nodes"]]
    assert labels == ["control-plane", "gpu-worker-0", "gpu-worker-1", "net-worker"]
    cluster = load_profile(ROOT / "profiles" / "8gpu-2numa.yaml").cluster
    doc = kind_config(cluster, "g", Path("/run/hw-sandbox/g"))
    assert [n["role"] for n in doc["nodes"]] == ["control-plane", "worker"]
    assert "enable_cdi = true" in doc["containerdConfigPatches"][0]


def test_kind_accepts_host_patches(kind: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """cgroup v1 (failCgroupV1: false), no CAP_SYS_RESOURCE (restrict_oom_score_adj) and the
    minimal node image (no default CNI) all pass kind's loader."""
    cluster = load_profile(ROOT / "profiles" / "workshop-mixed.yaml").cluster
    facts = HostFacts(cgroup_v1=True, restrict_oom=True, minimal=True)
    doc = kind_config(cluster, "hwsb", Path("/run/hw-sandbox/hwsb"), "img:1", facts)
    assert doc["networking"] == {"disableDefaultCNI": True}
    assert "failCgroupV1: false" in doc["kubeadmConfigPatches"][-1]
    assert "restrict_oom_score_adj = true" in doc["containerdConfigPatches"][-1]
    assert {n["image"] for n in doc["nodes"]} == {"img:1"}
    config = tmp_path / "kind.yaml"
    config.write_text(yaml.safe_dump(doc))
    stderr = _create(kind, config)
    assert "STUB-DOCKER: stopped at: network" in stderr, stderr
    plain = kind_config(cluster, "hwsb", Path("/run/hw-sandbox/hwsb"))
    assert "networking" not in plain
    assert not any("failCgroupV1" in p for p in plain["kubeadmConfigPatches"])


def test_each_replica_shows_its_kubelets_pod_resources_dir_to_the_host() -> None:
    """The host reaches each node kubelet's pod-resources socket (`sandbox status`) through
    a bind mount of the replica's host dir; the control plane kind adds has none."""
    from sandbox.runtimes.kind import KindRuntime

    state = Path("/run/hw-sandbox/ws")
    cluster = load_profile(ROOT / "profiles" / "workshop-mixed.yaml").cluster
    doc = kind_config(cluster, "ws", state)
    for node in doc["nodes"]:
        replica = node["labels"]["hwsandbox.dev/node"] if "labels" in node else None
        mounts = [m for m in node.get("extraMounts", [])
                  if m["containerPath"] == "/var/lib/kubelet/pod-resources"]
        if replica is None:
            assert mounts == []
            continue
        socket = KindRuntime().pod_resources_socket(state, replica)
        assert socket is not None
        assert mounts == [{"hostPath": str(socket.parent),
                           "containerPath": "/var/lib/kubelet/pod-resources"}]
        assert socket.parent == state / "nodes" / replica / "pod-resources"


def test_every_node_runs_runc_through_the_cpuset_mapper() -> None:
    """Issue 22: containerd on every node (the control plane kind adds too) names the
    wrapper as runc's binary from its first start, and every node sees its directory."""
    state = Path("/run/hw-sandbox/ws")
    cluster = load_profile(ROOT / "profiles" / "workshop-mixed.yaml").cluster
    doc = kind_config(cluster, "ws", state)
    for node in doc["nodes"]:
        assert {"hostPath": str(state / "bin"), "containerPath": "/opt/hw-sandbox/bin",
                "readOnly": True} in node["extraMounts"], node
    patches = doc["containerdConfigPatches"]
    assert ('[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
            '  BinaryName = "/opt/hw-sandbox/bin/runc-cpumap"') in patches

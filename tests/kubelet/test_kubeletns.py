"""The kubelet's mount namespace (``sandbox.runtimes.kubeletns``) and kind's reconfiguration
files (``sandbox.runtimes.kind.topology``), run for real: the namespace script under
``unshare`` on a rendered 8gpu-2numa tree, with a shell standing in for the kubelet."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import load_profile
from sandbox.runtimes import kubeletns
from sandbox.runtimes.kind import topology as kindtopology
from tests.support.paths import REPO

pytestmark = [pytest.mark.root]

PROFILE = REPO / "profiles" / "8gpu-2numa.yaml"
READ = ("cat /sys/devices/system/cpu/online; ls /sys/devices/system/node | grep -c '^node[0-9]'; "
        "grep -c '^processor' /proc/cpuinfo; grep MemTotal /proc/meminfo; "
        "touch /sys/devices/system/cpu/online 2>/dev/null && echo writable || echo read-only")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0:
        pytest.fail("needs root (mount namespaces and bind mounts): run the tests as root")
    node = load_profile(PROFILE).cluster.nodes[0]
    root = tmp_path_factory.mktemp("tree")
    render(build_tree(node, {}), str(root), force=True)
    return root


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.alone  # counts the host's mounts before and after
def test_the_command_sees_the_trees_machine_and_the_host_keeps_its_own(tree: Path) -> None:
    host_before = Path("/sys/devices/system/cpu/online").read_text()
    mounts_before = Path("/proc/self/mountinfo").read_text().count("\n")
    proc = _run([*kubeletns.argv_prefix(tree), "sh", "-c", READ])
    assert proc.returncode == 0, proc.stderr
    online, nodes, processors, memtotal, writable = proc.stdout.splitlines()
    assert (online, nodes, processors) == ("0-63", "2", "64")
    assert memtotal.split()[1] == str(512 * 1024 * 1024)  # kB
    assert writable == "read-only"
    # nothing propagated out: the host's files and mounts are as they were
    assert Path("/sys/devices/system/cpu/online").read_text() == host_before
    assert Path("/proc/self/mountinfo").read_text().count("\n") == mounts_before


def test_the_command_is_execd_with_its_arguments_and_exit_code(tree: Path) -> None:
    proc = _run([*kubeletns.argv_prefix(tree), "sh", "-c", 'echo "$0 $1"; exit 7', "a", "b c"])
    assert (proc.returncode, proc.stdout) == (7, "a b c\n")


def test_without_a_tree_it_refuses_to_start(tmp_path: Path) -> None:
    proc = _run([*kubeletns.argv_prefix(tmp_path / "gone"), "true"])
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"kubelet-fakehw: {tmp_path / 'gone'}/sys/devices/system/cpu/online is missing: "
        f"the node's fake tree is not served at {tmp_path / 'gone'}")


def test_the_script_file_runs_as_the_argv_prefix_does(tree: Path, tmp_path: Path) -> None:
    script = tmp_path / "kubelet-fakehw"
    script.write_text(kubeletns.script_file_text())
    script.chmod(0o755)
    proc = _run([*kubeletns.argv_prefix_file(str(script), str(tree)), "sh", "-c", READ])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:3] == ["0-63", "2", "64"]


def test_cpu_policy_none_is_refused_where_the_host_lacks_the_cpus(tmp_path: Path) -> None:
    node = load_profile(PROFILE).cluster.nodes[0]
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_text("0-1\n")
    big.write_text("0-127\n")
    problem = kubeletns.policy_problem(node, "none", small)
    assert problem is not None
    assert "kubelet.cpuManagerPolicy none needs the host to have every emulated CPU" in problem
    assert "64 of them, this host has 2" in problem
    assert kubeletns.policy_problem(node, "none", big) is None
    assert kubeletns.policy_problem(node, "static", small) is None


def test_kind_node_files(tmp_path: Path) -> None:
    node = load_profile(PROFILE).cluster.nodes[0]
    kindtopology.write_node_files(tmp_path, node)
    script = tmp_path / "bin" / "kubelet-fakehw"
    assert script.stat().st_mode & 0o777 == 0o755
    assert script.read_text() == kubeletns.script_file_text()
    config = yaml.safe_load((tmp_path / "kubelet.conf.d" / "50-hwsandbox.conf").read_text())
    assert config["kind"] == "KubeletConfiguration"
    assert (config["cpuManagerPolicy"], config["reservedSystemCPUs"],
            config["topologyManagerPolicy"]) == ("static", "0", "single-numa-node")
    drop_in = (tmp_path / kindtopology.DROP_IN).read_text().splitlines()
    assert drop_in[1:3] == ["[Service]", "ExecStart="]
    assert drop_in[3] == (
        "ExecStart=/usr/bin/unshare --mount --propagation unchanged "
        "/var/lib/hw-sandbox/bin/kubelet-fakehw /var/lib/hw-sandbox/root /usr/bin/kubelet "
        "$KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS "
        "$KUBELET_EXTRA_ARGS --config-dir=/var/lib/hw-sandbox/kubelet.conf.d")

"""The profile's kubelet section: CPU, topology and memory manager settings, their
defaults, their located errors, their round trip through the resolved spec, and the
KubeletConfiguration keys ``sandbox.runtimes.kubeletcfg.topology_config`` makes of them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandbox.errors import ProfileError, RuntimeBackendError
from sandbox.profile import load_profile, spec
from sandbox.profile.show import node_text
from sandbox.profile.spec import NodeSpec
from sandbox.runtimes.kubeletcfg import topology_config
from tests.support.paths import REPO as ROOT

MIB = 2**20

HEAD = """\
apiVersion: hwsandbox.dev/v1alpha1
kind: HardwareProfile
metadata: {name: kubelet-test}
nodes:
  - name: worker
"""
# 2 sockets x 4 cores x 2 threads: CPUs 0-15, NUMA node 0 = 0-3,8-11, 16Gi per NUMA node
CPU = "    cpu: {sockets: 2, coresPerSocket: 4, threadsPerCore: 2}\n"


def write(tmp_path: Path, kubelet: str = "", cpu: str = CPU, name: str = "p.yaml") -> Path:
    """A profile file with one node; ``kubelet`` is the body of its kubelet section."""
    text = HEAD + cpu
    if kubelet:
        text += "    kubelet:\n" + textwrap.indent(textwrap.dedent(kubelet), " " * 6)
    path = tmp_path / name
    path.write_text(text)
    return path


def node_of(path: Path) -> NodeSpec:
    return load_profile(path).cluster.nodes[0]


def problems(path: Path) -> list[str]:
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    return [str(p) for p in info.value.problems]


def sandbox(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=cwd,
                          capture_output=True, text=True, check=False)


# -- defaults and the resolved spec --------------------------------------------------------


def test_defaults(tmp_path: Path) -> None:
    node = node_of(write(tmp_path))
    assert node.cpu_manager_policy == "static"
    assert node.cpu_manager_policy_options == ()
    assert node.reserved_system_cpus == "0"
    assert node.topology_manager_policy == "best-effort"
    assert node.topology_manager_scope == "container"
    assert node.topology_manager_policy_options == ()
    assert node.memory_manager_policy == "None"
    assert node.reserved_memory == ()


def test_static_memory_manager_defaults_to_512mi_on_numa_node_0(tmp_path: Path) -> None:
    node = node_of(write(tmp_path, "memoryManagerPolicy: Static\n"))
    assert node.reserved_memory == ((0, 512 * MIB),)


def test_cpu_manager_none_reserves_nothing(tmp_path: Path) -> None:
    node = node_of(write(tmp_path, "cpuManagerPolicy: none\n"))
    assert (node.cpu_manager_policy, node.reserved_system_cpus) == ("none", "")


EVERY_FIELD = """\
topologyManagerPolicy: restricted
topologyManagerScope: pod
topologyManagerPolicyOptions:
  prefer-closest-numa-nodes: "true"
  max-allowable-numa-nodes: "16"
cpuManagerPolicy: static
cpuManagerPolicyOptions:
  full-pcpus-only: true
  distribute-cpus-across-numa: "false"
  align-by-socket: false
  distribute-cpus-across-cores: "true"
  strict-cpu-reservation: true
  prefer-align-cpus-by-uncorecache: false
reservedSystemCPUs: "8, 0"
memoryManagerPolicy: Static
reservedMemory:
  - {numaNode: 1, memory: 1Gi}
  - {numaNode: 0, memory: 256Mi}
"""


def test_every_field_resolves_and_round_trips(tmp_path: Path) -> None:
    path = write(tmp_path, EVERY_FIELD)
    cluster = load_profile(path).cluster
    node = cluster.nodes[0]
    assert node.topology_manager_policy == "restricted"
    assert node.topology_manager_scope == "pod"
    assert node.topology_manager_policy_options == (
        ("max-allowable-numa-nodes", "16"), ("prefer-closest-numa-nodes", "true"))
    assert node.cpu_manager_policy == "static"
    assert node.cpu_manager_policy_options == (
        ("align-by-socket", "false"), ("distribute-cpus-across-cores", "true"),
        ("distribute-cpus-across-numa", "false"), ("full-pcpus-only", "true"),
        ("prefer-align-cpus-by-uncorecache", "false"), ("strict-cpu-reservation", "true"))
    assert node.reserved_system_cpus == "0,8"  # the kernel's form
    assert node.memory_manager_policy == "Static"
    assert node.reserved_memory == ((0, 256 * MIB), (1, 1024 * MIB))  # by NUMA node
    back = spec.load_node(spec.dump(node))
    assert back == node
    assert spec.load(spec.dump(cluster)) == cluster


def test_replicas_share_the_settings(tmp_path: Path) -> None:
    path = write(tmp_path, "cpuManagerPolicyOptions: {full-pcpus-only: true}\n",
                 cpu=CPU + "    count: 2\n")
    a, b = load_profile(path).cluster.nodes
    assert (a.name, b.name) == ("worker-0", "worker-1")
    assert a.cpu_manager_policy_options == b.cpu_manager_policy_options == (
        ("full-pcpus-only", "true"),)
    assert a.reserved_system_cpus == b.reserved_system_cpus == "0"


def test_shipped_8gpu_profile() -> None:
    node = node_of(ROOT / "profiles" / "8gpu-2numa.yaml")
    assert (node.topology_manager_policy, node.topology_manager_scope) == (
        "single-numa-node", "container")
    assert (node.cpu_manager_policy, node.reserved_system_cpus) == ("static", "0")
    assert node.memory_manager_policy == "None"


def test_show_names_the_managers_in_the_node_line(tmp_path: Path) -> None:
    plain = node_text(node_of(ROOT / "profiles" / "8gpu-2numa.yaml")).splitlines()[0]
    assert plain == ("node gpu-worker  (worker; topology manager: single-numa-node/container; "
                     "cpu manager: static (reserved 0); memory manager: None)")
    full = node_text(node_of(write(tmp_path, EVERY_FIELD))).splitlines()[0]
    assert full == (
        "node worker  (worker; topology manager: restricted/pod (max-allowable-numa-nodes=16, "
        "prefer-closest-numa-nodes=true); cpu manager: static (reserved 0,8; "
        "align-by-socket=false; distribute-cpus-across-cores=true; "
        "distribute-cpus-across-numa=false; full-pcpus-only=true; "
        "prefer-align-cpus-by-uncorecache=false; strict-cpu-reservation=true); "
        "memory manager: Static (reserved 256Mi on NUMA 0, 1Gi on NUMA 1))")


# -- located errors ------------------------------------------------------------------------

# (kubelet section, expected problems); the section's first line is line 8, at column 7
BAD = {
    "unknown-cpu-option": (
        "cpuManagerPolicyOptions: {full-pcpu-only: true}\n",
        ["p.yaml:8:33: nodes[0].kubelet.cpuManagerPolicyOptions.full-pcpu-only: unknown field "
         "'full-pcpu-only' (did you mean 'full-pcpus-only'?)"]),
    "snake-case-option": (
        "cpuManagerPolicyOptions: {full_pcpus_only: true}\n",
        ["p.yaml:8:33: nodes[0].kubelet.cpuManagerPolicyOptions.full_pcpus_only: unknown field "
         "'full_pcpus_only' (did you mean 'full-pcpus-only'?)"]),
    "option-not-a-boolean": (
        "cpuManagerPolicyOptions: {full-pcpus-only: 'yes'}\n",
        ["p.yaml:8:50: nodes[0].kubelet.cpuManagerPolicyOptions.full-pcpus-only: must be true "
         "or false, got 'yes'"]),
    "unknown-topology-option": (
        "topologyManagerPolicyOptions: {prefer-closest-numa-node: true}\n",
        ["p.yaml:8:38: nodes[0].kubelet.topologyManagerPolicyOptions.prefer-closest-numa-node: "
         "unknown field 'prefer-closest-numa-node' (did you mean "
         "'prefer-closest-numa-nodes'?)"]),
    "max-allowable-below-8": (
        "topologyManagerPolicyOptions: {max-allowable-numa-nodes: '4'}\n",
        ["p.yaml:8:64: nodes[0].kubelet.topologyManagerPolicyOptions.max-allowable-numa-nodes: "
         "must be greater than or equal to 8, got '4'"]),
    "cpu-policy": (
        "cpuManagerPolicy: Static\n",
        ["p.yaml:8:25: nodes[0].kubelet.cpuManagerPolicy: 'Static' is not one of 'none', "
         "'static' (did you mean 'static'?)"]),
    "memory-policy": (
        "memoryManagerPolicy: static\n",
        ["p.yaml:8:28: nodes[0].kubelet.memoryManagerPolicy: 'static' is not one of 'None', "
         "'Static' (did you mean 'Static'?)"]),
    "scope": (
        "topologyManagerScope: node\n",
        ["p.yaml:8:29: nodes[0].kubelet.topologyManagerScope: 'node' is not one of "
         "'container', 'pod'"]),
    "reserved-cpu-out-of-range": (
        "reservedSystemCPUs: '0,16'\n",
        ["p.yaml:8:27: nodes[0].kubelet.reservedSystemCPUs: CPU 16 does not exist "
         "(have 0-15)"]),
    "reserved-cpus-huge-range": (  # refused before anything is expanded
        "reservedSystemCPUs: 0-99999999\n",
        ["p.yaml:8:27: nodes[0].kubelet.reservedSystemCPUs: CPU 16 does not exist "
         "(have 0-15)"]),
    "reserved-cpus-not-a-cpulist": (
        "reservedSystemCPUs: 'zero'\n",
        ["p.yaml:8:27: nodes[0].kubelet.reservedSystemCPUs: 'zero' is not a CPU number or "
         "range (like 0-15,32)"]),
    "reserved-cpus-empty": (
        "reservedSystemCPUs: ''\n",
        ["p.yaml:8:27: nodes[0].kubelet.reservedSystemCPUs: names no CPU; the static policy "
         "needs at least one reserved"]),
    "reserved-cpus-all": (
        "reservedSystemCPUs: 0-15\n",
        ["p.yaml:8:27: nodes[0].kubelet.reservedSystemCPUs: reserves every CPU of the node "
         "(0-15); leave at least one for pods"]),
    "options-under-none": (
        "cpuManagerPolicy: none\ncpuManagerPolicyOptions: {full-pcpus-only: true}\n"
        "reservedSystemCPUs: '1'\n",
        ["p.yaml:9:32: nodes[0].kubelet.cpuManagerPolicyOptions: only used with "
         "cpuManagerPolicy static",
         "p.yaml:10:27: nodes[0].kubelet.reservedSystemCPUs: only used with cpuManagerPolicy "
         "static"]),
    "reserved-memory-under-none": (
        "reservedMemory: [{numaNode: 0, memory: 512Mi}]\n",
        ["p.yaml:8:23: nodes[0].kubelet.reservedMemory: only used with memoryManagerPolicy "
         "Static"]),
    "reserved-memory-bad-numa-node": (
        "memoryManagerPolicy: Static\nreservedMemory:\n  - {numaNode: 2, memory: 512Mi}\n",
        ["p.yaml:10:22: nodes[0].kubelet.reservedMemory[0].numaNode: no NUMA node 2 "
         "(have 0, 1)"]),
    "reserved-memory-duplicate": (
        "memoryManagerPolicy: Static\nreservedMemory:\n  - {numaNode: 0, memory: 512Mi}\n"
        "  - {numaNode: 0, memory: 1Gi}\n",
        ["p.yaml:11:22: nodes[0].kubelet.reservedMemory[1].numaNode: NUMA node 0 is already "
         "reserved by reservedMemory[0]"]),
    "reserved-memory-not-mib": (
        "memoryManagerPolicy: Static\nreservedMemory:\n  - {numaNode: 0, memory: 1G}\n",
        ["p.yaml:10:33: nodes[0].kubelet.reservedMemory[0].memory: must be a whole number of "
         "MiB above 0 (like 512Mi or 1Gi), got 1000000000 bytes"]),
    "reserved-memory-zero": (
        "memoryManagerPolicy: Static\nreservedMemory:\n  - {numaNode: 0, memory: 0}\n",
        ["p.yaml:10:33: nodes[0].kubelet.reservedMemory[0].memory: must be a whole number of "
         "MiB above 0 (like 512Mi or 1Gi), got 0 bytes"]),
    "reserved-memory-too-much": (
        "memoryManagerPolicy: Static\nreservedMemory:\n  - {numaNode: 1, memory: 17Gi}\n",
        ["p.yaml:10:33: nodes[0].kubelet.reservedMemory[0].memory: 17408Mi is more than NUMA "
         "node 1's memory (16384Mi)"]),
    "reserved-memory-not-a-quantity": (
        "memoryManagerPolicy: Static\nreservedMemory:\n  - {numaNode: 0, memory: lots}\n",
        ["p.yaml:10:33: nodes[0].kubelet.reservedMemory[0].memory: 'lots' is not a quantity "
         "(like 512Mi, 80Gi, 1Ti or bytes)"]),
    "reserved-memory-empty": (
        "memoryManagerPolicy: Static\nreservedMemory: []\n",
        ["p.yaml:9:23: nodes[0].kubelet.reservedMemory: the Static policy needs memory "
         "reserved on at least one NUMA node"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_value_is_a_located_error(tmp_path: Path, case: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    kubelet, expected = BAD[case]
    write(tmp_path, kubelet)
    monkeypatch.chdir(tmp_path)
    assert problems(Path("p.yaml")) == expected


def test_max_allowable_below_the_node_numa_count(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "topologyManagerPolicyOptions: {max-allowable-numa-nodes: 9}\n",
          cpu="    cpu: {sockets: 12, coresPerSocket: 2}\n")
    monkeypatch.chdir(tmp_path)
    assert problems(Path("p.yaml")) == [
        "p.yaml:8:64: nodes[0].kubelet.topologyManagerPolicyOptions.max-allowable-numa-nodes: "
        "9 is less than the node's 12 NUMA nodes (the kubelet refuses such a node)"]


def test_static_on_a_one_cpu_node_says_to_use_none(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "cpuManagerPolicy: static\n", cpu="    cpu: {coresPerSocket: 1}\n")
    monkeypatch.chdir(tmp_path)
    assert problems(Path("p.yaml")) == [
        "p.yaml:8:25: nodes[0].kubelet.cpuManagerPolicy: static reserves a CPU and the node "
        "has only one; use cpuManagerPolicy none"]
    write(tmp_path, "cpuManagerPolicy: none\n", cpu="    cpu: {coresPerSocket: 1}\n")
    assert node_of(Path("p.yaml")).reserved_system_cpus == ""


def test_a_one_cpu_node_stating_no_cpu_manager_setting_gets_none(tmp_path: Path) -> None:
    """As ``sandbox capture`` writes a one-CPU machine: static would reserve the only CPU,
    and none is safe there (the host has CPU 0)."""
    node = node_of(write(tmp_path, "topologyManagerPolicy: restricted\n",
                         cpu="    cpu: {coresPerSocket: 1}\n"))
    assert (node.cpu_manager_policy, node.reserved_system_cpus) == ("none", "")
    bare = node_of(write(tmp_path, cpu="    cpu: {coresPerSocket: 1}\n"))
    assert (bare.cpu_manager_policy, bare.reserved_system_cpus) == ("none", "")


def test_validate_reports_every_problem_at_once(tmp_path: Path) -> None:
    write(tmp_path, "reservedSystemCPUs: '0-1,99'\nmemoryManagerPolicy: Static\n"
                    "reservedMemory:\n  - {numaNode: 0, memory: 256Mi}\n"
                    "  - {numaNode: 3, memory: 256Mi}\n", name="bad.yaml")
    result = sandbox("validate", "bad.yaml", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "bad.yaml:8:27: nodes[0].kubelet.reservedSystemCPUs: CPU 99 does not exist "
        "(have 0-15)",
        "bad.yaml:12:22: nodes[0].kubelet.reservedMemory[1].numaNode: no NUMA node 3 "
        "(have 0, 1)",
        "1 of 1 profile(s) invalid",
    ]
    assert "Traceback" not in result.stderr


# -- KubeletConfiguration keys ---------------------------------------------------------------


def test_topology_config_of_the_8gpu_profile() -> None:
    node = node_of(ROOT / "profiles" / "8gpu-2numa.yaml")
    assert topology_config(node, 100) == {
        "cpuManagerPolicy": "static",
        "reservedSystemCPUs": "0",
        "topologyManagerPolicy": "single-numa-node",
        "topologyManagerScope": "container",
        "memoryManagerPolicy": "None",
    }


def test_topology_config_of_every_field(tmp_path: Path) -> None:
    node = node_of(write(tmp_path, EVERY_FIELD))
    assert topology_config(node, 100) == {
        "cpuManagerPolicy": "static",
        "cpuManagerPolicyOptions": {
            "align-by-socket": "false", "distribute-cpus-across-cores": "true",
            "distribute-cpus-across-numa": "false", "full-pcpus-only": "true",
            "prefer-align-cpus-by-uncorecache": "false", "strict-cpu-reservation": "true"},
        "reservedSystemCPUs": "0,8",
        "topologyManagerPolicy": "restricted",
        "topologyManagerScope": "pod",
        "topologyManagerPolicyOptions": {"max-allowable-numa-nodes": "16",
                                         "prefer-closest-numa-nodes": "true"},
        "memoryManagerPolicy": "Static",
        "reservedMemory": [{"numaNode": 0, "limits": {"memory": "256Mi"}},
                           {"numaNode": 1, "limits": {"memory": "1024Mi"}}],
        "kubeReserved": {"memory": "1180Mi"},  # 256 + 1024 - 100
    }


def test_cpu_manager_none_sends_no_reservation(tmp_path: Path) -> None:
    node = node_of(write(tmp_path, "cpuManagerPolicy: none\n"))
    assert topology_config(node, 100) == {
        "cpuManagerPolicy": "none", "topologyManagerPolicy": "best-effort",
        "topologyManagerScope": "container", "memoryManagerPolicy": "None"}


@pytest.mark.parametrize(("eviction", "kube_reserved"), [(100, "412Mi"), (0, "512Mi")])
def test_static_memory_kube_reserved_is_the_reservation_less_eviction(
        tmp_path: Path, eviction: int, kube_reserved: str) -> None:
    node = node_of(write(tmp_path, "memoryManagerPolicy: Static\n"))
    config = topology_config(node, eviction)
    assert config["reservedMemory"] == [{"numaNode": 0, "limits": {"memory": "512Mi"}}]
    assert config["kubeReserved"] == {"memory": kube_reserved}


def test_reservation_equal_to_the_threshold_reserves_nothing_for_the_kubelet(
        tmp_path: Path) -> None:
    node = node_of(write(tmp_path, "memoryManagerPolicy: Static\n"
                                   "reservedMemory: [{numaNode: 1, memory: 100Mi}]\n"))
    config = topology_config(node, 100)
    assert config["reservedMemory"] == [{"numaNode": 1, "limits": {"memory": "100Mi"}}]
    assert config["kubeReserved"] == {"memory": "0Mi"}


def test_reservation_below_the_eviction_threshold_is_an_error(tmp_path: Path) -> None:
    node = node_of(write(tmp_path, "memoryManagerPolicy: Static\n"
                                   "reservedMemory: [{numaNode: 0, memory: 64Mi}]\n"))
    assert topology_config(node, 0)["kubeReserved"] == {"memory": "64Mi"}
    with pytest.raises(RuntimeBackendError) as info:
        topology_config(node, 100)
    assert str(info.value) == (
        "kubelet config: node worker: kubelet.reservedMemory adds up to 64Mi, less than this "
        "runtime's eviction threshold (evictionHard memory.available 100Mi), which the memory "
        "manager's Static policy counts in it; reserve at least 100Mi in "
        "kubelet.reservedMemory")


TWELVE_NUMA = "    cpu: {sockets: 12, coresPerSocket: 2}\n"


@pytest.mark.parametrize(("kubelet", "expected"), [
    ("", {"max-allowable-numa-nodes": "12"}),
    ("topologyManagerPolicy: single-numa-node\n", {"max-allowable-numa-nodes": "12"}),
    ("topologyManagerPolicyOptions: {prefer-closest-numa-nodes: true}\n",
     {"max-allowable-numa-nodes": "12", "prefer-closest-numa-nodes": "true"}),
    ("topologyManagerPolicyOptions: {max-allowable-numa-nodes: 16}\n",
     {"max-allowable-numa-nodes": "16"}),
    ("topologyManagerPolicy: none\n", None),
], ids=["default", "single-numa-node", "other-option", "given", "policy-none"])
def test_more_than_8_numa_nodes_raise_max_allowable(tmp_path: Path, kubelet: str,
                                                    expected: dict[str, str] | None) -> None:
    node = node_of(write(tmp_path, kubelet, cpu=TWELVE_NUMA))
    assert len(node.numa) == 12
    assert topology_config(node, 100).get("topologyManagerPolicyOptions") == expected


def test_eight_numa_nodes_need_no_option(tmp_path: Path) -> None:
    node = node_of(write(tmp_path, cpu="    cpu: {sockets: 8, coresPerSocket: 2}\n"))
    assert len(node.numa) == 8
    assert "topologyManagerPolicyOptions" not in topology_config(node, 100)

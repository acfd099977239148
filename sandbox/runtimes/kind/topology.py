"""kind: each node's kubelet sees that node's emulated CPUs, NUMA nodes and memory.

The FUSE tree of a node comes from the agent, a static pod: it needs a running kubelet, so
the first kubelet start in a node sees the real machine. Once the agent serves the tree,
``reconfigure`` restarts each profile node's kubelet the way the native runtime starts
its own (``sandbox.runtimes.kubeletns``): a ``kubelet.service`` drop-in runs it in a mount
namespace where the tree's CPUs, NUMA nodes, cpuinfo and meminfo are the machine, with a
``--config-dir`` drop-in carrying the profile's CPU, topology and memory manager settings
(a worker's own KubeletConfiguration patches are ignored by ``kubeadm join``, and the
create-time config must suit the real machine). Files live in the node's state dir
(``/var/lib/hw-sandbox``, the host's ``<state>/nodes/<replica>``), so the host writes them.
``systemctl restart kubelet`` (``sandbox fault restart-kubelet``) keeps the drop-in.

Every node's containerd runs runc through ``oci-cpumap`` (``sandbox.runtimes.cpumap``)
from the first container on: the shim records its runtime binary per container, and the
kubelet's static CPU manager updates the cpuset of every running container, the agent's
and kube-system's included, with emulated CPU ids the host lacks. The wrapper is a no-op
for ids the host has, so it is on for every node, the control plane too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sandbox.profile.spec import NodeSpec
from sandbox.runtimes import cpumap, kubeletns
from sandbox.runtimes.kubeletcfg import topology_config

STATE_IN_NODE = "/var/lib/hw-sandbox"  # api.STATE_IN_NODE
BIN_IN_NODE = "/opt/hw-sandbox/bin"  # <state>/bin on the host, read-only in every node
WRAPPER = "runc-cpumap"
# runc in kind's node images (stock kindest/node and ours, scripts/build-kind-node-image)
REAL_RUNC_IN_NODE = "/usr/local/sbin/runc"
# kind's evictionHard has no memory.available, and with mergeDefaultEvictionSettings off
# its threshold is 0: the memory manager's reservations must add up to kubeReserved alone
KIND_EVICTION_MEMORY_MIB = 0
DROP_IN = "20-hwsandbox.conf"
CONFIG_DIR = "kubelet.conf.d"


def install_wrapper(state_dir: Path) -> Path:
    """``<state>/bin/runc-cpumap``, which every node sees at ``BIN_IN_NODE``."""
    return cpumap.install(state_dir / "bin" / WRAPPER, REAL_RUNC_IN_NODE)


def bin_mount(state_dir: Path) -> dict[str, Any]:
    """The extraMount every kind node gets for ``install_wrapper``'s directory."""
    return {"hostPath": str(state_dir / "bin"), "containerPath": BIN_IN_NODE, "readOnly": True}


def containerd_patch() -> str:
    """The containerdConfigPatch (config version 2, as kind writes it) naming the wrapper
    as the runc binary of the default runtime."""
    return ('[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
            f'  BinaryName = "{BIN_IN_NODE}/{WRAPPER}"')


def write_node_files(node_dir: Path, node: NodeSpec) -> None:
    """What ``RECONFIGURE`` installs, in the node's state dir (host side): the namespace
    script, the KubeletConfiguration drop-in and the systemd drop-in."""
    bin_dir = node_dir / "bin"
    bin_dir.mkdir(mode=0o755, exist_ok=True)
    script = bin_dir / "kubelet-fakehw"
    script.write_text(kubeletns.script_file_text())
    script.chmod(0o755)
    conf_dir = node_dir / CONFIG_DIR
    conf_dir.mkdir(mode=0o755, exist_ok=True)
    config = {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
              **topology_config(node, KIND_EVICTION_MEMORY_MIB)}
    (conf_dir / "50-hwsandbox.conf").write_text(
        "# written by hw-sandbox (sandbox/runtimes/kind/topology.py): the profile's kubelet\n"
        + yaml.safe_dump(config, sort_keys=False))
    (node_dir / DROP_IN).write_text(systemd_drop_in())


def systemd_drop_in() -> str:
    """kind's own ExecStart (10-kubeadm.conf) with the kubelet in a namespace of its own
    and the config drop-in dir. The kubelet stays the unit's main process: ``unshare`` and
    the script exec it (kind's unit has ``KillMode=process``)."""
    prefix = " ".join(kubeletns.argv_prefix_file(f"{STATE_IN_NODE}/bin/kubelet-fakehw",
                                                 f"{STATE_IN_NODE}/root"))
    return ("# written by hw-sandbox (sandbox/runtimes/kind/topology.py)\n"
            "[Service]\n"
            "ExecStart=\n"
            f"ExecStart={prefix} /usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS "
            "$KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS "
            f"--config-dir={STATE_IN_NODE}/{CONFIG_DIR}\n")


# Run in the node: the drop-in in place, the managers' state files of the real machine's
# first start gone (a changed policy or CPU set makes the kubelet refuse them), restart,
# but not while a container's task is created and not yet started (up to 5 s): stopped
# then, the kubelet leaves a cgroup without a running task, and the next one's cAdvisor
# retries each such cgroup for ~3 s before it syncs a pod (13 s seen). The caller waits
# for the node's pods to have started first (``api.starting_pods``); this closes the gap
# of a pod the API did not show yet.
RECONFIGURE = (
    f"install -D -m 0644 {STATE_IN_NODE}/{DROP_IN} "
    f"/etc/systemd/system/kubelet.service.d/{DROP_IN} && "
    "rm -f " + " ".join(f"/var/lib/kubelet/{name}" for name in kubeletns.MANAGER_STATE)
    + " && "
    "systemctl daemon-reload && "
    "i=0; while [ $i -lt 50 ] && ctr -n k8s.io tasks ls 2>/dev/null | grep -qw CREATED; "
    "do sleep 0.1; i=$((i+1)); done; "
    "systemctl restart kubelet"
)

"""The kubelet in a mount namespace of its own, where the node's fake tree is the machine.

cadvisor, whose machine info is all the kubelet's CPU, memory, topology and device
managers know of the hardware, reads fixed paths: ``/proc/cpuinfo``, ``/proc/meminfo``,
``/sys/devices/system/cpu`` and ``/sys/devices/system/node`` (docs/kubelet-topology-notes.md
§1). ``SCRIPT`` binds the tree's copies over those four, read-only, then execs the kubelet.
Run it under ``unshare --mount --propagation unchanged``:

- ``unchanged``, not unshare's default ``private``: the kubelet root is a shared mount
  (native: ``steps._share_kubelet_root``; kind: the node's ``/`` is rshared), and the
  volumes the kubelet mounts for pods (service account tokens, secrets, subPath binds)
  must still propagate out to containerd;
- ``/sys`` and ``/proc`` become slaves first, so the binds never propagate out: runc and
  everything else keep the real ones.

What is not bound stays the host's: ``/sys/kernel/mm/hugepages`` (so the node's hugepage
capacity is what the host can back, usually 0), the cgroup tree (the kubelet's cgroups are
real), and Go's own CPU count (``sched_getaffinity``). The binds go with the namespace when
the kubelet exits; the tree must outlive it, and without the tree the script refuses to
start rather than letting cadvisor fail on a half-seen machine.
"""

from __future__ import annotations

from pathlib import Path

from sandbox.profile.cpulist import parse_cpulist
from sandbox.profile.spec import NodeSpec

HOST_ONLINE = Path("/sys/devices/system/cpu/online")

# What cadvisor reads, relative to the tree's root and to /.
BOUND = ("sys/devices/system/cpu", "sys/devices/system/node", "proc/cpuinfo", "proc/meminfo")
# The kubelet's CPU and memory managers' state files in its root dir: a kubelet whose
# policy or CPU set changed refuses to start on them, so they go before its first start on
# an emulated machine (never at a restart: they hold every pod's CPUs and memory).
MANAGER_STATE = ("cpu_manager_state", "memory_manager_state")

SCRIPT = f"""set -eu
root=$1
shift
for p in sys/devices/system/cpu/online sys/devices/system/node/online proc/cpuinfo proc/meminfo
do
    if [ ! -e "$root/$p" ]; then
        echo "kubelet-fakehw: $root/$p is missing: the node's fake tree is not served at $root" >&2
        exit 1
    fi
done
mount --make-rslave /sys
mount --make-rslave /proc
for p in {" ".join(BOUND)}; do
    mount --bind "$root/$p" "/$p"
    mount -o remount,bind,ro "/$p"
done
exec "$@"
"""


def argv_prefix(tree_root: Path) -> list[str]:
    """argv prefix: run the command as ``SCRIPT`` does, in a new mount namespace."""
    return ["unshare", "--mount", "--propagation", "unchanged",
            "sh", "-c", SCRIPT, "kubelet-fakehw", str(tree_root)]


def argv_prefix_file(script: str, tree_root: str) -> list[str]:
    """``argv_prefix`` with ``SCRIPT`` installed as the file ``script``
    (``script_file_text``), e.g. for a systemd ExecStart."""
    return ["/usr/bin/unshare", "--mount", "--propagation", "unchanged", script, tree_root]


def script_file_text() -> str:
    """``SCRIPT`` as an executable file (the kind nodes' kubelet.service runs it)."""
    return "#!/bin/sh\n# written by hw-sandbox: see sandbox/runtimes/kubeletns.py\n" + SCRIPT


def policy_problem(node: NodeSpec, policy: str, host_online: Path = HOST_ONLINE) -> str | None:
    """Why the kubelet cannot run ``node``'s emulated machine under CPU manager ``policy``,
    or None. Under ``none`` the kubelet itself writes every CPU it knows into the kubepods
    cpuset (``node_container_manager_linux.go``, when no CPU is allocatable exclusively):
    emulated ids the host lacks make the kernel refuse the write (ERANGE) and the kubelet
    exit. No runtime wrapper sees that write; ``static`` never makes it."""
    if policy != "none":
        return None
    try:
        host = set(parse_cpulist(host_online.read_text().strip(), limit=65536))
    except (OSError, ValueError):
        return None  # nothing to compare with: let the kubelet say
    emulated = {c.id for c in node.cpus}
    if emulated <= host:
        return None
    return (f"node {node.name}: kubelet.cpuManagerPolicy none needs the host to have every "
            f"emulated CPU ({len(emulated)} of them, this host has {len(host)}): under none "
            "the kubelet writes all of them into its kubepods cpuset, which the kernel "
            "refuses; use cpuManagerPolicy: static (the default)")

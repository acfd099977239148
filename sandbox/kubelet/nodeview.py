"""A plugin's view of a served node: a private mount namespace where the node's tree is
the machine and the harness is the kubelet, at the paths a stock plugin hard-codes.

``argv_prefix(root, harness_dir)`` runs a command under ``unshare --mount --propagation
private`` (a namespace of the command's own: nothing it mounts reaches the host, and the
binds go when its last process exits) after ``SCRIPT`` has made, in order:

    /var/lib/kubelet/device-plugins   the harness's directory (bound). Where the host has
                                      no such directory it is made on a tmpfs over the
                                      deepest one it has (/var/lib/kubelet, else /var/lib),
                                      in the namespace only: the host's stays as it was
    /proc/driver                      ROOT/proc/driver (bound), where the tree has one
                                      (NVIDIA's proc/driver/nvidia)
    /sys                              ROOT/sys (bound)
    /dev                              ROOT/dev (bound with its submounts), after the host's
                                      null, zero, full, random and urandom were bound over
                                      the tree's own: Go and Python runtimes, shells and
                                      gRPC open /dev/null and /dev/urandom. Every other
                                      node is the tree's (its numbers, live as devices
                                      come and go; the mount is nodev, so they open
                                      nothing), as a plugin's container sees the fake
                                      /dev the bundled manifests mount

then execs the command. The rest of /proc, /run, /tmp and the host's other files stay the
host's. A mount that fails ends the script with mount's own message (in the plugin's
output) before the command starts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sandbox.errors import SandboxError

STOCK_DIR = "/var/lib/kubelet/device-plugins"
# The memory devices every container has: the host's own, over the tree's nodes of the
# same names (sandbox.fakehw.devnodes.HARMLESS).
HOST_DEVICES = ("null", "zero", "full", "random", "urandom")
TOOLS = ("unshare", "mount")

SCRIPT = f"""set -eu
root=$1; plugins=$2; shift 2
target={STOCK_DIR}
if [ ! -d "$target" ]; then
    scratch=/var/lib/kubelet
    while [ ! -d "$scratch" ]; do scratch=${{scratch%/*}}; done
    case $scratch in /var/lib*) ;; *)
        echo "hw-sandbox: no /var/lib here to hold $target" >&2; exit 1;; esac
    mount -t tmpfs -o mode=0755 hwsandbox-kubelet "$scratch"
    mkdir -p "$target"
fi
mount --bind "$plugins" "$target"
for n in {" ".join(HOST_DEVICES)}; do
    if [ -e "$root/dev/$n" ]; then mount --bind "/dev/$n" "$root/dev/$n"; fi
done
if [ -d "$root/proc/driver" ]; then
    if [ -d /proc/driver ]; then
        mount --bind "$root/proc/driver" /proc/driver
    else
        echo "hw-sandbox: this host has no /proc/driver: the tree's proc/driver is not shown" >&2
    fi
fi
mount --bind "$root/sys" /sys
mount --rbind "$root/dev" /dev
exec "$@"
"""


def require_tools() -> None:
    """SandboxError naming the package when a tool the namespace needs is missing."""
    for tool in TOOLS:
        if shutil.which(tool) is None:
            raise SandboxError(f"{tool} not found: the plugin's mount namespace needs it "
                               "(apt-get install util-linux mount)")


def argv_prefix(root: Path, harness_dir: Path) -> list[str]:
    """argv prefix: run the command in a private mount namespace as ``SCRIPT`` makes it,
    the node's tree served at ``root`` (root/sys, root/dev, root/proc)."""
    return ["unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", SCRIPT, "hw-sandbox-nodeview", str(root), str(harness_dir)]

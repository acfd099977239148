"""The node's fake hardware and what runs on it: the FUSE tree, device nodes for
containerd, the reference device plugin and DRA driver."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sandbox.commands import run
from sandbox.errors import RuntimeBackendError, SandboxError
from sandbox.profile import spec
from sandbox.profile.spec import NodeSpec
from sandbox.progress import Progress
from sandbox.runtimes.native.common import (
    DEVICE_PLUGINS_DIR,
    Layout,
    kubelet_root,
    spawn,
    wait_for,
)
from sandbox.supervisor import find_line

# Run in containerd's own mount namespace (slave: the kubelet's volume mounts still reach
# it): /dev becomes a read-only overlay of the host's /dev over the node's device dir, so
# the CRI finds /dev/nvidia0 & co. when it stats an Allocate response's host paths, while
# the host's /dev is never written. Submounts (pts, shm, ...) are moved back on top.
_NODE_DEV_SCRIPT = """set -e
stage=$1; nodedev=$2; shift 2
mkdir -p "$stage"
for m in pts shm mqueue hugepages; do
    if mountpoint -q "/dev/$m"; then mkdir -p "$stage/$m"; mount --bind "/dev/$m" "$stage/$m"; fi
done
mount -t overlay hwsb-dev -o "lowerdir=/dev:$nodedev" /dev
for m in pts shm mqueue hugepages; do
    if [ -d "$stage/$m" ] && mountpoint -q "$stage/$m"; then mount --move "$stage/$m" "/dev/$m"; fi
done
exec "$@"
"""


def with_node_dev(layout: Layout) -> list[str]:
    """argv prefix: run the command with the node's device nodes visible under /dev."""
    return ["unshare", "--mount", "--propagation", "slave", "sh", "-c", _NODE_DEV_SCRIPT,
            "sh", str(layout.containerd / "dev-stage"), str(layout.dev)]


def prepare_node_tree(layout: Layout, node: NodeSpec, progress: Progress) -> None:
    """The node's fake hardware: the lead wires the FUSE mount here.

    Runs before containerd starts. Mounts the node's fake root (``sys/``, ``dev/``,
    ``proc/``; ``sandbox mount`` via ``sandbox.agent``) at ``state_dir/node-root`` with its
    control socket in ``state_dir/node``. The server also creates one host device node per
    fake ``/dev`` character device under ``state_dir/dev`` (never in the host's /dev), all
    ``1:3`` (/dev/null), and removes them when it exits; containerd sees them under its
    /dev (``_with_node_dev``). The kubelet's own /sys stays real. Recorded in
    ``state_dir/run`` and stopped by ``down``. The server serves ``state_dir/spec.json``:
    the node as this process resolved it (the DRA config and the device symlinks below
    come from the same object).
    """
    from sandbox.agent import start_node, wait_node

    root = layout.state / "node-root"
    progress(f"mounting {node.name}'s fake /sys, /dev, /proc at {root}")
    layout.run.mkdir(parents=True, exist_ok=True)
    spec_file = layout.state / "spec.json"
    spec_file.write_text(spec.dump(node))
    proc = start_node(None, node.base_name, root, index=node.index,
                      state_dir=layout.state / "node", log_file=layout.logs / "mount.log",
                      dev_dir=layout.dev, extra=["--dev-map", "1:3"], spec_file=spec_file)
    proc.save(layout.run / "mount.pid")  # recorded first: a failed start is stopped by down
    try:
        wait_node(proc)
    except SandboxError as exc:
        raise RuntimeBackendError("mount", str(exc)) from exc
    _link_dev_symlinks(layout, node)
    write_device_plugin_cdi_specs(layout, node)


def _link_dev_symlinks(layout: Layout, node: NodeSpec) -> None:
    """Copy the fake /dev's relative symlinks (``dri/by-path/pci-…-card -> ../card0``)
    into ``state_dir/dev`` next to the device nodes the mount server made there.

    Plugins hand such links out as mounts (Intel's GPU plugin mounts
    ``/dev/dri/by-path/pci-<bdf>-card``); the CRI stats a mount's host path and, when it
    is missing, tries to mkdir it, which fails on containerd's read-only /dev overlay.
    Made from the node's full tree, like the device nodes, so they never change after up.
    """
    from sandbox.fakehw.builder import build_tree
    from sandbox.fakehw.tree import Symlink

    tree = build_tree(node, {})
    dev = layout.dev.resolve()
    for path, entry in tree.walk():
        if not path.startswith("dev/") or not isinstance(entry, Symlink):
            continue
        link = layout.dev / path.removeprefix("dev/")
        target = (link.parent / entry.target).resolve()
        if entry.target.startswith("/") or dev not in target.parents:
            continue  # only links that stay inside the node's /dev
        link.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            link.symlink_to(entry.target)


def write_device_plugin_cdi_specs(layout: Layout, node: NodeSpec) -> list[Path]:
    """CDI specs for every CDI name the reference device plugin may answer in Allocate
    (``nvidia.com/gpu=GPU-<uuid>``, ``intel.com/gpu=...``), one file per CDI kind in
    ``state_dir/cdi-plugins``, as a vendor's CDI generator writes them once per node
    (``nvidia-ctk cdi generate``). containerd 2 fails a container whose CDI name has no
    spec; with these it resolves them.

    Device nodes only, ``hostPath`` under ``state_dir/dev``: the env stays with the
    Allocate response, which joins it over the container's devices (a per-device CDI env
    would override ``NVIDIA_VISIBLE_DEVICES=a,b`` with one id). Made from the node's
    full tree (every device of the profile, whatever its state at ``up``), like the
    device nodes themselves, so a device plugged in later resolves too.
    """
    import tempfile

    from hwplugins.deviceplugin.discovery import discover

    from sandbox.fakehw.builder import build_tree
    from sandbox.fakehw.render import render

    with tempfile.TemporaryDirectory(prefix="hwsb-cdi-") as tmp:
        render(build_tree(node, {}), tmp, force=True)
        devices = discover(tmp)
    kinds: dict[str, list[dict[str, object]]] = {}
    for dev in devices:
        if not dev.cdi_name or not dev.dev_nodes:
            continue
        kind, _, name = dev.cdi_name.partition("=")
        nodes = [{"path": p, "hostPath": str(layout.dev / p.removeprefix("/dev/"))}
                 for p in dev.dev_nodes]
        kinds.setdefault(kind, []).append(
            {"name": name, "containerEdits": {"deviceNodes": nodes}})
    layout.cdi_plugins.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, cdi_devices in sorted(kinds.items()):
        path = layout.cdi_plugins / f"hwsandbox-deviceplugin-{kind.replace('/', '-')}.json"
        path.write_text(json.dumps({"cdiVersion": "0.6.0", "kind": kind,
                                    "devices": cdi_devices}, indent=2) + "\n")
        written.append(path)
    return written


def start_plugin_netns(layout: Layout, progress: Progress) -> None:
    """The node's plugin network namespace, ``state_dir/plugins-netns``, with a real link
    for every netdev of the tree (``sandbox.fakehw.netlinks``, following its changes).

    On kind a hostNetwork pod is in its node container's namespace, where the agent pod
    makes the links; here hostNetwork is the host's own namespace, which nothing of ours
    enters. So a pod annotated ``hwsandbox.dev/netns: plugins`` (the SR-IOV network device
    plugin's manifest, which asks the kernel for its VFs' links) is put into this namespace
    by oci-cpumap, containerd's runtime (containerd passes that annotation through). Made
    before containerd starts: its mount namespace is a copy of the host's, and the nsfs
    bind must be in it. The namespace has only ``lo`` and the tree's links (no route out),
    and goes at ``down`` (the bind is unmounted with everything under the state dir).
    """
    from sandbox.fakehw.netlinks import tree_links

    ns = layout.plugins_netns
    progress(f"plugin network namespace {ns} (the tree's netdevs as links)")
    if not os.path.ismount(ns):  # (Path.is_mount: directories only, before 3.12)
        ns.touch(mode=0o600)
        run(["unshare", f"--net={ns}", "true"])
    run(["nsenter", f"--net={ns}", "ip", "link", "set", "lo", "up"])
    root = layout.state / "node-root"
    spawn(layout, "netlinks", [sys.executable, "-m", "sandbox.fakehw.netlinks", "--root",
                               str(root), "--netns", str(ns), "--control",
                               str(control_socket(layout))])

    def links_made() -> bool:
        shown = run(["nsenter", f"--net={ns}", "ip", "-j", "link", "show"], check=False)
        names = {link.get("ifname") for link in json.loads(shown.stdout or "[]")}
        return set(tree_links(root)) <= names

    wait_for(layout, "netlinks", "the tree's netdevs as links", links_made, 30)


def start_node_plugins(layout: Layout, progress: Progress, options: Sequence[str] = ()) -> None:
    """The reference device plugin on the fake root, against the real kubelet.

    Runs once the kubelet is healthy (the plugin registers with its kubelet.sock). It
    follows the node's control socket (``--watch``): a fault reaches ListAndWatch at once.
    ``options``: more plugin flags (``sandbox up --pre-start-required``).
    """
    progress("reference device plugin")
    spawn(layout, "deviceplugin", [
        sys.executable, "-m", "hwplugins.deviceplugin", "--root",
        str(layout.state / "node-root"), "--kubelet-dir", str(DEVICE_PLUGINS_DIR),
        "--watch", str(control_socket(layout)), *options,
    ])


def control_socket(layout: Layout) -> Path:
    return layout.state / "node" / "control.sock"


def start_dra_driver(layout: Layout, node: NodeSpec, progress: Progress,
                     options: Sequence[str] = ()) -> None:
    """The reference DRA driver (``python -m hwplugins.dra``) on the fake root, against the
    real kubelet and API server.

    Runs once the kubelet is healthy: it waits for the kubelet's ``plugins_registry`` (the
    kubelet's plugin watcher creates it), then the driver serves
    ``plugins/dra.hwsandbox.dev/dra.sock`` and registers through
    ``plugins_registry/dra.hwsandbox.dev-reg.sock``. CDI specs of prepared claims go to
    ``state_dir/cdi`` (containerd's ``cdi_spec_dirs``: they reach the container), their
    ``hostPath``s name the node's device nodes in ``state_dir/dev``; the partition config
    (``sandbox dra config``) and the checkpoint live in ``state_dir/dra``, so nothing of a
    torn-down cluster is left under the kubelet root. API access: the admin kubeconfig.
    It follows the node's control socket (``--watch``): a fault reaches the slices at once.
    ``options``: more driver flags (``sandbox up --dra-compatibility-groups`` passes
    ``--compatibility-groups``, ``--dra-skip-node-operations T`` ``--skip-node-operations T``).
    """
    from hwplugins.dra import DRIVER
    from hwplugins.dra.kubeletplugin import REGISTERED

    from sandbox.draconfig import driver_config

    root = kubelet_root()
    registry = root / "plugins_registry"
    wait_for(layout, "kubelet", f"serving its plugin watcher ({registry})",
              registry.is_dir, 60)
    layout.dra.mkdir(parents=True, exist_ok=True)
    layout.cdi.mkdir(parents=True, exist_ok=True)
    config = layout.dra / "config.json"
    config.write_text(json.dumps(driver_config(node), indent=2) + "\n")
    progress("reference DRA driver")
    proc = spawn(layout, "dra-driver", [
        sys.executable, "-m", "hwplugins.dra", "--root", str(layout.state / "node-root"),
        "--node-name", node.name, "--kubeconfig", str(layout.kubeconfig),
        "--config", str(config), "--plugins-dir", str(root / "plugins"),
        "--registry-dir", str(registry), "--cdi-dir", str(layout.cdi),
        "--host-dev-dir", str(layout.dev), "--checkpoint", str(layout.dra / "checkpoint.json"),
        "--watch", str(control_socket(layout)), *options,
    ])
    socket_path = registry / f"{DRIVER}-reg.sock"
    wait_for(layout, "dra-driver", f"serving {socket_path}", socket_path.exists, 60)
    # The kubelet registers it on its plugin reconciler's next pass (every second); a pod
    # with a claim that reaches the kubelet before that fails ("DRA driver ... is not
    # registered") and is retried only after the kubelet's back-off: 90 s seen.
    wait_for(layout, "dra-driver", "registered by the kubelet",
             lambda: find_line(proc, REGISTERED.encode(), anywhere=True) is not None, 60)

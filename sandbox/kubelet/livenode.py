"""A profile's node served live for ``sandbox kubelet check --profile``: its tree over
FUSE in the check's work directory, and the fault the health-update check injects.

    pick_node(...)        the profile's node to serve (--node, or its only one)
    require_host()        root, FUSE and the namespace's tools, or one line saying so
    serving(spec, base)   context: the node server (``python -m sandbox.agent`` on a
                          resolved spec file, detached, as ``sandbox mount --daemon`` and
                          the runtimes run it) at BASE/root, control socket
                          BASE/control.sock; on the way out, however it is left (an
                          error, Ctrl-C, SIGTERM), unmounted and the server stopped, with
                          those signals held until that is done
    health_fault(node)    the check's ``Fault``: the first advertised healthy device that
                          names one of the node's devices is made unhealthy (aer-fatal,
                          what every PCI device shows) through the control socket
    owner_of(id, owners)  which of the node's devices a plugin's device id names
    check_on_node(...)    ``check`` of a stock plugin on a served node: the plugin in its
                          own mount namespace (``nodeview``), the work dir under /tmp; no
                          mount, server, process or directory left after it
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandbox import supervisor
from sandbox.agent import start_node, unmount, wait_node, wait_unmounted
from sandbox.errors import MountError, SandboxError
from sandbox.fakehw.control import ControlClient
from sandbox.kubelet.conformance import (
    DIR_NAME,
    CheckReport,
    Fault,
    FaultResult,
    check,
    shell_fault,
)
from sandbox.kubelet.nodeview import STOCK_DIR, argv_prefix, require_tools
from sandbox.podhealth import device_owners
from sandbox.profile import load_profile
from sandbox.profile import spec as specfile
from sandbox.profile.spec import NodeSpec

REASON = "aer-fatal"
_SHOWN = 4  # advertised ids named in a message


@dataclass(frozen=True)
class ServedNode:
    spec: NodeSpec
    root: Path  # root/sys, root/dev, root/proc
    control: Path  # its control socket

    def env(self) -> dict[str, str]:
        """What a ``--fault`` command is told about the node."""
        return {"HWSANDBOX_CONTROL_SOCKET": str(self.control), "HWSANDBOX_NODE": self.spec.name,
                "HWSANDBOX_ROOT": str(self.root)}


def require_host() -> None:
    """SandboxError, one line with the hint, when this process cannot serve a node's tree
    and give a plugin a mount namespace: root (CAP_SYS_ADMIN), FUSE, unshare and mount."""
    if os.geteuid() != 0:
        raise SandboxError("kubelet check --profile needs root (CAP_SYS_ADMIN: it mounts "
                           "the node's tree over FUSE and gives the plugin a mount "
                           "namespace): run it with sudo -E")
    if shutil.which("fusermount3") is None or not os.path.exists("/dev/fuse"):
        raise MountError("serving the node's tree needs FUSE: apt-get install fuse3 "
                         "(and /dev/fuse must exist)")
    require_tools()


@contextlib.contextmanager
def serving(spec: NodeSpec, base: Path, timeout: float = 20.0) -> Iterator[ServedNode]:
    """Serve ``spec``'s tree at ``base/root`` for the block (see the module's docstring).
    MountError, with the server's own words, when it does not come up."""
    root, spec_file = base / "root", base / "spec.json"
    spec_file.write_text(specfile.dump(spec))
    proc = None
    try:
        with supervisor.signals_held():  # started and known as one: a Ctrl-C cannot lose it
            proc = start_node(None, spec.base_name, root, index=spec.index, state_dir=base,
                              log_file=base / "mount.log", spec_file=spec_file)
        wait_node(proc, timeout)
        yield ServedNode(spec, root, base / "control.sock")
    finally:
        with supervisor.signals_held():
            try:
                if os.path.ismount(root):
                    unmount(root)
                if not wait_unmounted(root):
                    raise MountError(f"{root} is still mounted: fusermount3 -uz {root}")
            finally:
                # it exits once unmounted (detached, not our child); killed if stuck
                if proc is not None:
                    supervisor.stop([proc], timeout=10.0)


def owner_of(device_id: str, owners: Mapping[str, str]) -> str | None:
    """The node's device a plugin's id names: the id itself is one of a device's names
    (``podhealth.device_names``: its profile id, GPU UUID, PCI addresses of its functions
    and VFs, DRM card, /dev/nvidiaN, FPGA ports), else the longest such name found in it
    between non-alphanumerics (``card1-0`` -> card1's device)."""
    if device_id in owners:
        return owners[device_id]
    for name in sorted(owners, key=len, reverse=True):
        if len(name) >= 4 and re.search(
                rf"(?<![0-9A-Za-z]){re.escape(name)}(?![0-9A-Za-z])", device_id):
            return owners[name]
    return None


def health_fault(node: ServedNode) -> Fault:
    """The health-update check's fault on ``node`` (see the module's docstring)."""
    owners = device_owners(node.spec)

    def fault(advertised: Sequence[str]) -> FaultResult:
        if not advertised:
            return FaultResult(False, "no healthy device advertised to make unhealthy")
        for device_id in advertised:
            owner = owner_of(device_id, owners)
            if owner is None:
                continue
            with ControlClient(node.control, node=node.spec.name) as client:
                state = client.devices().get(owner, {}).get("state", {})
                if state.get("health", "healthy") != "healthy" or not state.get("plugged", True):
                    continue
                client.health(owner, "unhealthy", REASON)
            named = "" if owner == device_id else f" (advertised as {device_id})"
            return FaultResult(True, f"{owner}{named} made unhealthy ({REASON})")
        shown = ", ".join(advertised[:_SHOWN]) + (", ..." if len(advertised) > _SHOWN else "")
        return FaultResult(False, f"none of the advertised ids ({shown}) names a healthy "
                           f"device of node {node.spec.name} (its ids, GPU UUIDs, PCI "
                           "addresses, DRM cards, /dev names): give --fault")

    return fault


def pick_node(profile: str, node: str | None, index: int | None) -> NodeSpec:
    """The node of ``profile`` to serve: ``node`` (replica ``index``), or its only one."""
    cluster = load_profile(profile).cluster
    names = ", ".join(n.name for n in cluster.nodes)
    if node is None:
        if len(cluster.nodes) != 1:
            raise SandboxError(f"{profile} has several nodes; pick one with --node ({names})")
        return cluster.nodes[0]
    found = cluster.node(node, index)
    if found is None:
        which = node if index is None else f"{node} index {index}"
        raise SandboxError(f"no node {which} in {profile} (nodes: {names})")
    return found


def check_on_node(plugin_cmd: Sequence[str], spec: NodeSpec, *, fault_cmd: str | None = None,
                  resource: str | None = None, timeout: float = 10.0,
                  restart_within: float = 5.0) -> CheckReport:
    """``check(plugin_cmd)`` with ``spec``'s node served live and the plugin in a mount
    namespace where it is the machine (``nodeview``): the stock paths, no flags. The
    health-update fault is ``health_fault``'s, or ``fault_cmd``'s (``ServedNode.env`` in its
    environment)."""
    # Plugin sockets sit beside kubelet.sock: keep the directory short (unix paths <= 105).
    base = Path(tempfile.mkdtemp(prefix="kc-", dir="/tmp"))
    try:
        with serving(spec, base) as node:
            fault = shell_fault(fault_cmd, node.env()) if fault_cmd else health_fault(node)
            return check(plugin_cmd, workdir=base, resource=resource, fault=fault,
                         timeout=timeout, restart_within=restart_within,
                         prefix=argv_prefix(node.root, base / DIR_NAME), plugin_dir=STOCK_DIR)
    finally:
        with supervisor.signals_held():
            remove_workdir(base)


def remove_workdir(base: Path) -> None:
    """Remove a check's work directory; never one with the tree still mounted in it."""
    if os.path.ismount(base / "root"):
        raise MountError(f"{base / 'root'} is still mounted, so {base} is left: "
                         f"fusermount3 -uz {base / 'root'}; rm -r {base}")
    shutil.rmtree(base, ignore_errors=True)

"""The node directory the bundled manifests' hostPaths name, on the native runtime's host.

On kind every node container has its own ``/var/lib/hw-sandbox``: the agent serves the
node's fake tree at ``/var/lib/hw-sandbox/root`` and ``sandbox plugins deploy`` puts our
NVML in ``/var/lib/hw-sandbox/nvml``. On the native runtime the node is this host, so
``deploy`` makes ``/var/lib/hw-sandbox/<name>`` symlinks to the sandbox's own directories
(the kubelet checks a hostPath's type through the link and containerd mounts what it
resolves to) and ``down`` removes them, and ``/var/lib/hw-sandbox`` itself when ``deploy``
made it (it is in the record's ``created``):

    root        -> <state>/node-root    the node's live FUSE tree
    nvml        -> <state>/nvml         our libnvidia-ml.so.1 and nvidia-smi (by deploy)
    driver      -> <state>/driver       a driver root of ours, for NVIDIA's DRA driver
                                        (docs/nvml.md; by deploy)
    features.d  -> <state>/features.d   gpu-feature-discovery's label file, which the
                                        manifest writes to /etc/kubernetes/... on kind
    control.sock -> <state>/node/control.sock  the tree's control socket (our NVML in
                                        NVIDIA's plugin pod watches its changes)

One native sandbox runs per host (one kubelet), so the links are never shared; a link
left by a sandbox whose state dir is gone is replaced.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from sandbox.errors import SandboxError
from sandbox.runtimes.record import read_record, write_record

HOST_STATE = Path("/var/lib/hw-sandbox")
LINKS = {"root": "node-root", "nvml": "nvml", "driver": "driver", "features.d": "features.d",
         "control.sock": "node/control.sock"}
# the targets deploy creates (the others the node has)
_MADE_DIRS = ("nvml", "driver", "features.d")
# gpu-feature-discovery's output hostPath in the bundled manifest (node-feature-discovery's
# local source directory): on native it would be the host's own /etc
NFD_FEATURES = "/etc/kubernetes/node-feature-discovery/features.d"


def link_host_paths(state_dir: Path, host_state: Path = HOST_STATE) -> dict[Path, Path]:
    """Make ``host_state/<name>`` point at this sandbox's directories; returns link ->
    target. Idempotent."""
    record = read_record(state_dir)
    if record is None:
        raise SandboxError(f"no sandbox record in {state_dir}")
    if not host_state.is_dir():
        host_state.mkdir(parents=True, mode=0o755)
        write_record(state_dir, replace(
            record, created_paths=(*(record.created_paths or ()), str(host_state))))
    made = {}
    for name, sub in LINKS.items():
        target = state_dir / sub
        if sub in _MADE_DIRS:
            target.mkdir(exist_ok=True)
        link = host_state / name
        if link.is_symlink():
            if Path(os.readlink(link)) == target:
                made[link] = target
                continue
            if link.exists():
                raise SandboxError(f"{link} points at {os.readlink(link)}, which exists: is "
                                   "another native sandbox running? (`sandbox down` it)")
            link.unlink()  # a sandbox that went without its down
        elif link.exists():
            raise SandboxError(f"{link} exists and is not a link hw-sandbox made; move it "
                               "away to deploy bundled manifests on the native runtime")
        link.symlink_to(target)
        made[link] = target
    return made


def host_links(state_dir: Path, host_state: Path = HOST_STATE) -> list[Path]:
    """The links in ``host_state`` that point into ``state_dir``."""
    if not host_state.is_dir():
        return []
    inside = str(state_dir).rstrip("/") + "/"
    return sorted(p for p in host_state.iterdir()
                  if p.is_symlink() and os.readlink(p).startswith(inside))  # fmt: skip


def unlink_host_paths(state_dir: Path, host_state: Path = HOST_STATE) -> None:
    """``down``: remove this sandbox's links (the record's ``created`` removes the
    directory after, if empty)."""
    for link in host_links(state_dir, host_state):
        link.unlink(missing_ok=True)


def install_nvml(state_dir: Path) -> Path:
    """Our libnvidia-ml.so.1, built (cached) and copied to ``<state>/nvml``, which the
    node's ``/var/lib/hw-sandbox/nvml`` links to, with our nvidia-smi beside it; and a
    driver root of ours at ``<state>/driver`` (``/var/lib/hw-sandbox/driver``)."""
    from sandbox.nvml import build, node_driver_root, smi

    lib = build()
    node_driver_root(state_dir / "driver")
    dest = state_dir / "nvml" / lib.name
    dest.parent.mkdir(exist_ok=True)
    shutil.copy2(smi(), dest.with_name(smi().name))
    shutil.copy2(lib, dest)
    return dest

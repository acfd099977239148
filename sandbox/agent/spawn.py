"""Starting a node server as its own process (``python -m sandbox.agent``) and stopping
what it mounted: what the runtimes and ``sandbox mount --daemon`` use."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sandbox import supervisor
from sandbox.errors import MountError, SpawnError
from sandbox.fakehw.serve.mountroot import check_mount_root, recover_mount
from sandbox.supervisor import Proc


def start_node(profile_path: str | None, node: str, root: Path, *, index: int | None = None,
               state_dir: Path | None, log_file: Path, dev_dir: Path | None = None,
               extra: Sequence[str] = (), spec_file: Path | None = None) -> Proc:
    """Start the node server for one node, detached (``sandbox.supervisor``); returns at
    once. ``state_dir`` None: the control socket is ``ROOT.sock`` beside the mount.
    ``spec_file``: the server serves that resolved spec instead of resolving the profile."""
    source = (["--spec", str(spec_file.absolute())] if spec_file
              else ["--profile", profile_path or ""])
    argv = [sys.executable, "-m", "sandbox.agent", *source, "--node", node, str(root)]
    if state_dir is not None:
        argv += ["--state-dir", str(state_dir)]
    if index is not None:
        argv += ["--index", str(index)]
    if dev_dir is not None:
        argv += ["--dev-dir", str(dev_dir)]
    argv += list(extra)
    return supervisor.spawn(f"mount {node}", argv, log_file)


def wait_node(proc: Proc, timeout: float = 20.0) -> Proc:
    """Until the server prints its ready line. MountError otherwise."""
    try:
        supervisor.wait_ready(proc, timeout)
    except SpawnError as exc:
        raise MountError(f"{proc.name}: the FUSE server did not come up: "
                         f"{supervisor.log_tail(proc.log)}") from exc
    return proc


def spawn_node(profile_path: str | None, node: str, root: Path, *,
               index: int | None = None, state_dir: Path | None, log_file: Path,
               dev_dir: Path | None = None, extra: Sequence[str] = (), timeout: float = 20.0,
               spec_file: Path | None = None) -> Proc:
    """Start one node's server detached and wait until it serves."""
    proc = start_node(profile_path, node, root, index=index, state_dir=state_dir,
                      log_file=log_file, dev_dir=dev_dir, extra=extra, spec_file=spec_file)
    return wait_node(proc, timeout)


def wait_unmounted(root: Path, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.ismount(root):
            return True
        time.sleep(0.05)
    return False


def unmount(root: Path) -> None:
    """Unmount a node's tree (lazily if busy); a dead mount is cleared too."""
    recover_mount(check_mount_root(root))
    if os.path.ismount(root):
        supervisor.unmount_fuse(root)

"""Serving one node's fake hardware: the profile -> tree -> FUSE mount -> control socket.

Every runtime runs this once per node replica: the local and native runtimes as a host
process, kind as a privileged DaemonSet pod inside the node container. Optionally it also
creates the node's device nodes in a directory of real device nodes (what a container
runtime stats when a plugin's Allocate names them), as ``sandbox.fakehw.devnodes`` says
(a harmless memory device, never a tree's own number); they, and the directories made
for them, are removed again on exit.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import trio

from sandbox import supervisor
from sandbox.errors import MountError, SandboxError, SpawnError
from sandbox.fakehw.build import build_tree
from sandbox.fakehw.control import ControlPaths
from sandbox.fakehw.devnodes import is_ours, real_node
from sandbox.fakehw.fs import serve
from sandbox.fakehw.mountroot import check_mount_root
from sandbox.fakehw.tree import (
    DeviceNode,
    DeviceState,
    Health,
    Reason,
    Tree,
    check_component,
)
from sandbox.profile import NodeSpec, load_profile
from sandbox.profile.spec import read_node
from sandbox.supervisor import Proc

log = logging.getLogger(__name__)

IN_NODE_ENV = "HWSANDBOX_IN_NODE"  # set by the kind agent DaemonSet: /dev is the node's own


def initial_states(node: NodeSpec) -> dict[str, DeviceState]:
    """Device states as the profile starts them (health and reason per device)."""
    states: dict[str, DeviceState] = {}
    for d in node.devices:
        if d.health == "unhealthy":
            reason = Reason(d.health_reason or "aer-fatal")
            if reason is Reason.REMOVED:
                states[d.id] = DeviceState(plugged=False)
            else:
                states[d.id] = DeviceState(health=Health.UNHEALTHY, reason=reason)
    return states


def resolve_node(profile_path: str, node: str, index: int | None = None) -> NodeSpec:
    cluster = load_profile(profile_path).cluster
    spec = cluster.node(node, index)
    if spec is None:
        names = ", ".join(n.name for n in cluster.nodes)
        raise SandboxError(f"{profile_path}: no node {node!r} (nodes: {names})")
    return spec


def device_nodes(tree: Tree) -> Iterator[tuple[str, DeviceNode]]:
    """Every character and block node below ``dev/`` (paths relative to it)."""
    for path, entry in tree.walk():
        if path.startswith("dev/") and isinstance(entry, DeviceNode):
            yield path[len("dev/"):], entry


def _check_dev_dir(dev_dir: Path) -> None:
    real = dev_dir.resolve()
    if real == Path("/dev") or Path("/dev") in real.parents:
        if os.environ.get(IN_NODE_ENV) != "1":
            raise SandboxError(
                f"{dev_dir}: refusing to create device nodes in the host's /dev "
                f"(allowed only inside a node container, with {IN_NODE_ENV}=1)"
            )
    if real == Path("/sys") or Path("/sys") in real.parents:
        raise SandboxError(f"{dev_dir}: refusing to write under /sys")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(top: int, parts: list[str], made: list[str] | None = None) -> int:
    """An fd of ``parts`` below ``top``: each step relative to the last open directory,
    no symlink followed, so nothing outside ``top`` is ever reached. With ``made``, missing
    directories are created and recorded there (``a/b/``, parents first) for teardown."""
    fd = os.dup(top)
    try:
        for i, part in enumerate(parts):
            check_component(part)
            if made is not None:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    made.append("/".join(parts[:i + 1]) + "/")
                except FileExistsError:
                    pass
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_device_nodes(tree: Tree, dev_dir: Path) -> list[str]:
    """mknod the tree's device nodes under ``dev_dir`` as ``devnodes.real_node`` says;
    returns what it created (relative paths, directories with a trailing ``/``, parents
    first), which is all ``remove_device_nodes`` will ever remove."""
    _check_dev_dir(dev_dir)
    made: list[str] = []
    try:
        # the directory itself is the caller's choice (checked above); what goes inside
        # it is made relative to it, never following a link
        dev_dir.mkdir(parents=True, exist_ok=True)
        top = os.open(dev_dir, _DIR_FLAGS)
    except OSError as exc:
        raise SandboxError(f"{dev_dir}: cannot open: {exc.strerror}") from exc
    try:
        _make_nodes(tree, top, dev_dir, made)
    except BaseException:
        remove_device_nodes(made, dev_dir)
        raise
    finally:
        os.close(top)
    return made


def _make_nodes(tree: Tree, top: int, dev_dir: Path, made: list[str]) -> None:
    for rel, dev in device_nodes(tree):
        *parents, name = rel.split("/")
        ftype, rdev, mode = real_node(dev)
        try:
            parent = _open_dir(top, parents, made)
        except (OSError, ValueError) as exc:
            raise SandboxError(f"{dev_dir}/{rel}: cannot make its directory: {exc}") from exc
        try:
            check_component(name)
            try:
                # the umask applies: never wider than the policy's mode
                os.mknod(name, ftype | mode, rdev, dir_fd=parent)
            except FileExistsError:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if stat.S_IFMT(st.st_mode) == ftype and st.st_rdev == rdev:
                    continue  # the node's own (its /dev/null) or an earlier run's: keep it
                raise SandboxError(
                    f"{dev_dir}/{rel}: exists and is not the device we would create"
                ) from None
            made.append(rel)
        finally:
            os.close(parent)


def remove_device_nodes(made: Sequence[str], dev_dir: Path) -> None:
    """Unlink what ``create_device_nodes`` made, if it is still a node the policy makes,
    then the directories it made, if empty (deepest first). Never follows a symlink out
    of ``dev_dir``."""
    try:
        top = os.open(dev_dir, _DIR_FLAGS)
    except OSError:
        return
    try:
        for rel in sorted(made, key=lambda r: (r.endswith("/"), -r.count("/"))):
            *parents, name = rel.rstrip("/").split("/")
            try:
                parent = _open_dir(top, parents)
            except (OSError, ValueError):
                continue
            try:
                if rel.endswith("/"):
                    os.rmdir(name, dir_fd=parent)
                elif is_ours(os.stat(name, dir_fd=parent, follow_symlinks=False)):
                    os.unlink(name, dir_fd=parent)
            except (OSError, ValueError):
                pass
            finally:
                os.close(parent)
    finally:
        os.close(top)


def run_node(profile_path: str | None, node: str | None, root: Path, *,
             index: int | None = None, state_dir: Path | None = None,
             dev_dir: Path | None = None, dev_map: tuple[int, int] | None = None,
             allow_dev: bool = False, ready: Callable[[ControlPaths], None] | None = None,
             spec_file: Path | None = None) -> None:
    """Mount and serve one node until unmounted or signalled (foreground): the node of the
    resolved ``spec_file`` if given (docs/spec-format.md), else of the profile."""
    if spec_file is not None:
        spec = read_node(spec_file, node, index)
    elif profile_path is not None and node is not None:
        spec = resolve_node(profile_path, node, index)
    else:
        raise SandboxError("a node to serve needs a spec file, or a profile and a node name")
    root = check_mount_root(root)

    def rebuild(states: Mapping[str, DeviceState]) -> Tree:
        return build_tree(spec, states)

    states = initial_states(spec)
    made: list[str] = []
    base_tree = build_tree(spec, {})
    if dev_dir is not None:
        made = create_device_nodes(base_tree, dev_dir)
        log.info("created %d device nodes under %s", len(made), dev_dir)

    class _Status:
        def started(self, value: ControlPaths | None = None) -> None:
            if ready is not None and value is not None:
                ready(value)

    try:
        trio.run(lambda: serve(root, rebuild, initial_states=states, state_dir=state_dir,
                               dev_map=dev_map if allow_dev else None, allow_dev=allow_dev,
                               fsname=f"hwsandbox:{spec.name}", node=spec.name,
                               task_status=_Status()))
    finally:
        if dev_dir is not None:
            remove_device_nodes(made, dev_dir)


def start_node(profile_path: str | None, node: str, root: Path, *, index: int | None = None,
               state_dir: Path | None, log_file: Path, dev_dir: Path | None = None,
               extra: Sequence[str] = (), spec_file: Path | None = None) -> Proc:
    """Start ``sandbox mount`` for one node, detached (``sandbox.supervisor``); returns at
    once. ``state_dir`` None: the control socket is ``ROOT.sock`` beside the mount.
    ``spec_file``: the server serves that resolved spec instead of resolving the profile."""
    source = ["--spec", str(spec_file.absolute())] if spec_file else [profile_path or ""]
    argv = [sys.executable, "-m", "sandbox", "mount", *source, "--node", node, str(root)]
    if state_dir is not None:
        argv += ["--state-dir", str(state_dir)]
    if index is not None:
        argv += ["--index", str(index)]
    if dev_dir is not None:
        argv += ["--dev-dir", str(dev_dir)]
    argv += list(extra)
    return supervisor.spawn(f"mount {node}", argv, log_file)


def wait_node(proc: Proc, timeout: float = 20.0) -> Proc:
    """Until the server says ``ready SOCKET PID``. MountError otherwise."""
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
    from sandbox.fakehw.mountroot import recover_mount

    recover_mount(root)
    if os.path.ismount(root):
        supervisor.unmount_fuse(root)

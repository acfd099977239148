"""A node's device nodes in a directory of real device nodes: what a container runtime
stats when a plugin's Allocate names them.

Each is a harmless memory device as ``sandbox.fakehw.devnodes`` says, never a tree's own
number; they, and the directories made for them, are removed again on exit. Never in the
host's /dev (only inside a node container, ``IN_NODE_ENV``), never under /sys, never
through a symbolic link.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from sandbox.errors import SandboxError
from sandbox.fakehw.devnodes import is_ours, real_node
from sandbox.fakehw.tree import DeviceNode, Tree, check_component

IN_NODE_ENV = "HWSANDBOX_IN_NODE"  # set in the kind agent's pod: /dev is the node's own


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

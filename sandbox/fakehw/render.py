"""``render``: write a ``Tree`` to a plain directory (the non-live way to serve a fake root).

Files keep their modes, symlinks stay relative, and device nodes become real devices
(``mknod=True`` as root: harmless memory devices as ``sandbox.fakehw.devnodes`` says, the
tree's own numbers only with ``real_numbers``) or empty placeholder files listed in
``dev/.devices`` as ``<name> c|b <major> <minor>`` lines.
A ``.hwsandbox-render`` manifest at the top lists every
entry the render created; a later ``force`` render removes exactly those (files whose type
still matches, directories once empty) and nothing else. Foreign files are never removed or
replaced: one standing where the tree needs an entry is an error.

Every write is made relative to an open directory descriptor of its parent, opened with
``O_NOFOLLOW`` from the target down, and every name is one plain path component: a symlink
planted inside the target, or a hostile name, cannot redirect a write outside it.

Guard rails: the target may never be a host path ``refusedpaths`` refuses (``/``, the host's
top-level directories, anything below ``/sys``, ``/proc``, ``/dev`` except ``/dev/shm``,
``/etc``, ``/usr``, ...), nor anything that resolves there, nor a mounted pseudo filesystem,
nor a directory that looks like a real sysfs or a real root filesystem. Any other non-empty
directory needs ``force``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandbox.errors import RenderError
from sandbox.fakehw.devnodes import own_numbers, real_node
from sandbox.fakehw.refusedpaths import host_path_problem
from sandbox.fakehw.tree import (
    BlockDevice,
    DeviceNode,
    Dir,
    Entry,
    File,
    Symlink,
    Tree,
    check_component,
)

MARKER = ".hwsandbox-render"
DEVICES_LIST = "dev/.devices"
_MANIFEST_HEADER = "# written by `sandbox render`; a forced render removes exactly these entries"
_PSEUDO_FS = frozenset({
    "sysfs", "proc", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "securityfs",
    "configfs", "tracefs", "bpf", "fusectl", "pstore", "efivarfs", "mqueue", "hugetlbfs",
    "binfmt_misc", "autofs", "rpc_pipefs", "nsfs",
})
_SYSFS_TOP = frozenset({"devices", "bus", "class", "kernel", "module", "firmware"})
_ROOTFS_TOP = frozenset({"etc", "usr", "bin", "lib"})
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class RenderStats:
    dirs: int
    files: int
    links: int
    devices: int
    mknod: bool  # True: devices are real device nodes; False: placeholders


def render(tree: Tree, out_dir: str | os.PathLike[str], mknod: bool = False,
           force: bool = False, real_numbers: bool = False) -> RenderStats:
    """Write ``tree`` below ``out_dir`` (created if missing). See the module docstring."""
    out = Path(out_dir)
    real = Path(os.path.realpath(out))
    check_target(real)
    if out.exists() and not out.is_dir():
        raise RenderError(f"{out}: exists and is not a directory")
    if not out.is_dir():
        out.mkdir(parents=True)
    try:
        top = os.open(real, _DIR_FLAGS)
    except OSError as exc:
        raise RenderError(f"cannot open {real}: {exc.strerror}") from exc
    try:
        entries = os.listdir(top)
        if entries:
            _refuse_real_system(real, entries)
            if not force:
                raise RenderError(
                    f"{out}: directory is not empty; pass --force to write into it "
                    "(a previous render there is replaced; other files are kept)"
                )
            if MARKER in entries:
                _remove_previous(top, real)
        real_nodes = mknod and os.geteuid() == 0
        return _write(tree, top, str(real), real_nodes, own_numbers if real_numbers else real_node)
    finally:
        os.close(top)


def check_target(real: Path) -> None:
    """Refuse targets that are, or resolve into, the host's own root or pseudo filesystems."""
    text = str(real)
    problem = host_path_problem(text)
    if problem is not None:
        raise RenderError(f"refusing to render into {text}: {problem}")
    fstype = _fstype(text)
    if fstype in _PSEUDO_FS:
        raise RenderError(f"refusing to render into {text}: it is on a {fstype} filesystem")


def _refuse_real_system(real: Path, entries: list[str]) -> None:
    names = set(entries)
    if len(names & _SYSFS_TOP) >= 3 and not (real / MARKER).exists():
        raise RenderError(f"refusing to write into {real}: it looks like a real sysfs")
    if len(names & _ROOTFS_TOP) >= 3:
        raise RenderError(f"refusing to write into {real}: it looks like a real root filesystem")
    for sub, fs in (("sys", "sysfs"), ("proc", "proc"), ("dev", "devtmpfs")):
        p = real / sub
        if p.is_dir() and not p.is_symlink() and _fstype(str(p), exact=True) == fs:
            raise RenderError(f"refusing to write into {real}: {p} is a mounted {fs}")


def _fstype(path: str, exact: bool = False) -> str | None:
    """The filesystem type of the mount holding ``path`` (exact: only if mounted AT it)."""
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, right.split()[0] if right else None
    except OSError:
        return None
    if exact and best != path:
        return None
    return fstype


# -- the manifest ---------------------------------------------------------------------
def _read_manifest(top: int) -> list[tuple[str, str]]:
    """(kind, relative path) per entry a previous render created; [] without a manifest."""
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
    except OSError as exc:
        raise RenderError(f"cannot read the render manifest {MARKER}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as fh:
        lines = fh.read().decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        kind, _, rel = line.partition(" ")
        if kind in ("d", "f", "l", "c", "b") and rel:
            out.append((kind, rel))
    return out


def _remove_previous(top: int, real: Path) -> None:
    """Remove what the manifest lists, deepest first; never anything it does not list."""
    manifest = _read_manifest(top)
    for kind, rel in sorted(manifest, key=lambda e: e[1].count("/"), reverse=True):
        _remove_listed(top, kind, rel)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(MARKER, dir_fd=top)


def _remove_listed(top: int, kind: str, rel: str) -> None:
    parts = rel.split("/")
    try:
        for part in parts:
            check_component(part)
    except ValueError:
        return  # not something a render writes: a hand-edited manifest, ignore the line
    parent = _open_parent(top, parts[:-1])
    if parent is None:
        return
    name = parts[-1]
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if kind == "d":
            if stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(OSError):  # not empty: someone else's files inside
                    os.rmdir(name, dir_fd=parent)
            return
        matches = {
            "f": stat.S_ISREG(st.st_mode),
            "l": stat.S_ISLNK(st.st_mode),
            "c": stat.S_ISCHR(st.st_mode) or stat.S_ISREG(st.st_mode),
            "b": stat.S_ISBLK(st.st_mode) or stat.S_ISREG(st.st_mode),
        }[kind]
        if matches:
            os.unlink(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    finally:
        if parent != top:
            os.close(parent)


def _open_parent(top: int, parts: list[str]) -> int | None:
    """An fd of the directory ``parts`` below ``top``, no symlink followed; None if absent."""
    fd = top
    try:
        for part in parts:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            if fd != top:
                os.close(fd)
            fd = nxt
    except OSError:
        if fd != top:
            os.close(fd)
        return None
    return fd


# -- writing ----------------------------------------------------------------------------
@dataclass
class _Writer:
    """One render in progress: what it created (the manifest) and the counts."""

    root: str
    real_nodes: bool
    node_policy: Callable[[DeviceNode], tuple[int, int, int]]
    made: list[str]
    listed: list[str]
    dirs: int = 0
    files: int = 0
    links: int = 0
    devices: int = 0

    def write_dir(self, fd: int, prefix: str, directory: Dir) -> None:
        """Each child of ``directory`` relative to ``fd`` (its open directory), recursively."""
        for name in sorted(directory.children):
            entry = directory.children[name]
            rel = f"{prefix}/{name}" if prefix else name
            try:
                check_component(name)
            except ValueError as exc:
                raise RenderError(f"{self.root}/{rel}: {exc}") from None
            try:
                self._write_one(fd, name, rel, entry)
            except FileExistsError:
                raise _foreign(self.root, rel) from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _foreign(self.root, rel) from exc
                hint = (" (mknod needs root with CAP_MKNOD)"
                        if self.real_nodes and isinstance(exc, PermissionError) else "")
                raise RenderError(f"cannot write {self.root}/{rel}: {exc.strerror}{hint}") from exc

    def _write_one(self, parent: int, name: str, rel: str, entry: Entry) -> None:
        if isinstance(entry, Dir):
            try:
                os.mkdir(name, entry.mode, dir_fd=parent)
                self.made.append(f"d {rel}")
            except FileExistsError:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    raise
            self.dirs += 1
            sub = os.open(name, _DIR_FLAGS, dir_fd=parent)
            try:
                self.write_dir(sub, rel, entry)
            finally:
                os.close(sub)
        elif isinstance(entry, File):
            fd = os.open(name, _FILE_FLAGS, entry.mode, dir_fd=parent)
            self.made.append(f"f {rel}")
            try:
                if entry.data:
                    os.write(fd, entry.data)
            finally:
                os.close(fd)
            self.files += 1
        elif isinstance(entry, Symlink):
            os.symlink(entry.target, name, dir_fd=parent)
            self.made.append(f"l {rel}")
            self.links += 1
        else:
            block = isinstance(entry, BlockDevice)
            kind = "b" if block else "c"
            if self.real_nodes:
                # as sandbox.fakehw.devnodes says: never a profile's number unless asked,
                # never wider than 0660, the umask applies (no chmod past it)
                ftype, rdev, mode = self.node_policy(entry)
                os.mknod(name, ftype | mode, rdev, dir_fd=parent)
                kind = "b" if stat.S_ISBLK(ftype) else "c"
            else:
                os.close(os.open(name, _FILE_FLAGS, 0o644, dir_fd=parent))
                self.listed.append(
                    f"{rel.removeprefix('dev/')} {kind} {entry.major} {entry.minor}\n")
            self.made.append(f"{kind} {rel}")
            self.devices += 1


def _write(tree: Tree, top: int, root: str, real_nodes: bool,
           node_policy: Callable[[DeviceNode], tuple[int, int, int]]) -> RenderStats:
    w = _Writer(root, real_nodes, node_policy, [], [])
    try:
        w.write_dir(top, "", tree.root)
        if not real_nodes and tree.get("dev") is not None:
            _write_file(top, root, DEVICES_LIST, "".join(w.listed))
            w.made.append(f"f {DEVICES_LIST}")
    finally:
        # Whatever happened, record what was created so a forced render can undo it.
        with contextlib.suppress(OSError, RenderError):
            _write_file(top, root, MARKER,
                        _MANIFEST_HEADER + "\n" + "".join(m + "\n" for m in w.made))
    return RenderStats(w.dirs, w.files, w.links, w.devices, real_nodes)


def _foreign(root: str, rel: str) -> RenderError:
    return RenderError(f"{root}/{rel}: already exists and was not written by a render; "
                       "not replacing it (move it away, or render into an empty directory)")


def _write_file(top: int, root: str, rel: str, text: str) -> None:
    parts = rel.split("/")
    parent = _open_parent(top, parts[:-1])
    if parent is None:
        raise RenderError(f"cannot write {root}/{rel}: its directory is missing")
    try:
        fd = os.open(parts[-1], _FILE_FLAGS, 0o644, dir_fd=parent)
    except FileExistsError:
        raise _foreign(root, rel) from None
    except OSError as exc:
        raise RenderError(f"cannot write {root}/{rel}: {exc.strerror}") from exc
    finally:
        if parent != top:
            os.close(parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)

"""``render``: write a ``Tree`` to a plain directory (the non-live way to serve a fake root).

Files keep their modes, symlinks stay relative, and character devices become real device
nodes (``mknod=True`` as root) or empty placeholder files listed in ``dev/.devices`` as
``<name> c <major> <minor>`` lines. A ``.hwsandbox-render`` marker at the top lets a later
``force`` render wipe exactly what an earlier render wrote.

Guard rails: the target may never be ``/``, nor ``/sys``, ``/proc`` or ``/dev`` or anything
below them (``/dev/shm`` excepted: it is plain tmpfs scratch space), nor anything that
resolves there, nor a mounted pseudo filesystem, nor a directory that looks like a real
sysfs or a real root filesystem. Any other non-empty directory needs ``force``.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from sandbox.errors import RenderError
from sandbox.fakehw.tree import CharDevice, Dir, File, Symlink, Tree

MARKER = ".hwsandbox-render"
DEVICES_LIST = "dev/.devices"
_FORBIDDEN = ("/sys", "/proc", "/dev")
_ALLOWED_UNDER_FORBIDDEN = ("/dev/shm",)
_PSEUDO_FS = frozenset({
    "sysfs", "proc", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "securityfs",
    "configfs", "tracefs", "bpf", "fusectl", "pstore", "efivarfs", "mqueue", "hugetlbfs",
    "binfmt_misc", "autofs", "rpc_pipefs", "nsfs",
})
_SYSFS_TOP = frozenset({"devices", "bus", "class", "kernel", "module", "firmware"})
_ROOTFS_TOP = frozenset({"etc", "usr", "bin", "lib"})


@dataclass(frozen=True)
class RenderStats:
    dirs: int
    files: int
    links: int
    devices: int
    mknod: bool  # True: devices are real character devices; False: placeholders


def render(tree: Tree, out_dir: str | os.PathLike[str], mknod: bool = False,
           force: bool = False) -> RenderStats:
    """Write ``tree`` below ``out_dir`` (created if missing). See the module docstring."""
    out = Path(out_dir)
    real = Path(os.path.realpath(out))
    check_target(real)
    if out.exists() and not out.is_dir():
        raise RenderError(f"{out}: exists and is not a directory")
    careful = False
    if out.is_dir():
        entries = os.listdir(out)
        if entries:
            _refuse_real_system(real, entries)
            if not force:
                raise RenderError(
                    f"{out}: directory is not empty; pass --force to write into it "
                    "(a previous render there is replaced)"
                )
            if MARKER in entries:
                for name in entries:
                    _remove(real / name)
            else:
                careful = True
    else:
        out.mkdir(parents=True)
    real_nodes = mknod and os.geteuid() == 0
    return _write(tree, str(real), real_nodes, careful)


def check_target(real: Path) -> None:
    """Refuse targets that are, or resolve into, the host's own root or pseudo filesystems."""
    text = str(real)
    if text == "/":
        raise RenderError("refusing to render over /")
    for bad in _FORBIDDEN:
        if text == bad or text.startswith(bad + "/"):
            if any(text == ok or text.startswith(ok + "/") for ok in _ALLOWED_UNDER_FORBIDDEN):
                continue
            raise RenderError(f"refusing to render into {text}: it is (below) the host's {bad}")
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


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _clear(path: str, want_dir: bool) -> bool:
    """Make room at ``path`` in a reused directory; True if a usable directory is there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        if want_dir:
            return True
        shutil.rmtree(path)
    else:
        os.unlink(path)
    return False


def _write(tree: Tree, root: str, real_nodes: bool, careful: bool) -> RenderStats:
    dirs = files = links = devices = 0
    listed: list[str] = []
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    try:
        for rel, entry in tree.walk():
            path = f"{root}/{rel}"
            if isinstance(entry, Dir):
                if not (careful and _clear(path, True)):
                    os.mkdir(path, entry.mode)
                dirs += 1
                continue
            if careful:
                _clear(path, False)
            if isinstance(entry, File):
                fd = os.open(path, flags, entry.mode)
                try:
                    if entry.data:
                        os.write(fd, entry.data)
                finally:
                    os.close(fd)
                files += 1
            elif isinstance(entry, Symlink):
                os.symlink(entry.target, path)
                links += 1
            elif isinstance(entry, CharDevice):
                if real_nodes:
                    os.mknod(path, stat.S_IFCHR | entry.mode, os.makedev(entry.major, entry.minor))
                else:
                    os.close(os.open(path, flags, 0o644))
                    listed.append(
                        f"{rel.removeprefix('dev/')} c {entry.major} {entry.minor}\n")
                devices += 1
        if not real_nodes and tree.get("dev") is not None:
            with open(f"{root}/{DEVICES_LIST}", "w", encoding="ascii") as fh:
                fh.writelines(listed)
        with open(f"{root}/{MARKER}", "w", encoding="ascii") as fh:
            fh.write("written by `sandbox render`; a forced render replaces this tree\n")
    except PermissionError as exc:
        hint = " (mknod needs root with CAP_MKNOD)" if real_nodes else ""
        raise RenderError(f"cannot write {exc.filename}: {exc.strerror}{hint}") from exc
    except OSError as exc:
        raise RenderError(f"cannot write {exc.filename}: {exc.strerror}") from exc
    return RenderStats(dirs, files, links, devices, real_nodes)

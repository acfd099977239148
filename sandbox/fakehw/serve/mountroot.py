"""The mount point of a FUSE tree: where one may go, what is mounted there, and clearing
the dead mount a killed server leaves behind. No pyfuse3 here (``fs`` serves the mount):
checking or recovering a mount point needs no FUSE bindings.

A mount point is checked once: ``check_mount_root`` returns a ``MountPoint``, and what
mounts on one or clears it (``fs.serve``, ``recover_mount``) takes only that."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import NewType

from sandbox.errors import MountError
from sandbox.fakehw.refusedpaths import host_path_problem
from sandbox.supervisor import unmount_fuse

log = logging.getLogger(__name__)

MountPoint = NewType("MountPoint", Path)  # absolute, resolved, and checked


def check_mount_root(root: str | os.PathLike[str]) -> MountPoint:
    """The absolute mount point for ``root``; refuses what ``refusedpaths`` refuses (/, the
    host's top-level directories, anything under the real /sys, /dev, /proc, /etc...)."""
    path = Path(os.path.realpath(os.path.abspath(root)))
    problem = host_path_problem(path)
    if problem is not None:
        raise MountError(f"{path}: refusing to mount there: {problem}")
    return MountPoint(path)


def mounted_fstype(root: str | os.PathLike[str]) -> str | None:
    """The filesystem type mounted exactly at ``root`` (per /proc/self/mountinfo), or None."""
    target = os.path.abspath(root)
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            point = fields[4].encode().decode("unicode_escape")
            if point == target:
                found = fields[sep + 1]  # the last (topmost) mount wins
    return found


def recover_mount(path: MountPoint) -> bool:
    """Unmount ``root`` if it is a dead FUSE mount (its server was killed). Returns True
    if it cleared one, False if there was nothing to do. A live mount is left alone.
    Raises MountError (from CommandError) if it cannot.

    ``stat`` alone is not enough: the kernel answers it from its attribute cache (a day
    long here) once the root has been read, so a dead mount still stats fine. ``statvfs``
    is never cached: it reaches the connection and fails with ENOTCONN when nobody serves
    it."""
    try:
        os.stat(path)
        if not (mounted_fstype(path) or "").startswith("fuse"):
            return False
        os.statvfs(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        if exc.errno != errno.ENOTCONN:
            raise MountError(f"{path}: cannot stat mount point: {exc.strerror}") from exc
    else:
        return False
    log.warning("%s: dead FUSE mount (transport endpoint is not connected); unmounting", path)
    unmount_fuse(path)
    return True

"""The one deterministic tar writer of image layers, and the file helpers the archive
writers share.

``layer_tar`` writes regular files (bytes, or a file here), symlinks and directories as
an uncompressed layer: every parent directory before what it holds, entries in name
order, mtime 0, owned by root (uid/gid 0, no names), PAX format; the same input gives the
same bytes, hence the same digest, so a cached layer or image is reused only while it is
current. Standard library only.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path


def layer_tar(files: Mapping[str, bytes | Path], executables: Collection[str] | None = None,
              symlinks: Mapping[str, str] | None = None, dirs: Iterable[str] = ()) -> bytes:
    """A layer of ``files`` (path in the image -> bytes, or a file here: one that is a
    symlink stays one), ``symlinks`` (path -> target) and ``dirs``. Files are mode 0755
    when in ``executables`` (None: a file here keeps its own x bit), else 0644; ``/tmp``
    is 1777, other directories 0755."""
    entries: dict[str, bytes | Path | str | None] = {d.strip("/"): None for d in dirs}
    entries.update((name.strip("/"), content) for name, content in files.items())
    entries.update((name.strip("/"), target) for name, target in (symlinks or {}).items())
    executable = {e.strip("/") for e in executables} if executables is not None else None
    buf = io.BytesIO()
    made: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add_dir(name: str) -> None:
            if name and name not in made:
                made.add(name)
                info = tarfile.TarInfo(name)
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755
                tar.addfile(info)

        for name in sorted(entries):
            parts = name.split("/")
            for i in range(1, len(parts)):
                add_dir("/".join(parts[:i]))
            content = entries[name]
            if content is None:
                add_dir(name)
                continue
            info = tarfile.TarInfo(name)
            if isinstance(content, str) or (isinstance(content, Path) and content.is_symlink()):
                target = content if isinstance(content, str) else os.readlink(content)
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
                tar.addfile(info)
                continue
            if executable is None:
                x = isinstance(content, Path) and os.access(content, os.X_OK)
            else:
                x = name in executable
            info.mode = 0o755 if x else 0o644
            data = content.read_bytes() if isinstance(content, Path) else content
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def tar_add(tar: tarfile.TarFile, name: str, data: bytes | Path) -> None:
    """One regular file in ``tar``, streamed from ``data`` (bytes, or a file here)."""
    info = tarfile.TarInfo(name)
    if isinstance(data, bytes):
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        info.size = data.stat().st_size
        with data.open("rb") as f:
            tar.addfile(info, f)


def digest(data: bytes | Path) -> str:
    """``sha256:<hex>`` of bytes, or of a file here (read in chunks)."""
    if isinstance(data, bytes):
        return "sha256:" + hashlib.sha256(data).hexdigest()
    h = hashlib.sha256()
    with data.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def size(data: bytes | Path) -> int:
    return len(data) if isinstance(data, bytes) else data.stat().st_size

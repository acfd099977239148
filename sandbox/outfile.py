"""The one writer of files a user names for output (``capture -o``, ``status --file``,
``dra claims --file``, ``mount --pid-file``).

``write_file(path, data, force)`` writes ``data`` to a new temporary file beside ``path``
(``O_EXCL``, mode 0666 less the umask), fsyncs it and renames it to ``path``: a reader
sees the old file or the whole new one, never part of one, and a failure (ENOSPC, EIO,
EDQUOT) removes the temporary file and leaves ``path`` as it was. Refused, each as one
``OutputError`` line naming the path, before anything is written:

* ``''``, a name ending in ``/``, a parent directory that does not exist or is not one;
* a target that is a symbolic link, even with ``force`` and even dangling: a link is
  never written through (rename would replace the link itself, which is not what was
  named either);
* a target that is a directory, FIFO, device or socket: only regular files are replaced
  (opening a FIFO for writing blocks until someone reads it);
* an existing regular file, unless ``force``. Without ``force`` the new file is linked
  into place (``link`` fails if the name appeared meanwhile), so nothing is ever
  replaced; with it, renamed over. A replaced file gets the writer's owner and the
  umask's mode, as a new file does.

Every step after the parent directory is opened works relative to it (``dir_fd``), so the
checks and the rename see the same directory. ``check_target(path, force)`` makes the same
checks without writing: a command calls it before slow work (reading a machine, starting a
server) so a bad name fails first; ``write_file`` checks again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from sandbox.errors import SandboxError

_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS}
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip


class OutputError(SandboxError):
    """A file a user named for output cannot be written there (the message names it)."""


def check_target(path: str | os.PathLike[str], force: bool = False) -> None:
    """Raise ``OutputError`` unless ``write_file(path, ..., force)`` may write there."""
    text, name, dfd = _open_parent(path)
    try:
        _check(text, _lstat(text, name, dfd), force)
    finally:
        os.close(dfd)


def write_file(path: str | os.PathLike[str], data: bytes | str, force: bool = False) -> None:
    """Write ``data`` (str as UTF-8) to ``path`` as a whole new regular file; see above."""
    body = data.encode() if isinstance(data, str) else data
    text, name, dfd = _open_parent(path)
    try:
        old = _lstat(text, name, dfd)
        _check(text, old, force)
        tmp, fd = _create_temp(text, name, dfd)
        try:
            try:
                _write_all(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)  # an NFS write error may only show here
            _install(text, tmp, name, dfd, force)
        except OSError as exc:
            kept = "; the existing file is unchanged" if old is not None else ""
            raise OutputError(f"cannot write {text}: {exc.strerror or exc}{kept}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):  # gone once renamed
                os.unlink(tmp, dir_fd=dfd)
        _sync_dir(dfd)
    finally:
        os.close(dfd)


def _open_parent(path: str | os.PathLike[str]) -> tuple[str, str, int]:
    """``path`` as text, its last component, and an ``O_PATH`` fd of its directory."""
    text = os.fspath(path)
    if not text:
        raise OutputError("empty output file name ('')")
    parent, name = os.path.split(text)
    if name in ("", ".", ".."):
        raise OutputError(f"{text}: names a directory, not a file")
    parent = parent or "."
    try:
        dfd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise OutputError(f"{text}: directory {parent} does not exist") from None
    except NotADirectoryError:
        raise OutputError(f"{text}: {parent} is not a directory") from None
    except OSError as exc:
        raise OutputError(f"cannot write {text}: {parent}: {exc.strerror}") from None
    return text, name, dfd


def _lstat(text: str, name: str, dfd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OutputError(f"cannot write {text}: {exc.strerror}") from None


def _check(text: str, st: os.stat_result | None, force: bool) -> None:
    if st is None:
        return
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        raise OutputError(f"{text}: is a symbolic link; not writing through it (name the "
                          "file it points to, or remove the link)")
    if stat.S_ISDIR(mode):
        raise OutputError(f"{text}: is a directory")
    for test, kind in _KINDS:
        if test(mode):
            raise OutputError(f"{text}: is {kind}, not a regular file")
    if not stat.S_ISREG(mode):
        raise OutputError(f"{text}: is not a regular file")
    if not force:
        raise OutputError(f"{text}: exists; pass --force to overwrite it")


def _create_temp(text: str, name: str, dfd: int) -> tuple[str, int]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = f".{name[:200]}.{secrets.token_hex(4)}.tmp"  # within NAME_MAX (255)
        try:
            return tmp, os.open(tmp, flags, 0o666, dir_fd=dfd)
        except FileExistsError:
            continue
        except OSError as exc:
            raise OutputError(f"cannot write {text}: {exc.strerror}") from None
    raise OutputError(f"cannot write {text}: no free temporary name beside it")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _install(text: str, tmp: str, name: str, dfd: int, force: bool) -> None:
    """Put the written ``tmp`` at ``name``: linked (never replacing) without ``force``,
    else renamed over a regular file checked again just before."""
    if not force:
        try:
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            return  # the caller removes tmp
        except FileExistsError:
            _check(text, _lstat(text, name, dfd), force)
            raise OutputError(f"{text}: exists; pass --force to overwrite it") from None
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
    _check(text, _lstat(text, name, dfd), force)
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)


def _sync_dir(dfd: int) -> None:
    """fsync the directory so the new name survives a crash (best effort: the file is in
    place already, and some filesystems cannot)."""
    with contextlib.suppress(OSError):
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

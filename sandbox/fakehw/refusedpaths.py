"""Which host paths the sandbox may never write a tree to or mount one on.

One rule for ``render --out`` and ``mount ROOT``: never ``/`` or a top-level directory of
the host (``/etc``, ``/var``, ``/home``, ``/tmp``, ...) itself, never anything below the
host's own system trees (``/sys``, ``/proc``, ``/dev`` except ``/dev/shm``, ``/etc``,
``/boot``, ``/usr``, ``/bin``, ``/sbin``, ``/lib*``), never the invoking user's home
directory itself. Paths are judged after symlinks are resolved.
"""

from __future__ import annotations

import os

_SYSTEM_TREES = ("/sys", "/proc", "/dev", "/etc", "/boot", "/usr", "/bin", "/sbin", "/lib",
                 "/lib32", "/lib64", "/libx32")
_SCRATCH = ("/dev/shm",)


def host_path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` (resolved) must not receive a fake tree, or None when it may."""
    real = os.path.realpath(os.path.abspath(path))
    if real == "/":
        return "it is the host's root"
    for top in _SYSTEM_TREES:
        if real == top or real.startswith(top + "/"):
            if any(real == ok or real.startswith(ok + "/") for ok in _SCRATCH):
                return None
            return f"it is (below) the host's {top}"
    parent = os.path.dirname(real)
    if parent == "/" and os.path.lexists(real):
        return f"it is the host's top-level directory {real}"
    home = os.path.realpath(os.path.expanduser("~"))
    if home != "/" and real == home:
        return "it is the home directory itself"
    return None


"""The kernel's caches of the mount: dropping what a change made stale, filling them.

``notify_kernel`` invalidates entries and inodes (and stores new bytes); ``warm`` fills
the caches of a fresh fast-mode mount, so first reads cost no round trip.

A cold read through FUSE is a LOOKUP and a READ, each a round trip to this Python server
(~70-90 us each on a 2-core machine; a tmpfs read of the same file takes ~5 us). Right
after mounting, the server therefore warms the mount itself, in the background:

1. it lists directories (in a helper process, through the mount): the kernel asks with
   READDIRPLUS and keeps every listed entry with its attributes, as a lookup would have.
   Every PCI function's directory comes first (where device plugins read), then the
   rest breadth-first;
2. it pushes every listed file's bytes into the page cache (``notify_store``), in chunks.

Both stop at a memory bound: ``HWSANDBOX_FUSE_WARM_MIB`` (default 64; 0 turns warming
off), counted as one page (4 KiB) per stored file plus an estimated 1 KiB of kernel
memory (dentry and inode) per listed entry. The demo node (8 GPUs, 13,577 entries,
10,680 files) needs ~55 MiB. Everything warmed is ordinary reclaimable cache: under
memory pressure the kernel drops it and reads become round trips again.

Warming gives way to readers: before each step (16 directories, 64 files) it waits
until no lookup or read has come for 5 ms, so a reader already paying round trips (a
device plugin's first scan of a 1,000-GPU node) is not slowed by it.

Correctness: a chunk is computed from one snapshot and stored while holding ``lock``;
the filesystem's invalidation after a change takes the same lock, so it always runs
after a store of older bytes and drops them. Readers that get ahead of the warming just
pay the round trip they would have paid anyway.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import pyfuse3
import trio

from sandbox.fakehw.tree import Dir, File, Symlink

log = logging.getLogger(__name__)

PAGE = 4096
ENTRY_COST = 1024  # estimated kernel memory per cached entry (dentry + fuse inode)
DEFAULT_MIB = 64
CHUNK = 64  # files stored per worker-thread call (the longest a change waits for the lock)
DIR_BATCH = 16  # directories per batch sent to the lister process
QUIET = 0.005  # seconds without a reader's request before warming goes on
_INVALIDATE_IGNORED = (errno.ENOENT, errno.ENOTDIR)


def budget_bytes() -> int:
    """The memory bound from ``HWSANDBOX_FUSE_WARM_MIB`` (0 or less: no warming)."""
    raw = os.environ.get("HWSANDBOX_FUSE_WARM_MIB", "")
    try:
        mib = float(raw) if raw.strip() else DEFAULT_MIB
    except ValueError:
        log.warning("HWSANDBOX_FUSE_WARM_MIB=%r is not a number; using %d", raw, DEFAULT_MIB)
        mib = DEFAULT_MIB
    return max(0, int(mib * 1024 * 1024))


@dataclass
class Warmed:
    entries: int = 0  # entries listed (now in the kernel's dcache)
    files: int = 0  # files whose bytes were stored
    bytes: int = 0  # estimated memory used, against the bound
    seconds: float = 0.0
    done: bool = False

    def describe(self) -> dict[str, object]:
        return {"entries": self.entries, "files": self.files,
                "kib": -(-self.bytes // 1024), "seconds": round(self.seconds, 3),
                "done": self.done}  # fmt: skip


PCI_DEVICES = "sys/bus/pci/devices"  # where every PCI-reading plugin starts


def plan(root: Dir, budget: int) -> tuple[list[str], list[str], int]:
    """Directories to list and the files among their children to store, within ``budget``
    bytes; and the bytes that takes. First every PCI function's directory (the targets of
    ``sys/bus/pci/devices/*``, each after its parents), then the rest breadth-first."""
    dirs: list[str] = []
    files: list[str] = []
    planned: set[str] = set()
    used = 0

    def add(path: str, d: Dir | None = None) -> bool:
        """Plans ``path`` (the directory ``d``, looked up if not given) and its parents;
        False once the budget is spent."""
        nonlocal used
        if path in planned:
            return True
        if path and not add(posixpath.dirname(path)):
            return False
        d = d or _lookup(root, path)
        if d is None:
            return True
        cost = sum(ENTRY_COST + (-(-len(c.data) // PAGE) * PAGE
                                 if isinstance(c, File) else 0)
                   for c in d.children.values())  # fmt: skip
        if used + cost > budget:
            return False
        used += cost
        planned.add(path)
        dirs.append(path)
        prefix = f"{path}/" if path else ""
        files.extend(prefix + n for n, c in d.children.items() if isinstance(c, File) and c.data)
        return True

    bus = _lookup(root, PCI_DEVICES)
    links = [c.target for c in bus.children.values() if isinstance(c, Symlink)] if bus else []
    first = [PCI_DEVICES, *(posixpath.normpath(posixpath.join(PCI_DEVICES, t)) for t in links)]
    if not all(map(add, first)):
        return dirs, files, used
    queue: list[tuple[str, Dir]] = [("", root)]
    for path, d in queue:  # grows while iterated: breadth-first
        if not add(path, d):
            break
        prefix = f"{path}/" if path else ""
        queue.extend((prefix + n, c) for n, c in d.children.items() if isinstance(c, Dir))
    return dirs, files, used


def _lookup(root: Dir, path: str) -> Dir | None:
    d: Dir | None = root
    for name in path.split("/") if path else ():
        child = d.children.get(name) if d is not None else None
        d = child if isinstance(child, Dir) else None
    return d


# The lister: a process of its own, never a thread of the server. A FUSE server that reads
# its own mount cannot be killed cleanly: a thread waiting for the server's answer keeps
# the process (and its /dev/fuse descriptor) alive forever once the server is gone. It is
# started before the mount (``start_lister``): a child forked later holds a copy of the
# /dev/fuse descriptor until it execs, and a server killed in that window left its dead
# mount answering ECONNABORTED instead of ENOTCONN for a moment (seen under load). On its
# first batch, when the mount exists, it moves to a private mount namespace of its own,
# so the directories it holds open pin its copy of the mount and never make
# `fusermount3 -u` of the server's mount fail busy. Reads batches (JSON lists of paths
# below argv[1]), one per line; answers each with the number of entries it listed.
_LISTER = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
private = False
for line in sys.stdin:
    if not private:
        if libc.unshare(0x00020000) or libc.mount(b"none", b"/", None, 0x4000 | 0x40000,
                                                  None):
            sys.exit("warming: cannot make a private mount namespace: "
                     + os.strerror(ctypes.get_errno()))
        private = True
    seen = 0
    for rel in json.loads(line):
        try:
            with os.scandir(os.path.join(sys.argv[1], rel)) as it:
                seen += sum(1 for _ in it)
        except OSError:
            pass  # gone meanwhile (a fault), or unmounted
    try:
        print(seen, flush=True)
    except BrokenPipeError:  # the server is gone (killed or unmounted): nothing to tell
        sys.exit(0)
"""


async def start_lister(mountpoint: str) -> trio.Process:
    """The lister process for ``mountpoint``; start it before mounting (see above)."""
    return await trio.lowlevel.open_process(
        [sys.executable, "-c", _LISTER, mountpoint], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE)  # fmt: skip


async def _list(proc: trio.Process, dirs: Sequence[str],
                quiet: Callable[[], Awaitable[None]]) -> int:  # fmt: skip
    """Lists ``dirs`` through the mount in the lister process, a batch after each
    ``quiet()``; returns the entries listed. Ends the lister."""
    assert proc.stdin is not None
    assert proc.stdout is not None
    lister = _Lister(proc.stdin, proc.stdout)
    try:
        seen = 0
        for i in range(0, len(dirs), DIR_BATCH):
            await quiet()
            seen += await lister.list(dirs[i : i + DIR_BATCH])
        await proc.stdin.aclose()
        await proc.wait()  # it exits at once on the end of its input
        return seen
    finally:
        # Not waited for if the server is stopping: it may be waiting for an answer only
        # this server could give; the end of the FUSE connection lets it go.
        proc.kill()
        await trio.aclose_forcefully(proc.stdin)
        await trio.aclose_forcefully(proc.stdout)


class _Lister:
    """The lister's pipes: ``await lister.list(dirs)`` returns the entries it listed."""

    def __init__(self, stdin: trio.abc.SendStream, stdout: trio.abc.ReceiveStream) -> None:
        self.stdin = stdin
        self.stdout = stdout
        self._buf = b""

    async def list(self, dirs: Sequence[str]) -> int:
        await self.stdin.send_all(json.dumps(list(dirs)).encode() + b"\n")
        while b"\n" not in self._buf:
            chunk = await self.stdout.receive_some()
            if not chunk:
                raise OSError("the lister exited")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return int(line)


async def warm(
    snapshot_root: Callable[[], Dir],
    stored_inode: Callable[[str], tuple[int, bytes] | None],
    store: Callable[[Sequence[tuple[int, bytes]]], int],
    lock: trio.Lock,
    budget: int,
    status: Warmed,
    lister: trio.Process,
    activity: Callable[[], int] = lambda: 0,
) -> None:
    """Warm the mount: see the module's docstring. ``stored_inode(path)`` gives the inode
    the kernel knows for a file of the current snapshot and its bytes (None if none);
    ``store`` pushes a chunk (in a worker thread) and returns how many it stored;
    ``lister`` is ``start_lister``'s, which this ends.
    ``activity()`` counts readers' requests: each step waits while readers are being
    served (until QUIET seconds pass without one), so warming never slows a reader
    that is already paying round trips (a device plugin's first scan)."""
    t0 = time.perf_counter()
    dirs, files, used = plan(snapshot_root(), budget)
    if not dirs:  # not even the first directory fits
        lister.kill()
        status.done = True
        return
    seen = activity()

    async def quiet() -> None:
        nonlocal seen
        while activity() != seen:
            seen = activity()
            await trio.sleep(QUIET)

    try:
        status.entries = await _list(lister, dirs, quiet)
    except OSError as exc:  # only an optimisation: say so and serve on
        log.warning("warming the mount's caches stopped: %s", exc)
        status.done = True
        return
    status.bytes = used
    for i in range(0, len(files), CHUNK):
        await quiet()
        async with lock:
            chunk = [x for x in map(stored_inode, files[i : i + CHUNK]) if x is not None]
            if chunk:
                status.files += await trio.to_thread.run_sync(store, chunk)
    status.seconds = time.perf_counter() - t0
    status.done = True
    log.info("warmed %d entries and %d files (%.1f MiB of %.1f) in %.2f s",
             status.entries, status.files, used / 2**20, budget / 2**20, status.seconds)


def store(inode: int, data: bytes) -> bool:
    try:
        pyfuse3.notify_store(inode, 0, data)
    except OSError:
        return False  # only an optimisation: read() serves whatever is missing
    return True


def store_all(items: Sequence[tuple[int, bytes]]) -> int:
    return sum(store(ino, data) for ino, data in items)


def notify_kernel(
    ops: Sequence[tuple[int, bytes | None]], fresh: Sequence[tuple[int, bytes]] = ()
) -> None:
    for ino, name in ops:
        try:
            if name is None:
                pyfuse3.invalidate_inode(ino)
            else:
                pyfuse3.invalidate_entry(ino, name)
        except OSError as exc:
            if exc.errno not in _INVALIDATE_IGNORED:
                log.warning("invalidating inode %d %r: %s", ino, name, exc)
    store_all(fresh)

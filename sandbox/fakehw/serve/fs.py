"""The live FUSE filesystem: serves a ``LiveTree`` read-only and keeps kernel caches honest.

Only this module and ``kcache`` import pyfuse3. Reads are cached by the kernel with long
entry/attr timeouts and ``keep_cache`` (tmpfs-fast); correctness comes from invalidation:
after every committed change the ``Diff`` becomes ``invalidate_entry`` /
``invalidate_inode`` calls (``kcache.notify_kernel``), run in a worker thread (they block
while a related request is in flight, and requests are served by this process's trio
thread); the control reply is only sent once they are done. In fast mode a fresh mount's
caches are filled in the background (``kcache.warm``) and a change's new bytes are put
back in the page cache.

With pyfuse3 built with our patch (scripts/build-pyfuse3; ``FAST_MODE_AVAILABLE``) the
server runs in the kernel's no-open mode (see ``_Operations``): a cached read costs no
request at all, failed lookups and symlink targets are cached too. Without the patch,
or with ``HWSANDBOX_FUSE_FAST=0``, every open is a round trip (OPEN stores the page).

Inode numbers are allocated per (path, kind, size) and never reused for the life of the
mount, so a device that is unplugged and plugged back gets the same inode numbers, a path
whose kind changes gets a new one (the kernel marks an inode bad if its type changes), and
so does a file or symlink whose length changes: an inode's size never changes, so the size
the kernel holds for it always matches the bytes it reads, whatever the order in which
attribute replies and invalidations reach it (a read never returns ``dow`` for ``down``,
and a reader never gets the tail of a longer new value at what was its EOF). An inode whose
path now holds a value of another length keeps serving the last value it had (what a
reader that opened it before the change reads on).

``serve()`` mounts, runs the control server and returns after ``fusermount3 -u ROOT`` or
SIGTERM/SIGINT (a dead mount left by a killed server is cleared first: ``mountroot``).
The node server (``sandbox.agent``) serves a profile's node with it; tests/support/fakehw_serve.py
serves the tests' hand-made trees.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import stat
import threading
from collections.abc import Mapping
from typing import Any

import pyfuse3
import trio

from sandbox.errors import MountError
from sandbox.fakehw.control import ControlPaths, control_paths
from sandbox.fakehw.serve import kcache
from sandbox.fakehw.serve.controlserver import ControlServer
from sandbox.fakehw.serve.live import LiveTree, Rebuild
from sandbox.fakehw.serve.mountroot import MountPoint, mounted_fstype, recover_mount
from sandbox.fakehw.serve.treediff import Diff, Kind, kind_of, size_of
from sandbox.fakehw.states import load_states
from sandbox.fakehw.tree import BlockDevice, DeviceState, Dir, Entry, File, Symlink

log = logging.getLogger(__name__)

FSNAME = "hwsandbox"
DEFAULT_DEV_MAP = (1, 3)  # /dev/null: openable and harmless
CACHE_TIMEOUT = 86400.0  # seconds; invalidation, not expiry, keeps caches correct
# pyfuse3 built with scripts/pyfuse3-hwsandbox.patch passes the inode to read/readdir when
# the kernel runs without OPEN/OPENDIR (fh 0), and can request FUSE_CAP_CACHE_SYMLINKS.
FAST_MODE_AVAILABLE = getattr(pyfuse3, "HWSANDBOX_PATCH", 0) >= 1
_LISTED = 20_000  # directory entries kept in listings for readdir continuations (fast mode)
_OFF_BITS = 32  # a fast-mode readdir offset is (listing number << 32) | position


class _Operations(pyfuse3.Operations):  # type: ignore[misc]
    """Request handlers. They only raise pyfuse3.FUSEError and take what they serve from
    one snapshot of the tree; only ``open`` awaits (its page-cache store, after taking
    the entry, re-invalidated if the tree changed meanwhile).

    In fast mode (``fast=True``, needs the patched pyfuse3) OPEN and OPENDIR answer ENOSYS:
    the kernel then stops sending them (and RELEASE) for the life of the mount, keeps page
    cache and directory listings, and read/readdir get the inode instead of a handle.
    Failed lookups are cached as negative entries and symlink targets are cached too;
    ``plan`` invalidates all three when the tree changes."""

    enable_writeback_cache = False
    enable_cache_symlinks = True  # read by the patched pyfuse3's init; ignored otherwise

    def __init__(
        self, live: LiveTree, dev_map: tuple[int, int] | None, *, fast: bool = False
    ) -> None:
        super().__init__()
        self.live = live
        self.fast = fast
        # fast mode: listing number -> the listing a readdir started (offsets stay valid
        # across changes, as with a listing taken at opendir); oldest dropped first.
        self._listings: dict[int, list[tuple[bytes, str, Entry]]] = {}
        self._listed = 0  # entries in self._listings
        self._next_listing = 1
        self._rdev_map = os.makedev(*dev_map) if dev_map is not None else None
        self._ino: dict[tuple[str, Kind, int], int] = {("", "dir", 0): pyfuse3.ROOT_INODE}
        self._path: dict[int, tuple[str, Kind, int]] = {pyfuse3.ROOT_INODE: ("", "dir", 0)}
        # (path, kind) -> every inode handed out for it, one per size
        self._sized: dict[tuple[str, Kind], list[int]] = {("", "dir"): [pyfuse3.ROOT_INODE]}
        # file/symlink inode -> the last entry it served (an inode whose path now holds a
        # value of another length goes on serving this one)
        self._last: dict[int, Entry] = {}
        self._dirs: dict[int, list[tuple[bytes, str, Entry]]] = {}
        self._next_fh = 1
        self._stored: set[int] = set()  # inodes whose current bytes we put in the page cache
        self.invalidations = 0
        self.store_lock = trio.Lock()  # page-cache stores of fast mode vs invalidation
        self.requests = 0

    # -- helpers ------------------------------------------------------------------------
    def _inode(self, path: str, entry: Entry) -> int:
        kind = kind_of(entry)
        key = (path, kind, size_of(entry))
        ino = self._ino.get(key)
        if ino is None:
            ino = len(self._path) + pyfuse3.ROOT_INODE
            self._ino[key] = ino
            self._path[ino] = key
            self._sized.setdefault((path, kind), []).append(ino)
        if isinstance(entry, (File, Symlink)):
            self._last[ino] = entry
        return ino

    def _entry(self, inode: int) -> tuple[str, Entry]:
        key = self._path.get(inode)
        if key is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        path, kind, size = key
        entry = self.live.snapshot.index.get(path)
        if entry is None or kind_of(entry) != kind:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if size_of(entry) != size:  # the path's value has another length now: this inode's
            entry = self._last.get(inode, entry)
        return path, entry

    def _attrs(self, path: str, entry: Entry) -> Any:
        a = pyfuse3.EntryAttributes()
        a.st_ino = self._inode(path, entry)
        a.generation = 0
        a.entry_timeout = CACHE_TIMEOUT
        a.attr_timeout = CACHE_TIMEOUT
        a.st_uid = 0
        a.st_gid = 0
        a.st_blksize = 4096
        a.st_rdev = 0
        size = size_of(entry)
        if isinstance(entry, Dir):
            a.st_mode = stat.S_IFDIR | entry.mode
            subdirs = sum(1 for c in entry.children.values() if isinstance(c, Dir))
            a.st_nlink = 2 + subdirs
        elif isinstance(entry, File):
            a.st_mode = stat.S_IFREG | entry.mode
            a.st_nlink = 1
        elif isinstance(entry, Symlink):
            a.st_mode = stat.S_IFLNK | 0o777
            a.st_nlink = 1
        elif self._rdev_map is not None:
            # Every node as the stand-in, so a container never reaches a real driver: a
            # block node too is shown as a CHARACTER device with the stand-in's number (a
            # block 1:3 would be /dev/ram3, a real disk).
            a.st_mode = stat.S_IFCHR | entry.mode
            a.st_nlink = 1
            a.st_rdev = self._rdev_map
        else:
            a.st_mode = (stat.S_IFBLK if isinstance(entry, BlockDevice)
                         else stat.S_IFCHR) | entry.mode
            a.st_nlink = 1
            a.st_rdev = os.makedev(entry.major, entry.minor)
        a.st_size = size
        a.st_blocks = (size + 511) // 512
        t = self.live.changed_ns(path)
        a.st_atime_ns = t
        a.st_mtime_ns = t
        a.st_ctime_ns = t
        return a

    def current_file(self, path: str) -> tuple[int, bytes] | None:
        """The inode handed out for ``path``'s current bytes, and the bytes (a file)."""
        entry = self.live.snapshot.index.get(path)
        if not isinstance(entry, File) or not entry.data:
            return None
        ino = self._ino.get((path, "file", len(entry.data)))
        return None if ino is None else (ino, entry.data)

    # -- handlers -----------------------------------------------------------------------
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        self.requests += 1  # readers' lookups and reads: warming waits while they come
        parent, entry = self._entry(parent_inode)
        if not isinstance(entry, Dir):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        n = os.fsdecode(name)
        if n == ".":
            path = parent
            child: Entry | None = entry
        elif n == "..":
            path = parent.rpartition("/")[0]
            child = self.live.snapshot.index.get(path)
        else:
            path = f"{parent}/{n}" if parent else n
            child = entry.children.get(n)
        if child is None:
            if self.fast:  # a negative entry: the kernel caches the miss until invalidated
                miss = pyfuse3.EntryAttributes()
                miss.st_ino = 0
                miss.entry_timeout = CACHE_TIMEOUT
                return miss
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(path, child)

    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        return self._attrs(*self._entry(inode))

    async def readlink(self, inode: int, ctx: Any = None) -> bytes:
        _, entry = self._entry(inode)
        if not isinstance(entry, Symlink):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(entry.target)

    def _listing(self, inode: int) -> list[tuple[bytes, str, Entry]]:
        path, entry = self._entry(inode)
        if not isinstance(entry, Dir):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        prefix = f"{path}/" if path else ""
        return [
            (os.fsencode(name), prefix + name, entry.children[name])
            for name in sorted(entry.children)
        ]

    async def opendir(self, inode: int, ctx: Any = None) -> int:
        if self.fast:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # no-opendir mode from now on
        # A listing is a snapshot taken at opendir: offsets stay valid whatever changes.
        listing = self._listing(inode)
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = listing
        return fh

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        if self.fast:
            return self._readdir_fast(fh, start_id, token)
        listing = self._dirs.get(fh)
        if listing is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        for i in range(start_id, len(listing)):
            name, path, entry = listing[i]
            if not pyfuse3.readdir_reply(token, name, self._attrs(path, entry), i + 1):
                return
        return None

    def _readdir_fast(self, inode: int, off: int, token: Any) -> None:
        """``readdir`` without opendir: ``inode`` is the directory. Offset 0 takes a listing
        of the current tree and numbers it; later offsets name that listing and a position
        in it, so one pass over a directory sees one state even if the tree changes."""
        number, start = off >> _OFF_BITS, off & ((1 << _OFF_BITS) - 1)
        listing = self._listings.get(number) if number else None
        if listing is None:
            listing = self._listing(inode)
            number = self._next_listing
            self._next_listing += 1
            self._listings[number] = listing
            self._listed += len(listing)
            while self._listed > _LISTED and len(self._listings) > 1:  # oldest first
                self._listed -= len(self._listings.pop(next(iter(self._listings))))
            if off:  # the listing it continued was dropped: go on in today's listing
                start = min(start, len(listing))
        base = number << _OFF_BITS
        for i in range(start, len(listing)):
            name, path, entry = listing[i]
            if not pyfuse3.readdir_reply(token, name, self._attrs(path, entry), base + i + 1):
                return
        # Kept after the last entry too: the kernel asks once more, past the end, and must
        # get nothing from the same listing.

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    async def open(self, inode: int, flags: int, ctx: Any = None) -> Any:
        if self.fast:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # no-open mode: read() gets the inode
        _, entry = self._entry(inode)
        if isinstance(entry, Dir):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if not isinstance(entry, File):
            raise pyfuse3.FUSEError(errno.ENXIO)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode not in self._stored and entry.data:
            # Fill the page cache (and i_size) before the reply: the read that follows
            # costs no round trip and never sees a stale size. The store runs in a worker
            # thread: it can wait on a page another reader has locked while that reader's
            # READ waits for this loop, so doing it here deadlocked (seen in CI). If the
            # tree changed meanwhile, the store may hold old bytes: drop them again.
            version = self.live.snapshot.version
            stored = await trio.to_thread.run_sync(kcache.store, inode, entry.data)
            if self.live.snapshot.version != version:
                await trio.to_thread.run_sync(kcache.notify_kernel, [(inode, None)])
            elif stored:
                self._stored.add(inode)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.requests += 1
        try:
            _, entry = self._entry(fh)  # fh is the inode (open() returns it, or fast mode)
        except pyfuse3.FUSEError:
            entry = None
        if not isinstance(entry, File):
            raise pyfuse3.FUSEError(errno.ENODEV)  # what sysfs says once a device is gone
        return entry.data[off : off + size]

    async def release(self, fh: int) -> None:
        return None

    async def statfs(self, ctx: Any = None) -> Any:
        s = pyfuse3.StatvfsData()
        s.f_bsize = 4096
        s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 0
        s.f_files = len(self.live.snapshot.index)
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # -- invalidation -------------------------------------------------------------------
    def plan(self, diff: Diff) -> list[tuple[int, bytes | None]]:
        """Kernel notifications for ``diff``: (parent, name) entries and (inode, None).

        Only inodes this mount ever handed out can be cached by the kernel, so paths that
        never got one are skipped. A path that appears may be cached as a negative entry
        (fast mode): its (parent, name) is dropped too, for the topmost new path only (a new
        directory's children were never looked up)."""
        ops: list[tuple[int, bytes | None]] = []

        def dentry(path: str) -> None:
            parent, _, name = path.rpartition("/")
            pino = self._ino.get((parent, "dir", 0))
            if pino is not None:
                ops.append((pino, os.fsencode(name)))

        new_dirs = {p for p, k in diff.added if k == "dir"}
        for path, _ in diff.added:
            if path.rpartition("/")[0] not in new_dirs:
                dentry(path)
        gone_dirs: set[str] = set()
        for path, kind in diff.removed:  # parents first
            inos = self._sized.get((path, kind))
            if not inos:
                continue
            if path.rpartition("/")[0] not in gone_dirs:
                dentry(path)  # drops the dentry and its subtree
            if kind == "dir":
                gone_dirs.add(path)
            ops.extend((ino, None) for ino in inos)
        current, previous = self.live.snapshot.index, self.live.previous.index
        for path, kind in (*diff.changed, *diff.added):
            entry = current.get(path)
            if entry is None or (path, kind) not in self._sized:
                continue
            ino = self._ino.get((path, kind, size_of(entry)))
            if ino is not None:  # it may hold pages of an earlier value of this length
                ops.append((ino, None))
            old = previous.get(path)
            if old is not None and kind_of(old) == kind and size_of(old) != size_of(entry):
                dentry(path)  # another length: the path names another inode now
        for path in diff.dirs:
            ino = self._ino.get((path, "dir", 0))
            if ino is not None:
                ops.append((ino, None))
        return ops

    async def invalidate(self, diff: Diff) -> None:
        """Tell the kernel what ``diff`` changed; returns when it has been told."""
        # Before any await: ``plan`` compares with the snapshot this change replaced.
        ops = self.plan(diff)
        self._stored.difference_update(ino for ino, name in ops if name is None)
        if not ops:
            return
        self.invalidations += len(ops)
        # Fast mode puts the new bytes of files that kept their inode back in the page
        # cache right after dropping the old ones: readers after a fault pay no round trip.
        keys = [self._path[ino] for ino, name in ops if name is None and self.fast]
        fresh = [x for p, k, _ in keys if k == "file" and (x := self.current_file(p))]
        async with self.store_lock:  # after any warming store of older bytes
            await trio.to_thread.run_sync(kcache.notify_kernel, ops, fresh)


# -- mounting ---------------------------------------------------------------------------
def _mount_options(fsname: str, allow_dev: bool) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts |= {f"fsname={fsname}", "allow_other", "default_permissions", "ro"}
    opts.add("dev" if allow_dev else "nodev")
    return opts


def _check_fuse_device(mountpoint: os.PathLike[str]) -> None:
    """MountError naming the fix where /dev/fuse cannot be opened (else libfuse prints its
    own line and we a second, "fuse_session_mount failed")."""
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        why = "is missing" if not os.path.exists("/dev/fuse") else "is not open to this user"
        raise MountError(f"{mountpoint}: cannot mount: /dev/fuse {why}; run as root (sudo), "
                         "or where FUSE is available (modprobe fuse; a container needs "
                         "--device /dev/fuse)")


async def serve(
    mountpoint: MountPoint,
    rebuild: Rebuild,
    *,
    initial_states: Mapping[str, DeviceState] | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    dev_map: tuple[int, int] | None = None,
    allow_dev: bool = False,
    fsname: str = FSNAME,
    node: str | None = None,
    task_status: trio.TaskStatus[ControlPaths] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mount the live tree at ``mountpoint`` (``check_mount_root``'s) and serve it and its
    control socket.

    ``rebuild(states)`` makes the tree for a states dict (the profile builder in real
    use). Saved states (``control_paths(mountpoint, state_dir).state``) override
    ``initial_states``. ``dev_map=(1, 3)`` reports every device node (block ones too) as a
    character device of that major:minor; ``allow_dev`` mounts with ``dev`` so such nodes
    can be opened (opening reaches the REAL driver of the reported major:minor). ``node``:
    the node's name, which the control API's ``get`` reports (clients check it). Calls
    ``task_status.started(paths)`` once mounted and listening; returns after the mount is
    unmounted from outside (``fusermount3 -u``) or on SIGTERM/SIGINT (unmounting itself).
    Must be run in the main thread of a trio program that serves nothing else.
    """
    _check_fuse_device(mountpoint)
    recover_mount(mountpoint)
    if mounted_fstype(mountpoint) is not None:
        raise MountError(f"{mountpoint}: already mounted; unmount it with `fusermount3 -u "
                         f"{mountpoint}` (a sandbox's: `sandbox down --name NAME`)")
    mountpoint.mkdir(parents=True, exist_ok=True)
    paths = control_paths(mountpoint, state_dir)
    paths.socket.parent.mkdir(parents=True, exist_ok=True)
    states = dict(initial_states or {})
    states.update(load_states(paths.state))
    live = LiveTree(rebuild, states)
    fast = FAST_MODE_AVAILABLE and os.environ.get("HWSANDBOX_FUSE_FAST", "1") != "0"
    if not FAST_MODE_AVAILABLE:
        log.warning(
            "pyfuse3 %s lacks hw-sandbox's patch: serving without the no-open fast mode "
            "(every open is a round trip); run scripts/build-pyfuse3 to build it",
            pyfuse3.__version__,
        )
    ops = _Operations(live, dev_map, fast=fast)
    budget = kcache.budget_bytes() if fast else 0
    warmed = kcache.Warmed(done=not budget)
    server = ControlServer(
        live,
        on_diff=ops.invalidate,
        state_file=paths.state,
        info={"mount": str(mountpoint), "pid": os.getpid(),
              **({"node": node} if node is not None else {})},
        status=lambda: {"warm": warmed.describe()},
    )
    # Before the mount: a child forked after it would hold a copy of /dev/fuse (kcache).
    lister = await kcache.start_lister(str(mountpoint)) if budget else None
    try:
        pyfuse3.init(ops, str(mountpoint), _mount_options(fsname, allow_dev))
    except RuntimeError as exc:
        if lister is not None:
            lister.kill()
        hint = "" if os.geteuid() == 0 else " (run as root, e.g. with sudo)"
        raise MountError(f"{mountpoint}: mount failed: {exc}{hint}") from exc
    stopped_by_us = False

    async def stop_on_signal(*, task_status: trio.TaskStatus[None]) -> None:
        nonlocal stopped_by_us
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                stopped_by_us = True
                pyfuse3.terminate()
                return

    clean = False
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, paths.socket, nursery)
            if threading.current_thread() is threading.main_thread():
                await nursery.start(stop_on_signal)
            task_status.started(paths)
            if lister is not None:  # the kernel's caches filled in the background
                nursery.start_soon(kcache.warm, lambda: live.snapshot.tree.root,
                                   ops.current_file, kcache.store_all, ops.store_lock,
                                   budget, warmed, lister, lambda: ops.requests)
            # Fast-mode handlers never await, so one worker task serves every request in
            # turn (cold reads ~30% faster than pyfuse3's pool of 99, which pays for its
            # read lock and wake-ups); today's mode awaits in open() and needs the pool.
            await pyfuse3.main(min_tasks=1, max_tasks=1 if fast else 99)
            nursery.cancel_scope.cancel()
        clean = True
    finally:
        # After `fusermount3 -u` the kernel side is already gone; otherwise unmount.
        pyfuse3.close(unmount=stopped_by_us or not clean)

"""Plumbing shared by the per-subsystem tree builders: the build context and kernel formats.

``Ctx`` wraps a ``Tree`` with a directory cache (a path is parsed once, however many
attributes go into it), relative-symlink computation from root-relative targets, and
device-node registration (``dev/`` node + ``sys/dev/char/M:m`` or ``sys/dev/block/M:m``
link + ``dev`` attribute in one call, so the three can never disagree). Small attribute
values are interned: thousands of ``0\\n`` files share one ``File`` object.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping

from sandbox.fakehw.tree import (
    BlockDevice,
    CharDevice,
    DeviceState,
    Dir,
    Entry,
    File,
    Health,
    Reason,
    Symlink,
    Tree,
    TreeError,
    check_entry,
)
from sandbox.profile.cpulist import format_cpulist
from sandbox.profile.spec import DeviceSpec, NodeSpec

RO, RW, WO = 0o444, 0o644, 0o200

MEMOS = 4  # per node: the old and new states of a change, and some slack
_memo_lock = threading.Lock()
_INTERN_MAX_LEN = 32
_INTERN_MAX_ENTRIES = 1 << 16
_interned: dict[bytes, File] = {}


def make_file(data: str | bytes | File, mode: int = RO) -> File:
    if isinstance(data, File):  # built once, shared by many entries (CPU masks)
        return data
    raw = data.encode() if isinstance(data, str) else data
    if mode != RO or len(raw) > _INTERN_MAX_LEN:
        return File(raw, mode)
    f = _interned.get(raw)
    if f is None:
        f = File(raw, mode)
        if len(_interned) < _INTERN_MAX_ENTRIES:
            _interned[raw] = f
    return f


def kernel_mask(cpus: tuple[int, ...] | list[int] | range, nbits: int) -> str:
    """The kernel's ``%*pb`` bitmap: ceil(nbits/4) hex digits, a comma every 8 from the right.

    (Two CPUs print ``3``; 64 print ``ffffffff,ffffffff``.)
    """
    mask = 0
    for c in cpus:
        mask |= 1 << c
    digits = f"{mask:0{max(1, (nbits + 3) // 4)}x}"
    groups: list[str] = []
    while len(digits) > 8:
        groups.append(digits[-8:])
        digits = digits[:-8]
    groups.append(digits)
    return ",".join(reversed(groups))


def relative(link_path: str, target: str) -> str:
    """The shortest relative link from ``link_path`` to ``target`` (both root-relative)."""
    lparts = link_path.split("/")[:-1]
    tparts = target.split("/")
    k = 0
    # Like the kernel (kernfs_get_target_path), stop below the target's parent so a link
    # to an ancestor still names it: ``device -> ../../../0000:01:00.0``, never ``../../``.
    n = min(len(lparts), len(tparts) - 1)
    while k < n and lparts[k] == tparts[k]:
        k += 1
    return "../" * (len(lparts) - k) + "/".join(tparts[k:])


def effective_state(dev: DeviceSpec, states: Mapping[str, DeviceState] | None) -> DeviceState:
    """The device's state from ``states``, else the one its profile entry declares."""
    if states is not None:
        st = states.get(dev.id)
        if st is not None:
            return st
    if dev.health == "unhealthy":
        reason = Reason(dev.health_reason) if dev.health_reason else Reason.AER_FATAL
        return DeviceState(Health.UNHEALTHY, reason)
    return DeviceState()


def present(state: DeviceState) -> bool:
    return state.plugged and not (
        state.health is Health.UNHEALTHY and state.reason is Reason.REMOVED
    )


def fault(state: DeviceState, reason: Reason) -> bool:
    return state.health is Health.UNHEALTHY and state.reason is reason


class Ctx:
    """One build: the tree being filled plus what the subsystems share about the node."""

    def __init__(
        self,
        node: NodeSpec,
        states: Mapping[str, DeviceState] | None,
        only: frozenset[str] | None = None,
        *,
        defaults: Mapping[str, DeviceState] | None = None,
    ) -> None:
        self.node = node
        self.given: Mapping[str, DeviceState] = states or {}
        # A partial build (``build.build_partial``) writes only what these devices' states
        # decide: their own entries, and whole every entry several devices' states decide
        # together. None: everything.
        self.only = only
        self.tree = Tree()
        self._dirs: dict[str, Dir] = {"": self.tree.root}
        self.ncpus = len(node.cpus)
        if defaults is not None:  # every device's effective_state(d, None), precomputed
            self.states = dict(defaults)
            self.states.update((k, v) for k, v in self.given.items() if k in defaults)
        else:
            self.states = {d.id: effective_state(d, states) for d in node.devices}
        self.kinds = {d.id: d.kind for d in node.devices}
        # NUMA node -> (local_cpus mask, local_cpulist); -1 (no node) means every CPU.
        self.locality: dict[int, tuple[str, str]] = {
            -1: (kernel_mask(range(self.ncpus), self.ncpus), format_cpulist(range(self.ncpus)))
        }
        for n in node.numa:
            self.locality[n.id] = (kernel_mask(n.cpus, self.ncpus), format_cpulist(n.cpus))
        # PCI address -> its sysfs directory (filled by the PCI builder for present functions)
        self.pci_dirs: dict[str, str] = {}
        # Values computed from this node and some states, shared by the node's builds
        # (build.py hands every Ctx of one node the same small LRU).
        self.memos: OrderedDict[Hashable, str] = OrderedDict()

    def memo(self, key: Hashable, compute: Callable[[], str]) -> str:
        """``compute()``, or what it returned for an equal ``key`` in a recent build."""
        with _memo_lock:  # builds of one node may run in several threads
            value = self.memos.get(key)
            if value is not None:
                self.memos.move_to_end(key)
                return value
        value = compute()
        with _memo_lock:
            self.memos[key] = value
            while len(self.memos) > MEMOS:
                self.memos.popitem(last=False)
        return value

    def emits(self, device: str | None) -> bool:
        """Whether this build writes the entries owned by ``device`` (None: the node's own,
        state-independent ones, which a partial build leaves out)."""
        return self.only is None or (device is not None and device in self.only)

    # -- low level ----------------------------------------------------------------
    def dir(self, path: str) -> Dir:
        d = self._dirs.get(path)
        if d is not None:
            return d
        parent, _, name = path.rpartition("/")
        pd = self.dir(parent)
        child = pd.children.get(name)
        if child is None:
            check_entry(path, name)
            d = Dir()
            pd.children[name] = d
        elif isinstance(child, Dir):
            d = child
        else:
            raise TreeError(f"{path}: not a directory")
        self._dirs[path] = d
        return d

    def put(self, dirpath: str, name: str, entry: Entry) -> None:
        children = self.dir(dirpath).children
        if name in children:
            raise TreeError(f"{dirpath}/{name}: already exists")
        check_entry(f"{dirpath}/{name}", name)
        children[name] = entry

    # -- attributes, links, devices ---------------------------------------------------
    def file(self, path: str, data: str | bytes, mode: int = RO) -> None:
        dirpath, _, name = path.rpartition("/")
        self.put(dirpath, name, make_file(data, mode))

    def files(self, dirpath: str, items: Mapping[str, str | bytes | File],
              mode: int = RO) -> None:
        children = self.dir(dirpath).children
        for name, data in items.items():
            if name in children:
                raise TreeError(f"{dirpath}/{name}: already exists")
            children[name] = make_file(data, mode)

    def link(self, path: str, target: str) -> None:
        """A symlink at ``path`` to the root-relative ``target``, written relative."""
        dirpath, _, name = path.rpartition("/")
        self.put(dirpath, name, Symlink(relative(path, target)))

    def chardev(
        self,
        name: str,
        major: int,
        minor: int,
        sysdir: str | None,
        uevent: str = "",
        mode: int = 0o666,
    ) -> str:
        """``dev/<name>``; with ``sysdir`` also its ``dev``/``uevent`` and sys/dev/char link."""
        return self._devnode(CharDevice(major, minor, mode), "char", name, sysdir, uevent)

    def blockdev(
        self,
        name: str,
        major: int,
        minor: int,
        sysdir: str,
        uevent: str = "",
        mode: int = 0o660,
    ) -> str:
        """The block node ``dev/<name>``, ``sysdir``'s ``dev``/``uevent`` and its
        sys/dev/block link (every block device has a sysfs directory)."""
        return self._devnode(BlockDevice(major, minor, mode), "block", name, sysdir, uevent)

    def _devnode(self, node: CharDevice | BlockDevice, kind: str, name: str,
                 sysdir: str | None, uevent: str) -> str:
        path = f"dev/{name}"
        dirpath, _, base = path.rpartition("/")
        self.put(dirpath, base, node)
        if sysdir is not None:
            major, minor = node.major, node.minor
            self.files(
                sysdir,
                {
                    "dev": f"{major}:{minor}\n",
                    "uevent": f"MAJOR={major}\nMINOR={minor}\nDEVNAME={name}\n{uevent}",
                },
            )
            self.link(f"sys/dev/{kind}/{major}:{minor}", sysdir)
        return path

    def exists(self, path: str) -> bool:
        return self.tree.get(path) is not None

    def graft(self, src: Dir, at: str = "") -> None:
        """Merge a prebuilt subtree in; its directories are copied, its leaves shared."""
        merge(self.dir(at), src)


def copy_dir(src: Dir) -> Dir:
    new = Dir(dict(src.children), src.mode)
    for name, e in src.children.items():
        if isinstance(e, Dir):
            new.children[name] = copy_dir(e)
    return new


def merge(dst: Dir, src: Dir) -> None:
    children = dst.children
    for name, e in src.children.items():
        have = children.get(name)
        if have is None:
            children[name] = copy_dir(e) if isinstance(e, Dir) else e
        elif isinstance(have, Dir) and isinstance(e, Dir):
            merge(have, e)
        else:
            raise TreeError(f"{name}: already exists")

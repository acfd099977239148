"""The live tree: current device states, the tree built from them, and what a change changes.

``LiveTree`` owns the mutable side of a served node: the states dict, the current
``Snapshot`` (a tree plus a path index over it) and per-path change times. A change goes
through ``prepare`` (pure: new states, new tree and its ``Diff``; safe to run in a worker
thread) and ``commit`` (one assignment swaps the snapshot, so a reader sees the old tree
or the new one, never a mix). The ``Diff`` (``treediff``) names exactly which paths
appeared, vanished or changed; the filesystem layer turns it into kernel cache
invalidations.

A change costs what the changed device owns, not what the node has: when the tree's
builder offers ``Tree.partial``, ``prepare`` builds just the changed device's part under
the old and the new states, diffs those two small trees and applies the difference to
the current tree by path copying (``treediff.patch_tree``). Trees from builders without
``partial`` are rebuilt whole and kept in a cache bounded by bytes. Nothing here imports
pyfuse3 or does any I/O (state files: ``fakehw.states``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from sandbox.errors import ControlError, SandboxError
from sandbox.fakehw.changes import Change, next_state
from sandbox.fakehw.serve.treediff import Diff, Mismatch, diff_trees, patch_tree
from sandbox.fakehw.tree import (
    DeviceRecord,
    DeviceState,
    Dir,
    Entry,
    File,
    Tree,
)
from sandbox.profile.catalogue import fault_reasons

log = logging.getLogger(__name__)

Rebuild = Callable[[Mapping[str, DeviceState]], Tree]
# Whole trees (builders without Tree.partial) memoised by states, up to this many bytes
# (estimated from entries and file contents, as tracemalloc measures a small tree).
CACHE_BYTES = 2 << 20
_ENTRY_BYTES = 350  # a Dir/File/Symlink object, its name and its dict slot, roughly
_StatesKey = tuple[tuple[str, DeviceState], ...]


def _key(states: Mapping[str, DeviceState]) -> _StatesKey:
    default = DeviceState()
    return tuple(sorted((k, v) for k, v in states.items() if v != default))


class PathIndex(Mapping[str, Entry]):
    """A tree's entries by path (the root is ``""``), read by walking the tree: nothing is
    copied per version. ``len`` is the entry count (root included): given, or counted once
    when first asked (``count`` None)."""

    __slots__ = ("_count", "_root")

    def __init__(self, root: Dir, count: int | None = None) -> None:
        self._root = root
        self._count = count

    @property
    def known_count(self) -> int | None:
        """The entry count if known without walking the tree."""
        return self._count

    def __getitem__(self, path: str) -> Entry:
        entry: Entry | None = self.get(path)
        if entry is None:
            raise KeyError(path)
        return entry

    def get(self, path: str, default: Any = None) -> Any:
        node: Entry = self._root
        if not path:
            return node
        for part in path.split("/"):
            if not isinstance(node, Dir):
                return default
            child = node.children.get(part)
            if child is None:
                return default
            node = child
        return node

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and self.get(path) is not None

    def __iter__(self) -> Iterator[str]:
        yield ""
        for path, _ in Tree(self._root).walk():
            yield path

    def __len__(self) -> int:
        if self._count is None:
            self._count = 1 + sum(1 for _ in Tree(self._root).walk())
        return self._count


@dataclass(frozen=True)
class Snapshot:
    """A tree, its path index and a version number."""

    tree: Tree
    index: PathIndex
    version: int
    nbytes: int = 0  # estimated size, for the cache of whole trees

    @classmethod
    def of(cls, tree: Tree, version: int) -> Snapshot:
        """A snapshot of ``tree``; a whole tree (no ``partial``) is measured for the cache,
        a partial-capable one is not walked at all (a 1,000-GPU tree: ~0.1 s saved)."""
        if tree.partial is not None:
            return cls(tree, PathIndex(tree.root), version)
        count = 1
        nbytes = _ENTRY_BYTES
        for _, entry in tree.walk():
            count += 1
            nbytes += _ENTRY_BYTES
            if isinstance(entry, File):
                nbytes += len(entry.data)
        return cls(tree, PathIndex(tree.root, count), version, nbytes)


@dataclass(frozen=True)
class Pending:
    """A prepared, not yet visible change: the result of ``LiveTree.prepare``."""

    change: Change
    states: Mapping[str, DeviceState]
    snapshot: Snapshot
    base_version: int
    diff: Diff


class LiveTree:
    """Current states and tree of one served node. Not thread-safe: ``commit`` and reads
    belong to one thread (the server's trio thread); ``prepare`` may run elsewhere."""

    def __init__(
        self,
        rebuild: Rebuild,
        states: Mapping[str, DeviceState] | None = None,
        *,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self._rebuild = rebuild
        self._clock = clock
        self._versions = itertools.count(1)
        # Whole trees (no Tree.partial) are memoised by states, bounded by bytes: a fault
        # that flips back and forth costs one build per distinct state.
        self._cache: OrderedDict[_StatesKey, Snapshot] = OrderedDict()
        self._cache_bytes = 0
        self.states: dict[str, DeviceState] = dict(states or {})
        self.snapshot = Snapshot.of(rebuild(self.states), 0)
        self.previous = self.snapshot
        self._remember(self.snapshot)
        self.started_ns = clock()
        self._changed_ns: dict[str, int] = {}
        # A builder may leave unplugged devices out of a tree's records (build_tree keeps
        # them): then learn every device once from a tree with all of them plugged in.
        everyone = self.snapshot.tree
        if any(not s.plugged and k not in everyone.devices for k, s in self.states.items()):
            everyone = rebuild({k: replace(s, plugged=True) for k, s in self.states.items()})
        self.records: dict[str, DeviceRecord] = dict(everyone.devices)
        self.records.update(self.snapshot.tree.devices)
        for unknown in set(self.states) - set(self.records):
            del self.states[unknown]

    # -- reading ----------------------------------------------------------------------
    def state(self, device: str) -> DeviceState:
        return self.states.get(device, DeviceState())

    def device_list(self) -> list[DeviceRecord]:
        """Every device the node has (plugged or not), with its current state."""
        return [replace(self.records[d], state=self.state(d)) for d in sorted(self.records)]

    def changed_ns(self, path: str) -> int:
        """When the entry at ``path`` appeared, or a directory's entries last changed (the
        mount time if never). A file keeps its time when its value changes, as a sysfs
        attribute does; the FUSE layer needs that too: the kernel drops a file's page cache
        when a fresh getattr shows another mtime, which would undo ``kcache``'s store of
        the new bytes."""
        return self._changed_ns.get(path, self.started_ns)

    @property
    def cache_bytes(self) -> int:
        """Estimated bytes of whole trees kept for reuse (0 with partial builds)."""
        return self._cache_bytes

    # -- changing ---------------------------------------------------------------------
    def prepare(self, change: Change) -> Pending | None:
        """Compute the states, tree and diff after ``change``; None if it changes nothing.

        Raises ControlError for an unknown device or a state the builder rejects.
        """
        if change.device not in self.records:
            known = ", ".join(sorted(self.records)) or "none"
            raise ControlError(f"unknown device {change.device!r} (have {known})")
        if change.op == "health" and change.reason is not None:
            record = self.records[change.device]
            shown = fault_reasons(record.kind, record.vendor)
            if change.reason.value not in shown:
                raise ControlError(f"health {change.device}: a {record.vendor} {record.kind} "
                                   f"cannot show {change.reason.value} (it shows "
                                   f"{', '.join(shown)})")
        before = self.state(change.device)
        after = next_state(before, change, self.records[change.device].mig)
        if after == before:
            return None
        states = dict(self.states)
        states[change.device] = after
        current = self.snapshot
        try:
            if current.tree.partial is not None:
                try:
                    return self._prepare_partial(change, states, current)
                except Mismatch as exc:
                    log.warning("partial rebuild of %s disagrees at %s; rebuilding whole",
                                change.device, exc)  # fmt: skip
            return self._prepare_whole(change, states, current)
        except ControlError:
            raise
        except (SandboxError, ValueError, KeyError) as exc:
            # The builder refuses this state (e.g. more VFs than sriov_totalvfs).
            raise ControlError(f"{change.op} {change.device}: {exc}") from exc

    def _prepare_partial(
        self, change: Change, states: dict[str, DeviceState], current: Snapshot
    ) -> Pending:
        tree = current.tree
        assert tree.partial is not None
        device = (change.device,)
        old = tree.partial(self.states, device)
        new = tree.partial(states, device)
        root, diff = patch_tree(tree.root, old.root, new.root)
        patched = Tree(root)
        patched.partial = tree.partial
        patched.devices = {**tree.devices, **new.devices}
        known = current.index.known_count
        count = None if known is None else known + len(diff.added) - len(diff.removed)
        snapshot = Snapshot(patched, PathIndex(root, count), next(self._versions))
        return Pending(change, states, snapshot, current.version, diff)

    def _prepare_whole(
        self, change: Change, states: dict[str, DeviceState], current: Snapshot
    ) -> Pending:
        snapshot = self._cache.get(_key(states))
        if snapshot is None:
            tree = self._rebuild(states)
            tree.partial = None  # whole trees from here on: no partial path to fall into
            snapshot = Snapshot.of(tree, next(self._versions))
        diff = diff_trees(current.tree.root, snapshot.tree.root)
        return Pending(change, states, snapshot, current.version, diff)

    def _remember(self, snapshot: Snapshot) -> None:
        if snapshot.tree.partial is not None:
            return  # versions share their subtrees; nothing to keep
        key = _key(self.states)
        old = self._cache.pop(key, None)
        if old is not None:
            self._cache_bytes -= old.nbytes
        self._cache[key] = snapshot
        self._cache_bytes += snapshot.nbytes
        while self._cache_bytes > CACHE_BYTES and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= dropped.nbytes

    def commit(self, pending: Pending) -> Diff:
        """Make a prepared change visible and return what differs from before."""
        if pending.base_version != self.snapshot.version:
            raise ControlError("concurrent change: prepare again")
        self.previous = self.snapshot  # what the change replaced (the FUSE layer asks)
        self.snapshot = pending.snapshot
        self.states = dict(pending.states)
        self._remember(pending.snapshot)
        self.records.update(pending.snapshot.tree.devices)
        diff = pending.diff
        now = self._clock()
        for path, _ in diff.added:  # a changed value keeps its time (see changed_ns)
            self._changed_ns[path] = now
        for path in diff.dirs:
            self._changed_ns[path] = now
        return diff

    def apply(self, change: Change) -> Diff:
        """``prepare`` then ``commit`` in one step (for single-threaded callers)."""
        pending = self.prepare(change)
        return self.commit(pending) if pending is not None else Diff()

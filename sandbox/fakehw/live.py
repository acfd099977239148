"""The live tree: current device states, the tree built from them, and what a change changes.

``LiveTree`` owns the mutable side of a served node: the states dict, the current
``Snapshot`` (a tree plus a path index over it) and per-path change times. A change goes
through ``prepare`` (pure: new states, new tree and its ``Diff``; safe to run in a worker
thread) and ``commit`` (one assignment swaps the snapshot, so a reader sees the old tree
or the new one, never a mix). The ``Diff`` names exactly which paths appeared, vanished
or changed; the filesystem layer turns it into kernel cache invalidations.

A change costs what the changed device owns, not what the node has: when the tree's
builder offers ``Tree.partial``, ``prepare`` builds just the changed device's part under
the old and the new states, diffs those two small trees and applies the difference to
the current tree by path copying (``patch_tree``): only the directories on the way to a
changed entry are copied, every other subtree is shared with the previous version. Trees
from builders without ``partial`` are rebuilt whole and kept in a cache bounded by bytes.
Nothing here imports pyfuse3 or does any I/O except the state-file helpers at the bottom.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from sandbox.errors import ControlError, SandboxError
from sandbox.fakehw.tree import (
    DeviceRecord,
    DeviceState,
    Dir,
    Entry,
    File,
    Health,
    Reason,
    Symlink,
    Tree,
)

log = logging.getLogger(__name__)

Rebuild = Callable[[Mapping[str, DeviceState]], Tree]
Kind = Literal["dir", "file", "link", "chr"]
Op = Literal["health", "unplug", "plug", "set-vfs"]
OPS: tuple[Op, ...] = ("health", "unplug", "plug", "set-vfs")
STATE_FILE_VERSION = 1
# Whole trees (builders without Tree.partial) memoised by states, up to this many bytes
# (estimated from entries and file contents, as tracemalloc measures a small tree).
CACHE_BYTES = 2 << 20
_ENTRY_BYTES = 350  # a Dir/File/Symlink object, its name and its dict slot, roughly
_StatesKey = tuple[tuple[str, DeviceState], ...]


def _key(states: Mapping[str, DeviceState]) -> _StatesKey:
    default = DeviceState()
    return tuple(sorted((k, v) for k, v in states.items() if v != default))


def kind_of(entry: Entry) -> Kind:
    if isinstance(entry, Dir):
        return "dir"
    if isinstance(entry, File):
        return "file"
    if isinstance(entry, Symlink):
        return "link"
    return "chr"


@dataclass(frozen=True)
class Change:
    """One requested change to one device (already validated by its producer)."""

    op: Op
    device: str
    health: Health | None = None
    reason: Reason | None = None
    num_vfs: int | None = None
    port: int | None = None  # set-vfs: one physical function (0-based) instead of all

    def __post_init__(self) -> None:
        if self.op == "health":
            if self.health is None:
                raise ControlError("health: a health value is required")
            if self.health is Health.HEALTHY and self.reason is not None:
                raise ControlError("health: a healthy device takes no reason")
            if self.health is Health.UNHEALTHY and self.reason is None:
                raise ControlError("health: an unhealthy device needs a reason")
        if self.op == "set-vfs" and (self.num_vfs is None or self.num_vfs < 0):
            raise ControlError("set-vfs: num_vfs must be a non-negative integer")
        if self.port is not None and (self.op != "set-vfs" or self.port < 0):
            raise ControlError("port: only set-vfs takes a port, a non-negative integer")


def next_state(state: DeviceState, change: Change) -> DeviceState:
    """The state a device is in after ``change``.

    ``health unhealthy removed`` also unplugs (the device fell off the bus); ``plug``
    of a device removed that way brings it back healthy.
    """
    if change.op == "health":
        assert change.health is not None
        plugged = state.plugged and change.reason is not Reason.REMOVED
        return replace(state, health=change.health, reason=change.reason, plugged=plugged)
    if change.op == "unplug":
        return replace(state, plugged=False)
    if change.op == "plug":
        if state.reason is Reason.REMOVED:
            return replace(state, plugged=True, health=Health.HEALTHY, reason=None)
        return replace(state, plugged=True)
    if change.port is None:  # every physical function
        return replace(state, num_vfs=change.num_vfs, port_vfs=())
    assert change.num_vfs is not None
    ports = dict(state.port_vfs)
    ports[change.port] = change.num_vfs
    return replace(state, port_vfs=tuple(sorted(ports.items())))


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
class Diff:
    """What changed between two snapshots, as (path, kind) pairs.

    ``removed`` holds paths that vanished or whose kind changed (with the OLD kind),
    sorted parents first; ``added`` paths that appeared (or re-appeared with a new kind);
    ``changed`` paths of the same kind whose bytes, target, mode or major:minor differ;
    ``dirs`` directories whose listing changed.
    """

    removed: tuple[tuple[str, Kind], ...] = ()
    added: tuple[tuple[str, Kind], ...] = ()
    changed: tuple[tuple[str, Kind], ...] = ()
    dirs: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.removed or self.added or self.changed or self.dirs)


def diff_index(old: Mapping[str, Entry], new: Mapping[str, Entry]) -> Diff:
    """Compare two flat indexes (see ``Snapshot``). Pure."""
    removed: list[tuple[str, Kind]] = []
    added: list[tuple[str, Kind]] = []
    changed: list[tuple[str, Kind]] = []
    dirs: set[str] = set()
    for path, before in old.items():
        after = new.get(path)
        if after is before:
            continue
        if after is None or type(after) is not type(before):
            removed.append((path, kind_of(before)))
            dirs.add(path.rpartition("/")[0])
            if after is not None:
                added.append((path, kind_of(after)))
            continue
        if isinstance(before, Dir) and isinstance(after, Dir):
            # Children are compared as paths of their own; only the mode is the dir's.
            if before.mode != after.mode:
                changed.append((path, "dir"))
        elif before != after:
            changed.append((path, kind_of(before)))
    for path, after in new.items():
        if path not in old:
            added.append((path, kind_of(after)))
            dirs.add(path.rpartition("/")[0])
    # A directory that vanished itself needs no listing refresh.
    gone = {p for p, k in removed if k == "dir" and p not in new}
    return Diff(
        removed=tuple(sorted(removed)),
        added=tuple(sorted(added)),
        changed=tuple(sorted(changed)),
        dirs=tuple(sorted(d for d in dirs if d not in gone)),
    )


class _Acc:
    """Collects a Diff while trees are compared or patched."""

    def __init__(self) -> None:
        self.removed: list[tuple[str, Kind]] = []
        self.added: list[tuple[str, Kind]] = []
        self.changed: list[tuple[str, Kind]] = []
        self.dirs: set[str] = set()

    def remove(self, path: str, entry: Entry) -> None:
        """``path`` and, for a directory, everything below it vanished."""
        self.removed.append((path, kind_of(entry)))
        self.dirs.add(path.rpartition("/")[0])
        if isinstance(entry, Dir):
            for sub, e in Tree(entry).walk():
                self.removed.append((f"{path}/{sub}", kind_of(e)))

    def add(self, path: str, entry: Entry) -> None:
        """``path`` and, for a directory, everything below it appeared."""
        self.added.append((path, kind_of(entry)))
        self.dirs.add(path.rpartition("/")[0])
        if isinstance(entry, Dir):
            for sub, e in Tree(entry).walk():
                full = f"{path}/{sub}"
                self.added.append((full, kind_of(e)))
                self.dirs.add(full.rpartition("/")[0])

    def diff(self) -> Diff:
        added = {p for p, _ in self.added}
        # A directory that vanished itself needs no listing refresh.
        gone = {p for p, k in self.removed if k == "dir" and p not in added}
        return Diff(
            removed=tuple(sorted(self.removed)),
            added=tuple(sorted(self.added)),
            changed=tuple(sorted(self.changed)),
            dirs=tuple(sorted(d for d in self.dirs if d not in gone)),
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def diff_trees(old: Dir, new: Dir) -> Diff:
    """What ``diff_index`` reports for two trees, without indexing them: subtrees the two
    share (the same object) are skipped whole."""
    acc = _Acc()
    _diff_dir("", old, new, acc)
    return acc.diff()


def _diff_dir(prefix: str, old: Dir, new: Dir, acc: _Acc) -> None:
    if old is new:
        return
    nc = new.children
    for name, before in old.children.items():
        after = nc.get(name)
        if after is before:
            continue
        path = _join(prefix, name)
        if after is None or type(after) is not type(before):
            acc.remove(path, before)
            if after is not None:
                acc.add(path, after)
        elif isinstance(before, Dir):
            assert isinstance(after, Dir)
            if before.mode != after.mode:
                acc.changed.append((path, "dir"))
            _diff_dir(path, before, after, acc)
        elif before != after:
            acc.changed.append((path, kind_of(before)))
    oc = old.children
    for name, after in nc.items():
        if name not in oc:
            acc.add(_join(prefix, name), after)


class Mismatch(Exception):
    """A partial build disagrees with the tree it should patch (a builder bug): the
    caller rebuilds the whole tree instead."""


_EMPTY = Dir()


def patch_tree(base: Dir, old: Dir, new: Dir) -> tuple[Dir, Diff]:
    """``base`` with the entries of ``old`` (a partial build under the old states)
    replaced by those of ``new`` (under the new states), and what that changed.

    Path copying: directories on the way to a change are copied, everything else is
    shared with ``base`` (never modified). A directory that only ``old`` had is removed
    once nothing is left in it (other devices' entries keep a shared one). Raises
    Mismatch where ``base`` does not hold what ``old`` says it holds."""
    acc = _Acc()
    root = _patch("", base, old, new, acc)
    return root, acc.diff()


def _patch(prefix: str, base: Dir, old: Dir, new: Dir, acc: _Acc) -> Dir:
    children: dict[str, Entry] | None = None
    oc, nc, bc = old.children, new.children, base.children
    for name in oc.keys() | nc.keys():
        o, n = oc.get(name), nc.get(name)
        if o is n:
            continue
        path = _join(prefix, name)
        b = bc.get(name)
        after = _patch_entry(path, b, o, n, acc)
        if after is not b:
            if children is None:
                children = dict(bc)
            if after is None:
                del children[name]
            else:
                children[name] = after
    return base if children is None else Dir(children, base.mode)


def _patch_entry(
    path: str, b: Entry | None, o: Entry | None, n: Entry | None, acc: _Acc
) -> Entry | None:
    """The entry at ``path`` once ``o`` (old partial) becomes ``n`` (new partial) over
    ``b`` (the current whole tree's)."""
    if isinstance(o, Dir) or (o is None and isinstance(n, Dir) and b is not None):
        if not isinstance(b, Dir):
            raise Mismatch(path)
        merged = _patch(path, b, o if isinstance(o, Dir) else _EMPTY,
                        n if isinstance(n, Dir) else _EMPTY, acc)  # fmt: skip
        if isinstance(n, Dir):
            if isinstance(o, Dir) and n.mode != o.mode:
                acc.changed.append((path, "dir"))
                return Dir(dict(merged.children), n.mode)
            return merged
        if merged.children:  # other devices' entries keep it
            if n is not None:
                raise Mismatch(path)
            return merged
        acc.removed.append((path, "dir"))
        acc.dirs.add(path.rpartition("/")[0])
        if n is not None:
            acc.add(path, n)
        return n
    if o is not None:  # a leaf
        if b is not o and b != o:
            raise Mismatch(path)
        if n is None:
            acc.remove(path, o)
        elif type(n) is type(o):
            if n == o:
                return b
            acc.changed.append((path, kind_of(o)))
        else:
            acc.remove(path, o)
            acc.add(path, n)
        return n
    if b is not None or n is None:  # only ``new`` has it, so ``base`` must not
        raise Mismatch(path)
    acc.add(path, n)
    return n


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
        """When the entry at ``path`` last changed (the mount time if never)."""
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
        before = self.state(change.device)
        after = next_state(before, change)
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
        for path, _ in (*diff.added, *diff.changed):
            self._changed_ns[path] = now
        for path in diff.dirs:
            self._changed_ns[path] = now
        return diff

    def apply(self, change: Change) -> Diff:
        """``prepare`` then ``commit`` in one step (for single-threaded callers)."""
        pending = self.prepare(change)
        return self.commit(pending) if pending is not None else Diff()


# -- state files ------------------------------------------------------------------------
def state_to_json(state: DeviceState) -> dict[str, Any]:
    out: dict[str, Any] = {
        "health": state.health.value,
        "reason": state.reason.value if state.reason else None,
        "plugged": state.plugged,
        "num_vfs": state.num_vfs,
    }
    if state.port_vfs:  # only once a port was set apart: older readers see what they knew
        out["port_vfs"] = {str(p): n for p, n in state.port_vfs}
    return out


def state_from_json(obj: object, where: str) -> DeviceState:
    if not isinstance(obj, dict):
        raise ControlError(f"{where}: expected an object")
    try:
        health = Health(obj.get("health", "healthy"))
        raw_reason = obj.get("reason")
        reason = Reason(raw_reason) if raw_reason is not None else None
    except ValueError as exc:
        raise ControlError(f"{where}: {exc}") from exc
    plugged = obj.get("plugged", True)
    num_vfs = obj.get("num_vfs")
    if not isinstance(plugged, bool):
        raise ControlError(f"{where}.plugged: expected true or false")
    if num_vfs is not None and (not isinstance(num_vfs, int) or isinstance(num_vfs, bool)):
        raise ControlError(f"{where}.num_vfs: expected an integer or null")
    raw_ports = obj.get("port_vfs", {})
    if not isinstance(raw_ports, dict):
        raise ControlError(f"{where}.port_vfs: expected an object of port -> count")
    ports: dict[int, int] = {}
    for key, n in raw_ports.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 3):
            raise ControlError(f"{where}.port_vfs: {key!r}: expected a port number")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ControlError(f"{where}.port_vfs.{key}: expected a non-negative integer")
        ports[int(key)] = n
    return DeviceState(health=health, reason=reason, plugged=plugged, num_vfs=num_vfs,
                       port_vfs=tuple(sorted(ports.items())))  # fmt: skip


def save_states(path: Path, states: Mapping[str, DeviceState]) -> None:
    """Write states atomically (temp file, rename): a killed server leaves old or new.

    No fsync: it costs 10-150 ms per change here, and a sandbox need not survive power
    loss; a crash of the server process is what this guards against. One writer per
    file (the server, under its lock), so the temp name is fixed."""
    doc = {
        "v": STATE_FILE_VERSION,
        "devices": {k: state_to_json(states[k]) for k in sorted(states)},
    }
    data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_states(path: Path) -> dict[str, DeviceState]:
    """Read a state file written by ``save_states``; {} if there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ControlError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("v") != STATE_FILE_VERSION:
        raise ControlError(f"{path}: expected a version {STATE_FILE_VERSION} state file")
    devices = doc.get("devices")
    if not isinstance(devices, dict):
        raise ControlError(f"{path}: devices: expected an object")
    return {str(k): state_from_json(v, f"{path}: devices.{k}") for k, v in devices.items()}


def describe(records: Iterable[DeviceRecord]) -> list[dict[str, Any]]:
    """Devices as the control API's ``get`` reports them."""
    return [
        {
            "id": r.id,
            "kind": r.kind,
            "vendor": r.vendor,
            "model": r.model,
            "pci_address": r.pci_address,
            "numa_node": r.numa_node,
            "dev_nodes": list(r.dev_nodes),
            "state": state_to_json(r.state),
        }
        for r in records
    ]

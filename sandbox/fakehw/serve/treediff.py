"""What differs between two trees, and a tree patched by the difference of two others.

A ``Diff`` names exactly which paths appeared, vanished or changed (with their kind); the
filesystem layer turns it into kernel cache invalidations. ``diff_index`` compares two
flat path indexes, ``diff_trees`` two trees (skipping the subtrees they share), and
``patch_tree`` applies the difference between two partial builds (one device's part under
the old and the new states) to a whole tree by path copying: only the directories on the
way to a changed entry are copied, every other subtree is shared with the previous
version. Pure: no I/O.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from sandbox.fakehw.tree import BlockDevice, Dir, Entry, File, Symlink, Tree

Kind = Literal["dir", "file", "link", "chr", "blk"]


def kind_of(entry: Entry) -> Kind:
    if isinstance(entry, Dir):
        return "dir"
    if isinstance(entry, File):
        return "file"
    if isinstance(entry, Symlink):
        return "link"
    if isinstance(entry, BlockDevice):
        return "blk"
    return "chr"


def size_of(entry: Entry) -> int:
    """What st_size says: a file's or a symlink's length; 0 for the rest."""
    if isinstance(entry, File):
        return len(entry.data)
    if isinstance(entry, Symlink):
        return len(os.fsencode(entry.target))
    return 0


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

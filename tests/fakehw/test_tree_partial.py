"""Partial rebuilds (``build_partial`` + ``patch_tree``) give exactly the whole tree.

The live server applies a change by building only the changed device's part under the
old and the new states and patching the current tree with the difference. For every
shipped profile's nodes, a seeded storm of changes (and every device unplugged one by
one, then plugged back) must leave the patched tree byte-identical to a whole
``build_tree`` of the same states, with the same Diff a whole comparison reports, and no
fallback to a whole rebuild.
"""

from __future__ import annotations

import logging
import random

import pytest

from sandbox.errors import ControlError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.changes import Change
from sandbox.fakehw.control.scenario import storm
from sandbox.fakehw.serve.live import LiveTree
from sandbox.fakehw.serve.treediff import diff_trees, patch_tree
from sandbox.fakehw.tree import Dir, File, Symlink, Tree
from sandbox.profile import load_profile
from sandbox.profile.spec import NodeSpec
from tests.support.paths import REPO

PROFILES = sorted((REPO / "profiles").glob("*.yaml"))


def _nodes() -> list[tuple[str, NodeSpec]]:
    out = []
    for path in PROFILES:
        seen: set[str] = set()
        for node in load_profile(path).cluster.nodes:
            if node.base_name in seen:
                continue  # replicas of one node entry build alike
            seen.add(node.base_name)
            if node.devices:
                out.append((f"{path.stem}/{node.base_name}", node))
    return out


NODES = _nodes()


def _check(live: LiveTree, node: NodeSpec, change: Change) -> None:
    before = live.snapshot.tree.root
    try:
        diff = live.apply(change)
    except ControlError:
        return  # refused (e.g. VFs on a device without SR-IOV): nothing changed
    whole = build_tree(node, live.states)
    assert Tree(live.snapshot.tree.root).digest() == whole.digest(), change
    assert diff == diff_trees(before, live.snapshot.tree.root), change
    assert len(live.snapshot.index) == 1 + sum(1 for _ in whole.walk())


@pytest.mark.parametrize(("name", "node"), NODES, ids=[n for n, _ in NODES])
def test_partial_rebuilds_match_whole_builds(
    name: str, node: NodeSpec, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sandbox.fakehw.serve.live")
    live = LiveTree(lambda states: build_tree(node, states))
    assert live.snapshot.tree.partial is not None
    devices = sorted(live.records)
    rng = random.Random(f"partial/{name}")
    actions = storm(rng, start=0, changes=40, over=0, devices=devices,
                    ops=("health", "unplug", "plug", "set-vfs"), max_vfs=3)  # fmt: skip
    for a in actions:
        assert a.change is not None
        _check(live, node, a.change)
    for d in devices:  # down to no device at all: shared directories must go too
        _check(live, node, Change("unplug", d))
    for d in reversed(devices):
        _check(live, node, Change("plug", d))
    assert not [r for r in caplog.records if "disagrees" in r.getMessage()]
    assert live.cache_bytes == 0  # versions share subtrees; no whole tree is kept


def test_patch_shares_untouched_subtrees_and_refuses_a_wrong_base() -> None:
    base = Tree()
    base.add_file("a/x", "1\n")
    base.add_file("b/y", "2\n")
    old, new = Tree(), Tree()
    old.add_file("a/x", "1\n")
    new.add_file("a/x", "3\n")
    new.add_link("a/z", "x")
    root, diff = patch_tree(base.root, old.root, new.root)
    assert root.children["b"] is base.root.children["b"]  # shared, not copied
    assert base.get("a/x") == File(b"1\n")  # the base is never modified
    x = root.children["a"]
    assert isinstance(x, Dir)
    assert x.children["x"] == File(b"3\n")
    assert x.children["z"] == Symlink("x")
    assert diff.changed == (("a/x", "file"),)
    assert diff.added == (("a/z", "link"),)
    assert diff.dirs == ("a",)
    wrong = Tree()
    wrong.add_file("a/x", "9\n")
    with pytest.raises(Exception, match="a/x"):
        patch_tree(wrong.root, old.root, new.root)


def test_mig_changes_patch_like_whole_builds(caplog: pytest.LogCaptureFixture) -> None:
    """NVML's MIG lifecycle (sandbox.fakehw.mig) through the same partial path: destroying
    the profile's instances, creating others at placements, MIG mode off and on."""
    caplog.set_level(logging.WARNING, logger="sandbox.fakehw.serve.live")
    [node] = [n for name, n in NODES if name == "mig-partitions/mig-worker"]
    live = LiveTree(lambda states: build_tree(node, states))
    geo = live.records["gpu1"].mig
    assert geo is not None
    assert geo.layout
    for g in geo.layout:
        _check(live, node, Change("ci-destroy", "gpu1", gi=g.gi, ci=0))
        _check(live, node, Change("gi-destroy", "gpu1", gi=g.gi))
    for profile, start in ((2, 4), (1, 2), (0, 0), (0, None), (0, None)):  # the last: full
        _check(live, node, Change("gi-create", "gpu1", profile=profile, start=start))
    made = live.states["gpu1"].mig
    assert made is not None
    assert [(g.profile, g.start) for g in made] == \
        [(2, 4), (1, 2), (0, 0), (0, 1)]
    for g in made:
        _check(live, node, Change("ci-create", "gpu1", gi=g.gi, profile=g.profile))
    for g in made:
        _check(live, node, Change("ci-destroy", "gpu1", gi=g.gi, ci=0))
        _check(live, node, Change("gi-destroy", "gpu1", gi=g.gi))
    _check(live, node, Change("mig-mode", "gpu1", enabled=False))
    assert live.states["gpu1"].mig_mode is False
    _check(live, node, Change("mig-mode", "gpu1", enabled=True))
    assert not [r for r in caplog.records if "disagrees" in r.getMessage()]

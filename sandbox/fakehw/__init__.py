"""Fake hardware: the tree a node's /sys, /dev and /proc are served from.

    builder/   build_tree(node, states) -> Tree: pure, a resolved node + device states
    render     render(tree, out_dir): write it to a plain directory
    serve/     serve it live: LiveTree, the FUSE filesystem (fs.serve), the control server
    control/   ControlClient (change a live tree: faults, hotplug), the wire format, scenarios

Shared by all of them: ``tree`` (the tree and device-state types), ``changes`` (a change
to one device and the state it leads to), ``states`` (states as JSON, the state file),
``devnodes`` (which real device node stands in for a tree's), ``refusedpaths`` (where a
tree may never be written or mounted).
"""

from typing import TYPE_CHECKING

from sandbox import lazy

if TYPE_CHECKING:
    from sandbox.fakehw.builder import build_tree
    from sandbox.fakehw.tree import (
        CharDevice,
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
else:
    __getattr__ = lazy.exports(__name__, {
        "builder": ["build_tree"],
        "tree": ["CharDevice", "DeviceRecord", "DeviceState", "Dir", "Entry", "File",
                 "Health", "Reason", "Symlink", "Tree"],
    })

__all__ = [
    "build_tree",
    "CharDevice",
    "DeviceRecord",
    "DeviceState",
    "Dir",
    "Entry",
    "File",
    "Health",
    "Reason",
    "Symlink",
    "Tree",
]

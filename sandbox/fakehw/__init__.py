"""Fake hardware: the tree a node's /sys, /dev and /proc are served from.

    build_tree(node, states) -> Tree      pure: a resolved node + device states
    render(tree, out_dir)                 write it to a plain directory
    fs.serve(...)                         serve it live over FUSE (the only pyfuse3 user)
    control.ControlClient                 change a live tree (faults, hotplug)
"""

from sandbox.fakehw.build import build_tree
from sandbox.fakehw.render import render
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

__all__ = [
    "build_tree",
    "render",
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

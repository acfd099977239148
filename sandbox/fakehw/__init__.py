"""Fake hardware: the tree a node's /sys, /dev and /proc are served from."""

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

"""One node served: its spec -> tree -> FUSE mount -> control socket, in this process.

The spec is read once (``load_node``, by the caller), the mount point checked once
(``check_mount_root``), and the tree of the states the profile starts in built once: the
device nodes (``devdir``) and the first served version share it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from sandbox import supervisor
from sandbox.agent.devdir import create_device_nodes, remove_device_nodes
from sandbox.errors import SandboxError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.control import ControlPaths
from sandbox.fakehw.serve.fs import serve
from sandbox.fakehw.serve.mountroot import check_mount_root
from sandbox.fakehw.states import initial_states
from sandbox.fakehw.tree import DeviceState, Tree
from sandbox.profile.spec import NodeSpec, read_node

log = logging.getLogger(__name__)


def resolve_node(profile_path: str, node: str, index: int | None = None) -> NodeSpec:
    """The node ``node`` (replica ``index``) of the profile at ``profile_path``."""
    from sandbox.profile import load_profile  # the YAML loader only where a profile is read

    cluster = load_profile(profile_path).cluster
    spec = cluster.node(node, index)
    if spec is None:
        names = ", ".join(n.name for n in cluster.nodes)
        raise SandboxError(f"{profile_path}: no node {node!r} (nodes: {names})")
    return spec


def load_node(*, spec_file: Path | None = None, profile_path: str | None = None,
              node: str | None = None, index: int | None = None) -> NodeSpec:
    """The node to serve: from a resolved spec file (docs/spec-format.md; ``node`` needed
    when it holds several), else from a profile and a node name."""
    if spec_file is not None:
        return read_node(spec_file, node, index)
    if profile_path is not None and node is not None:
        return resolve_node(profile_path, node, index)
    raise SandboxError("a node to serve needs a spec file, or a profile and a node name")


class _Trees:
    """``build_tree`` for one node, the tree of the states it starts in built once: the
    device nodes are made from it and it is the first version served (unless saved states
    say otherwise); after that the live tree holds it, not this."""

    def __init__(self, spec: NodeSpec, states: Mapping[str, DeviceState]) -> None:
        self.spec = spec
        self.states = dict(states)
        self._first: Tree | None = None

    def first(self) -> Tree:
        if self._first is None:
            self._first = build_tree(self.spec, self.states)
        return self._first

    def __call__(self, states: Mapping[str, DeviceState]) -> Tree:
        if self._first is not None and dict(states) == self.states:
            tree, self._first = self._first, None
            return tree
        return build_tree(self.spec, states)


def announce_ready(paths: ControlPaths, root: Path) -> None:
    """The ready line on stdout (what ``supervisor.wait_ready`` waits for), then how to
    stop the server on stderr."""
    print(supervisor.ready_line(paths.socket, os.getpid()), flush=True)
    print(f"serving {root}; stop with Ctrl-C or fusermount3 -u {root}", file=sys.stderr)


def serve_node(spec: NodeSpec, root: Path, *, state_dir: Path | None = None,
               dev_dir: Path | None = None, dev_map: tuple[int, int] | None = None,
               allow_dev: bool = False,
               ready: Callable[[ControlPaths], None] | None = None) -> None:
    """Mount and serve ``spec``'s tree at ``root`` until unmounted or signalled
    (foreground); ``ready(paths)`` once it serves. ``dev_dir``: also make the node's
    device nodes there for as long as it serves. ``dev_map`` applies with ``allow_dev``
    only, which needs it (never a real host device by default)."""
    if allow_dev and dev_map is None:
        raise SandboxError("--dev needs --dev-map: never expose a real host device by default")
    mountpoint = check_mount_root(root)
    states = initial_states(spec)
    trees = _Trees(spec, states)
    made: list[str] = []
    if dev_dir is not None:
        made = create_device_nodes(trees.first(), dev_dir)
        log.info("created %d device nodes under %s", len(made), dev_dir)

    class _Status:
        def started(self, value: ControlPaths | None = None) -> None:
            if ready is not None and value is not None:
                ready(value)

    try:
        trio.run(lambda: serve(mountpoint, trees, initial_states=states,
                               state_dir=state_dir, dev_map=dev_map if allow_dev else None,
                               allow_dev=allow_dev, fsname=f"hwsandbox:{spec.name}",
                               node=spec.name, task_status=_Status()))
    finally:
        if dev_dir is not None:
            remove_device_nodes(made, dev_dir)

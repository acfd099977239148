"""The node server: one node's fake hardware, spec -> tree -> FUSE mount -> control socket.

Every runtime runs one per node replica: the local and native runtimes as a host process,
kind as a privileged static pod of the node's kubelet inside the node container;
``sandbox mount`` runs one in the foreground or leaves one running (``--daemon``).

    python -m sandbox.agent   the server's entry point (``__main__``): it prints the ready
                              line ``supervisor.wait_ready`` waits for
    node      load_node, serve_node: read the spec, serve it until unmounted or signalled
    devdir    the node's device nodes in a directory, for a container runtime
    spawn     start_node, wait_node, spawn_node: the server as a detached process; unmount
"""

from typing import TYPE_CHECKING

from sandbox import lazy

if TYPE_CHECKING:
    from sandbox.agent.devdir import (
        IN_NODE_ENV,
        create_device_nodes,
        device_nodes,
        remove_device_nodes,
    )
    from sandbox.agent.node import announce_ready, load_node, resolve_node, serve_node
    from sandbox.agent.spawn import (
        spawn_node,
        start_node,
        unmount,
        wait_node,
        wait_unmounted,
    )
else:
    __getattr__ = lazy.exports(__name__, {
        "devdir": ["IN_NODE_ENV", "create_device_nodes", "device_nodes", "remove_device_nodes"],
        "node": ["announce_ready", "load_node", "resolve_node", "serve_node"],
        "spawn": ["spawn_node", "start_node", "unmount", "wait_node", "wait_unmounted"],
    })

__all__ = [
    "IN_NODE_ENV", "announce_ready", "create_device_nodes", "device_nodes",
    "load_node", "remove_device_nodes", "resolve_node", "serve_node", "spawn_node",
    "start_node", "unmount", "wait_node", "wait_unmounted",
]

"""Serving a node's tree live: its versions, the FUSE mount and the control server.

    live           LiveTree: the current device states and tree, a change's new tree and diff
    treediff       what differs between two trees, and patching one into another
    fs             serve(): the FUSE filesystem and the control socket
    kcache         the kernel's caches of the mount: invalidation, warming (with fs, the
                   only pyfuse3 users)
    mountroot      where a tree may be mounted; clearing a dead mount (no pyfuse3)
    controlserver  ControlServer: the control socket's server (its client: ``fakehw.control``)

Nothing is imported here: checking a mount root needs no FUSE bindings.
"""

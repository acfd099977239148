"""Container images built from local files, for clusters that cannot reach a registry.

    tarfiles    the one deterministic layer-tar writer (and digests of layers)
    oci         the one OCI image-archive writer (``ctr images import``, ``kind load``)
    dockerload  ``docker load`` of a docker-archive; labels of local images
    rootfs      Debian rootfs tarballs by mmdebstrap (stdlib only: runs before install)
    pause       the native runtime's pause and busybox images
    deps        the sandbox image's Python dependencies, built by its own python3 in a
                Debian build rootfs (any host Python)
    agent       the sandbox image (our packages on Debian's Python 3.11 and FUSE)
    node        the kind node image (kind's base files, Kubernetes built from source)

This ``__init__`` imports none of them: ``python3 -m sandbox.images.rootfs`` needs only
the standard library (with ``sandbox.cache``, ``sandbox.commands``, ``sandbox.errors``).
"""

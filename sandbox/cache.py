"""Where the project caches what it builds (rootfs tarballs, images, tools, our NVML):
``$HWSANDBOX_CACHE``, else ``$XDG_CACHE_HOME/hw-sandbox`` (``~/.cache/hw-sandbox``).

Standard library only (``python3 -m sandbox.images.rootfs`` runs before anything is
installed)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("HWSANDBOX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hw-sandbox")
    return Path(base)


# containerd 2.x (CDI built in), built from source by scripts/build-containerd for the native
# runtime and the kind node image: Debian 12's containerd 1.6 has no CDI, so a DRA driver's
# devices would never reach a pod.
CONTAINERD_VERSION = os.environ.get("HWSANDBOX_CONTAINERD_VERSION", "2.4.2")
CONTAINERD_TOOLS = ("containerd", "containerd-shim-runc-v2", "ctr")

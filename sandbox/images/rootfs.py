"""Debian rootfs tarballs made by ``mmdebstrap`` from Debian packages: the base of the kind
node image (``NODE_PACKAGES``), of the sandbox agent's image (``AGENT_PACKAGES``) and the
rootfs its Python dependencies are built in (``BUILD_PACKAGES``), as a tar in the project
cache keyed by suite, mirror and package list.

Standard library only (with ``sandbox.cache``, ``sandbox.commands``, ``sandbox.errors``),
so that ``python3 -m sandbox.images.rootfs`` can build the tarballs before anything is
installed (the test command runs it in parallel with the Kubernetes build).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandbox.cache import cache_root
from sandbox.commands import run
from sandbox.errors import ImageBuildError, SandboxError
from sandbox.progress import Progress

SUITE = "bookworm"
MIRROR = os.environ.get("HWSANDBOX_DEBIAN_MIRROR", "http://deb.debian.org/debian")

# kind's images/base package list (minus storage-test and NFS/iSCSI packages), plus what
# kind builds from source there, taken from Debian instead.
NODE_PACKAGES = [
    "systemd", "conntrack", "iptables", "nftables", "iproute2", "ethtool", "util-linux",
    "mount", "kmod", "libseccomp2", "pigz", "bash", "ca-certificates", "curl", "jq",
    "procps", "containerd", "runc", "containernetworking-plugins",
]
# The sandbox agent and our plugins: Debian's Python 3.11 (the wheels are cp311) and FUSE;
# iptables and conntrack for kube-proxy, whose image shares this rootfs layer.
AGENT_PACKAGES = ["python3", "libfuse3-3", "fuse3", "iptables", "conntrack"]
PYTHON = "3.11"  # SUITE's python3: the image's interpreter, the one its wheels are built for
# Where the image's dependencies are installed and the patched pyfuse3 is compiled
# (``sandbox.images.deps``): the agent's Debian with pip and a compiler, so that they are
# built by the image's own Python whatever the host runs.
BUILD_PACKAGES = [*AGENT_PACKAGES, "python3-pip", "python3-dev", "gcc", "libfuse3-dev",
                  "pkg-config", "patch", "ca-certificates"]


def say(message: str) -> None:
    """The image builds' default progress: timestamped lines on stderr."""
    print(f"[kind-image {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rootfs_key(packages: Iterable[str]) -> str:
    text = json.dumps([SUITE, MIRROR, sorted(packages)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _rootfs_path(name: str, packages: list[str]) -> Path:
    return cache_root() / "kind" / f"rootfs-{name}-{SUITE}-{rootfs_key(packages)}.tar"


def cached_rootfs(name: str, packages: list[str]) -> Path | None:
    """The rootfs tarball if it was built before, else None (nothing is built)."""
    out = _rootfs_path(name, packages)
    return out if out.is_file() else None


def build_rootfs(name: str, packages: list[str], progress: Progress = say) -> Path:
    """A Debian ``SUITE`` minbase rootfs with ``packages``, as a tar in the cache."""
    out = _rootfs_path(name, packages)
    if out.is_file():
        return out
    if shutil.which("mmdebstrap") is None:
        raise ImageBuildError("rootfs: mmdebstrap not found (Debian: apt-get install mmdebstrap)")
    if os.geteuid() != 0:
        raise ImageBuildError("rootfs: mmdebstrap runs as root here (run the build as root)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    progress(f"rootfs {name}: mmdebstrap {SUITE} + {len(packages)} packages (a few minutes)")
    started = time.monotonic()
    argv = ["mmdebstrap", "--quiet", "--mode=root", "--variant=minbase", "--format=tar",
            "--include=" + ",".join(packages),
            "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--aptopt=APT::Install-Recommends false",
            # policy-rc.d: no service starts while packages are installed
            "--customize-hook=rm -f \"$1/usr/sbin/policy-rc.d\"",
            SUITE, str(tmp), f"deb {MIRROR} {SUITE} main"]
    try:
        run(argv, step=f"rootfs {name}", capture_stdout=False, timeout=None)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    progress(f"rootfs {name}: {out.stat().st_size >> 20} MiB in "
             f"{time.monotonic() - started:.0f}s -> {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m sandbox.images.rootfs", description="Build the Debian rootfs "
        "tarballs of the kind node and the sandbox agent images (and the agent's build "
        "rootfs) into the project cache (re-running is a no-op).")
    parser.parse_args(argv)
    try:
        # the mmdebstrap runs are mostly downloads and dpkg: run them side by side
        with ThreadPoolExecutor(3) as pool:
            jobs = [pool.submit(build_rootfs, "node", NODE_PACKAGES),
                    pool.submit(build_rootfs, "agent", AGENT_PACKAGES),
                    pool.submit(build_rootfs, "build", BUILD_PACKAGES)]
            for job in jobs:
                job.result()
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

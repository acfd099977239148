"""Debian 13 (trixie) chroots for the tests that play a user whose Python is not ours: its
python3 is 3.13 and externally managed (PEP 668), like ubuntu-24.04's 3.12.

    need_root_tools()          fail (with the fix) unless root with mmdebstrap
    trixie_rootfs(packages)    a minbase tarball with ``packages``, cached under the project
                               cache, keyed by the mirror and the package list
    unpack(tar, root)          the tarball into a new directory
    host_ca()                  the CA bundle pip should trust in the chroot, if any
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from sandbox.cache import cache_root
from sandbox.images.rootfs import MIRROR


def need_root_tools() -> None:
    if os.geteuid() != 0:
        pytest.fail("the trixie chroot needs root (mmdebstrap, chroot)", pytrace=False)
    if shutil.which("mmdebstrap") is None:
        pytest.fail("mmdebstrap is needed to make the Debian chroots: apt-get install "
                    "mmdebstrap", pytrace=False)


def trixie_rootfs(packages: Sequence[str]) -> Path:
    """Debian 13 minbase with ``packages``, cached like the image rootfs."""
    key = hashlib.sha256(repr([MIRROR, list(packages)]).encode()).hexdigest()[:12]
    out = cache_root() / "test" / f"rootfs-trixie-{key}.tar"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    subprocess.run(["mmdebstrap", "--quiet", "--mode=root", "--variant=minbase",
                    "--format=tar", "--include=" + ",".join(packages),
                    "--dpkgopt=path-exclude=/usr/share/doc/*",
                    "--dpkgopt=path-exclude=/usr/share/man/*",
                    "trixie", str(tmp), f"deb {MIRROR} trixie main"], check=True)
    tmp.replace(out)
    return out


def unpack(tar: Path, root: Path) -> None:
    root.mkdir(parents=True)
    subprocess.run(["tar", "-xf", str(tar), "-C", str(root), "--numeric-owner"], check=True)


def host_ca() -> Path | None:
    for c in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
              "/etc/ssl/certs/ca-certificates.crt"):
        if c and Path(c).is_file():
            return Path(c)
    return None

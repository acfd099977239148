"""Container images from local files: Debian rootfs tarballs and docker-archive images.

- ``build_rootfs``: a Debian ``SUITE`` minbase rootfs made by ``mmdebstrap`` from Debian
  packages, as a tar in the project cache keyed by suite, mirror and package list;
- ``files_layer`` / ``tar_add``: deterministic layer tars (mtime 0, owned by root);
- ``docker_load``: an image of uncompressed layers and an image config we write
  ourselves, loaded with ``docker load``.

Standard library only, so that ``python3 sandbox/runtimes/imagefiles.py rootfs`` can build
the kind node's and the agent's rootfs tarballs before anything is installed (the test
command runs it in parallel with the Kubernetes build).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

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

Progress = Callable[[str], None]



def cache_root() -> Path:
    base = os.environ.get("HWSANDBOX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hw-sandbox")
    return Path(base)


class BuildError(Exception):
    """A step of an image build failed; the message names the step and what to do."""


def say(message: str) -> None:
    print(f"[kind-image {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_tool(argv: list[str], step: str, *, stdin: Any = None, input_bytes: bytes | None = None,
         capture: bool = True) -> str:
    try:
        proc = subprocess.run(argv, stdin=stdin, input=input_bytes, check=False,
                              stdout=subprocess.PIPE if capture else None,
                              stderr=subprocess.PIPE)
    except FileNotFoundError as exc:
        raise BuildError(f"{step}: {argv[0]} not found") from exc
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-6:])
        raise BuildError(f"{step}: `{' '.join(argv[:4])} ...` exited {proc.returncode}: {tail}")
    return proc.stdout.decode(errors="replace") if capture else ""


# --- rootfs ---------------------------------------------------------------------------------

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
        raise BuildError("rootfs: mmdebstrap not found (Debian: apt-get install mmdebstrap)")
    if os.geteuid() != 0:
        raise BuildError("rootfs: mmdebstrap runs as root here (run the build as root)")
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
        run_tool(argv, f"rootfs {name}", capture=False)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    progress(f"rootfs {name}: {out.stat().st_size >> 20} MiB in "
             f"{time.monotonic() - started:.0f}s -> {out}")
    return out


# --- docker-archive images (docker load): full control of the image config --------------------

def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def docker_load(ref: str, layers: list[Path | bytes], config: dict[str, Any]) -> None:
    """``docker load`` an image made of uncompressed layer tars and an image config."""
    diff_ids = [hashlib.sha256(layer).hexdigest() if isinstance(layer, bytes)
                else _sha256_file(layer) for layer in layers]
    image_config = {
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in diff_ids]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "hw-sandbox"}
                    for _ in layers],
    }
    config_bytes = json.dumps(image_config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [ref],
                 "Layers": [f"{d}/layer.tar" for d in diff_ids]}]
    # Written to a file first, then `docker load -i`: one plain command, no pipe to babysit.
    with tempfile.NamedTemporaryFile(prefix="hwsb-image-", suffix=".tar",
                                     dir=cache_root()) as archive:
        with tarfile.open(fileobj=archive, mode="w") as tar:
            tar_add(tar, config_name, config_bytes)
            for digest, layer in zip(diff_ids, layers, strict=True):
                tar_add(tar, f"{digest}/layer.tar", layer)
            tar_add(tar, "manifest.json", json.dumps(manifest).encode())
        archive.flush()
        run_tool(["docker", "load", "--quiet", "-i", archive.name], f"docker load {ref}")


def image_label(ref: str, label: str) -> str | None:
    """A label of a local image; None when the image is absent."""
    proc = subprocess.run(["docker", "image", "inspect", ref, "--format",
                           f'{{{{index .Config.Labels "{label}"}}}}'],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def tar_add(tar: tarfile.TarFile, name: str, data: bytes | Path) -> None:
    """One regular file in ``tar``, streamed from ``data`` (bytes, or a file here)."""
    info = tarfile.TarInfo(name)
    if isinstance(data, bytes):
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        info.size = data.stat().st_size
        with data.open("rb") as f:
            tar.addfile(info, f)


def files_layer(files: dict[str, bytes | Path], executables: set[str] | None = None) -> bytes:
    """A deterministic layer tar (parents included, mtime 0, owned by root) of ``files``:
    path in the image -> bytes or a file here. A file here that is a symlink stays one.
    Mode 0755 for paths in ``executables`` (None: a file here keeps its own x bit)."""
    buf = io.BytesIO()
    dirs: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files, key=lambda n: n.strip("/")):
            parts = name.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                    tar.addfile(info)
            content = files[name]
            info = tarfile.TarInfo(name.strip("/"))
            info.mtime = 0
            if isinstance(content, Path) and content.is_symlink():
                info.type, info.linkname, info.mode = (tarfile.SYMTYPE, os.readlink(content),
                                                       0o777)
                tar.addfile(info)
                continue
            if executables is None:
                executable = isinstance(content, Path) and os.access(content, os.X_OK)
            else:
                executable = name in executables
            info.mode = 0o755 if executable else 0o644
            data = content.read_bytes() if isinstance(content, Path) else content
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="imagefiles", description="Build the Debian rootfs tarballs of the kind node "
        "and the sandbox agent images into the project cache (re-running is a no-op).")
    parser.add_argument("what", choices=("rootfs",))
    parser.parse_args(argv)
    try:
        # the two mmdebstrap runs are mostly downloads and dpkg: run them side by side
        with __import__("concurrent.futures").futures.ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(build_rootfs, "node", NODE_PACKAGES),
                    pool.submit(build_rootfs, "agent", AGENT_PACKAGES)]
            for job in jobs:
                job.result()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Layer 2 of the sandbox image: its Python dependencies under /opt/hw-sandbox/site, built by
the image's own interpreter, whatever Python runs ``sandbox`` (any >= 3.11).

The image runs Debian ``SUITE``'s python3 (``PYTHON``); the compiled dependencies (grpcio,
pydantic-core, PyYAML, pyfuse3 with our patch) must match it. They are installed by that
python3 in a build rootfs: the agent's Debian plus pip and a compiler
(``rootfs.BUILD_PACKAGES``, made once by mmdebstrap and cached), unpacked into a scratch
directory and entered with ``chroot`` (nothing mounted into it). There:

    python3 -m pip install --target /hwsb/site  (the requirements)
    scripts/build-pyfuse3 --wheel-only python3  (the patched pyfuse3 wheel, cp311, cached)

Why a build rootfs rather than ``pip download --python-version 3.11 --platform ...`` on the
host: pyfuse3 is published as an sdist only and has to be compiled against the image's
Python and libfuse anyway, the host may have no pip at all (Debian 13, Ubuntu 24.04), and a
Debian rootfs is what the offline image is made of already (mmdebstrap, root).

The layer is cached as ``agent-image/deps-py311-<key>.tar``: named by the IMAGE's Python,
keyed by the build rootfs, the requirement set, the pyfuse3 patch and build script, and
what is left out. The host's Python plays no part in it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
import tomllib
from importlib import metadata
from pathlib import Path

from sandbox.cache import cache_root
from sandbox.commands import run
from sandbox.errors import CommandError, RuntimeBackendError, SandboxError
from sandbox.images.rootfs import (
    BUILD_PACKAGES,
    PYTHON,
    SUITE,
    build_rootfs,
    rootfs_key,
    say,
)
from sandbox.images.tarfiles import layer_tar
from sandbox.progress import Progress

SITE = "opt/hw-sandbox/site"
_CHECKOUT = Path(__file__).resolve().parents[2]
_PYFUSE3 = ("build-pyfuse3", "pyfuse3-hwsandbox.patch")
# our pyfuse3 patch and its build script: a checkout's scripts/, else the copies an
# installed sandbox ships (package data sandbox.data.pyfuse3); the same files either way,
# so the layer's key is the same from a checkout and from an install
_SCRIPTS = next((d for d in (_CHECKOUT / "scripts",
                             Path(__file__).resolve().parents[1] / "data" / "pyfuse3")
                 if all((d / name).is_file() for name in _PYFUSE3)), _CHECKOUT / "scripts")

# Parts of the dependencies nothing in the image imports, left out of the layer: the
# kubernetes client's asyncio copy (40 MB of its 74; `import kubernetes` never loads it)
# and its tests. Every node unpacks the image while kubeadm runs: each MB costs there.
_LEFT_OUT = ("kubernetes/aio/", "kubernetes/e2e_test/", "kubernetes/test/")

# Run inside the build rootfs as /hwsb/build.sh REQUIREMENT...; stdout/stderr come back in
# the error when it fails.
BUILD_SCRIPT = """\
set -eu
python3 - "$HWSB_PYTHON" <<'EOF'
import sys
have = "%d.%d" % sys.version_info[:2]
if have != sys.argv[1]:
    sys.exit(f"the build rootfs's python3 is {have}, the image's is {sys.argv[1]}")
EOF
if [ -x /hwsb/scripts/build-pyfuse3 ]; then
    wheel="$(HWSANDBOX_CACHE=/hwsb/cache /hwsb/scripts/build-pyfuse3 --wheel-only python3)"
    set -- "$@" "$wheel"
fi
exec python3 -m pip install --quiet --disable-pip-version-check --no-compile \\
    --break-system-packages --no-warn-script-location --target /hwsb/site "$@"
"""

_PASSED_ENV = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY",
               "NO_PROXY", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST",
               "PIP_DEFAULT_TIMEOUT")
# The host's trust store goes in (a proxy that re-signs TLS has its CA there, not in
# Debian's ca-certificates): the first of these that is a file.
_CA_ENV = ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")
_CA_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
             "/etc/ssl/cert.pem")


def requirements() -> list[str]:
    """The project's runtime dependencies (no extras), as pip requirement strings: from
    pyproject.toml in a checkout (nothing need be installed: the test command builds the
    layer before it installs the project), else from the installed distribution."""
    pyproject = _CHECKOUT / "pyproject.toml"
    if pyproject.is_file():
        return sorted(tomllib.loads(pyproject.read_text())["project"]["dependencies"])
    reqs = metadata.requires("hw-sandbox") or []
    return sorted(r for r in reqs if "extra ==" not in r)


def _left_out(relative: str) -> bool:
    return relative.startswith(_LEFT_OUT) or (
        relative.startswith("kubernetes/") and relative.endswith("_test.py"))


def _patched() -> bool:
    """pyfuse3 is built with our patch (without the files, from PyPI's sdist, so the agent
    serves without the fast no-open mode and says so, once)."""
    return all((_SCRIPTS / name).is_file() for name in _PYFUSE3)


def layer_path() -> Path:
    """Where the layer for this requirement set is cached (built or not)."""
    reqs = requirements()
    keyed = [PYTHON, SUITE, rootfs_key(BUILD_PACKAGES), BUILD_SCRIPT, *_LEFT_OUT]
    if _patched():
        reqs = [r for r in reqs if not r.lower().startswith("pyfuse3")]
        keyed += [hashlib.sha256((_SCRIPTS / n).read_bytes()).hexdigest() for n in _PYFUSE3]
    key = hashlib.sha256("\n".join([*keyed, *reqs]).encode()).hexdigest()[:12]
    return cache_root() / "agent-image" / f"deps-py{PYTHON.replace('.', '')}-{key}.tar"


def deps_layer(progress: Progress) -> Path:
    """Layer 2: the dependencies under /opt/hw-sandbox/site, as a deterministic tar."""
    out = layer_path()
    if out.is_file():
        return out
    reqs = requirements()
    if _patched():
        reqs = [r for r in reqs if not r.lower().startswith("pyfuse3")]
    build_tar = build_rootfs("build", BUILD_PACKAGES, progress)
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hwsb-deps-", dir=out.parent) as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        progress(f"deps: unpacking the build rootfs ({build_tar.stat().st_size >> 20} MiB)")
        run(["tar", "-xf", str(build_tar), "-C", str(root), "--numeric-owner"],
            step="image", timeout=None)
        _prepare(root)
        progress(f"deps: installing the image's Python dependencies with its python3 "
                 f"{PYTHON} ({len(reqs)} packages"
                 f"{' + pyfuse3 with our patch' if _patched() else ''}; a minute or two)")
        env = {k: v for k, v in os.environ.items() if k in _PASSED_ENV}
        env.update(PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   HOME="/root", LANG="C.UTF-8", HWSB_PYTHON=PYTHON)
        if (root / "hwsb" / "ca.pem").is_file():
            env["PIP_CERT"] = "/hwsb/ca.pem"
        # a plain chroot, nothing mounted: pip and gcc need no /proc, and it works where
        # mount namespaces cannot be made private (in a chroot, in some containers)
        argv = ["chroot", str(root), "/bin/sh", "/hwsb/build.sh", *reqs]
        try:
            run(argv, step="image", env=env, timeout=None)
        except CommandError as exc:
            tail = " | ".join(exc.output.strip().splitlines()[-3:])
            raise RuntimeBackendError("image", "installing the image's dependencies in its "
                                      f"build rootfs failed: {tail}") from exc
        _keep_wheels(root)
        site = root / "hwsb" / "site"
        files = {f"{SITE}/{p.relative_to(site).as_posix()}": p
                 for p in sorted(site.rglob("*"))
                 if (p.is_file() or p.is_symlink()) and "__pycache__" not in p.parts
                 and not _left_out(p.relative_to(site).as_posix())}
        partial = Path(tmp) / "layer.tar"
        partial.write_bytes(layer_tar(files))
        partial.replace(out)
    progress(f"deps: {out.stat().st_size >> 20} MiB in {time.monotonic() - started:.0f}s "
             f"-> {out}")
    return out


def _wheel_cache() -> Path:
    return cache_root() / "agent-image" / "build"


def _prepare(root: Path) -> None:
    """The build script, our pyfuse3 patch and script, the cached wheel, the host's CA
    bundle and DNS in ``root``."""
    hwsb = root / "hwsb"
    (hwsb / "site").mkdir(parents=True)
    (hwsb / "build.sh").write_text(BUILD_SCRIPT)
    if _patched():
        (hwsb / "scripts").mkdir()
        for name in _PYFUSE3:
            shutil.copy(_SCRIPTS / name, hwsb / "scripts" / name)
        (hwsb / "scripts" / "build-pyfuse3").chmod(0o755)
    # the wheel built by an earlier run (copied, not bind-mounted: nothing of the host's
    # stays mounted in a tree that is removed afterwards)
    if _wheel_cache().is_dir():
        shutil.copytree(_wheel_cache(), hwsb / "cache", symlinks=True)
    cas = [os.environ.get(k, "") for k in _CA_ENV] + list(_CA_FILES)
    ca = next((Path(c) for c in cas if c and Path(c).is_file()), None)
    if ca is not None:
        shutil.copyfile(ca, hwsb / "ca.pem")
    resolv = root / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    if Path("/etc/resolv.conf").exists():
        shutil.copyfile("/etc/resolv.conf", resolv)


def _keep_wheels(root: Path) -> None:
    built = root / "hwsb" / "cache"
    if built.is_dir():
        shutil.copytree(built, _wheel_cache(), symlinks=True, dirs_exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    """``python3 -m sandbox.images.deps``: the layer into the cache before anything is
    installed (stdlib only, like ``sandbox.images.rootfs``; the test command runs both in
    parallel with the Kubernetes build)."""
    argparse.ArgumentParser(
        prog="python3 -m sandbox.images.deps", description="Build the sandbox image's "
        "dependency layer (and the build rootfs it needs) into the project cache "
        "(re-running is a no-op).").parse_args(argv)
    try:
        deps_layer(say)
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

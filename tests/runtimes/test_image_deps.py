"""The sandbox image's dependency layer (sandbox.images.deps) is built by the image's own
python3, whatever Python runs ``sandbox``: built here from a Debian 13 (trixie) chroot, whose
python3 is 3.13 (like a user on Debian 13; ubuntu-24.04 has 3.12), the layer is named for
the image's Python, holds cp311 extension modules only, and imports under the image's
python3 (the agent rootfs with the layer on top).

Needs root, mmdebstrap, a Debian mirror and PyPI (the trixie rootfs is cached under the
project cache; the build rootfs and the patched pyfuse3 wheel are taken from it when there).
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from sandbox.cache import cache_root
from sandbox.images.deps import SITE, layer_path
from sandbox.images.rootfs import (
    AGENT_PACKAGES,
    BUILD_PACKAGES,
    PYTHON,
    build_rootfs,
)
from tests.support.paths import REPO
from tests.support.trixie import host_ca, need_root_tools, trixie_rootfs, unpack

pytestmark = [pytest.mark.root, pytest.mark.network]

TRIXIE_PACKAGES = ["python3", "python3-venv", "util-linux", "mount", "tar"]
IMPORTS = "import pyfuse3, grpc, yaml, pydantic, kubernetes, trio"
# what `pip install -e` of the checkout needs (pyproject's packages and package-dir)
SOURCES = ["pyproject.toml", "README.md", "sandbox", "plugins", "kind-config", "profiles",
           "scripts/build-pyfuse3", "scripts/pyfuse3-hwsandbox.patch"]
# enter ROOT with /proc mounted, in a private mount namespace (gone when the command ends)
ENTER = ('set -e; mount -t proc proc "$1/proc"; '
         'if [ -n "$2" ]; then mount --bind "$2" "$1/cache/kind"; fi; '
         'root="$1"; shift 2; exec chroot "$root" "$@"')


def _chroot(root: Path, argv: list[str], env: dict[str, str],
            bind_kind: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh",
                           "-c", ENTER, "sh", str(root), str(bind_kind or ""), *argv],
                          env=env, capture_output=True, text=True, check=False,
                          stdin=subprocess.DEVNULL)


def test_deps_layer_from_a_python_3_13_host_is_cp311_and_imports(tmp_path: Path) -> None:
    need_root_tools()
    build_rootfs("build", BUILD_PACKAGES, print)  # cached: shared with the trixie chroot
    agent_rootfs = build_rootfs("agent", AGENT_PACKAGES, print)

    # a Debian 13 host: its python3, a venv with the checkout installed (no deps: the
    # image's dependencies are what is being built), the project cache of its own
    host = tmp_path / "trixie"
    unpack(trixie_rootfs(TRIXIE_PACKAGES), host)
    src = host / "src"
    for name in SOURCES:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    (host / "cache" / "kind").mkdir(parents=True)
    wheels = cache_root() / "agent-image" / "build"
    if wheels.is_dir():  # the patched pyfuse3 wheel, built in the bookworm build rootfs
        shutil.copytree(wheels, host / "cache" / "agent-image" / "build")
    shutil.copyfile("/etc/resolv.conf", host / "etc" / "resolv.conf", follow_symlinks=True)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "HWSANDBOX_CACHE": "/cache"}
    ca = host_ca()
    if ca is not None:
        shutil.copyfile(ca, host / "ca.pem")
        env["PIP_CERT"] = "/ca.pem"
    script = (
        "set -e; python3 -c 'import sys; print(sys.version_info[:2])'; "
        "python3 -m venv /venv; /venv/bin/pip install -q --no-deps -e /src; "
        "cd /src && /venv/bin/python -c "
        "'from sandbox.images.deps import deps_layer; print(deps_layer(print))'")
    done = _chroot(host, ["/bin/sh", "-c", script], env, cache_root() / "kind")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "(3, 13)", done.stdout
    made = Path(done.stdout.strip().splitlines()[-1])
    # named and keyed by the image's Python: the name a 3.11 host computes for it
    assert made.name == layer_path().name, (made.name, layer_path().name)
    assert made.name.startswith(f"deps-py{PYTHON.replace('.', '')}-"), made.name
    layer = host / made.relative_to("/")

    with tarfile.open(layer) as tar:
        names = tar.getnames()
    ext = [n for n in names if n.endswith(".so") and not n.endswith(".abi3.so")]
    assert any(n.startswith(f"{SITE}/pyfuse3/") for n in ext), ext
    assert any(n.startswith(f"{SITE}/grpc/") for n in ext), ext
    assert all(n.endswith(".cpython-311-x86_64-linux-gnu.so") for n in ext), ext

    # the image: the agent rootfs with the layer on top, its python3 imports everything
    image = tmp_path / "image"
    unpack(agent_rootfs, image)
    subprocess.run(["tar", "-xf", str(layer), "-C", str(image), "--numeric-owner"],
                   check=True)
    probe = (f"{IMPORTS}; import sys; print(sys.version_info[:2], "
             "getattr(pyfuse3, 'HWSANDBOX_PATCH', 0))")
    done = _chroot(image, ["/usr/bin/python3", "-c", probe],
                   {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": f"/{SITE}",
                    "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    version, patch = done.stdout.strip().rsplit(" ", 1)
    assert version == "(3, 11)", done.stdout
    assert int(patch) >= 1, done.stdout  # our patched pyfuse3, not PyPI's

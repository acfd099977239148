"""Helpers for tests that run real, unmodified programs against a live fake node.

- ``plugin_binary(name)``: the third-party plugin built by scripts/build-plugins (built on
  first use, cached outside the repository); FAILS with a hint when Go is missing.
- ``live_node(profile, node)``: the node's tree mounted over FUSE by ``sandbox mount`` in a
  short directory under /tmp, with its control socket; unmounted and reaped on exit.
- ``in_private_mounts(argv, [Tmpfs(...), Bind(...)])``: argv that runs ``argv`` in a private
  mount namespace (``unshare -m --propagation private``) where the fake tree's directories
  are bind-mounted over the real paths a plugin hard-codes (/sys, /dev,
  /var/lib/kubelet/device-plugins). Nothing outside that namespace changes: the real /sys
  and /dev are never written.
- ``running_plugin(argv, log)``: ``argv`` run with its output in ``log`` for the duration
  of a block, then stopped (SIGTERM, 10 s, SIGKILL).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandbox import supervisor
from sandbox.agent import spawn_node, unmount, wait_unmounted
from sandbox.fakehw.control import ControlClient
from tests.support.paths import REPO

PROFILES = REPO / "profiles"
BUILD_PLUGINS = REPO / "scripts" / "build-plugins"
KUBELET_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"

# name -> binary file name, as scripts/build-plugins lays them out
BINARIES = {
    "sample-device-plugin": "sample-device-plugin",
    "intel-gpu-plugin": "gpu_plugin",
    "intel-fpga-plugin": "fpga_plugin",
    "intel-qat-plugin": "qat_plugin",
    "dra-example-driver": "dra-example-kubeletplugin",
    "dra-driver-cpu": "dracpu",
    "sriov-network-device-plugin": "sriovdp",
}

_GO_HINT = (
    "the Go toolchain (>= 1.26) is needed to build the third-party device plugins these "
    "tests run: install Go (https://go.dev/doc/install) and put it on PATH, or set GO=/path/go; "
    "then `scripts/build-plugins` builds them once into ${HWSANDBOX_CACHE:-~/.cache/hw-sandbox}"
    "/plugins/"
)


def _go() -> str | None:
    if os.environ.get("GO"):
        return os.environ["GO"]
    found = shutil.which("go")
    if found:
        return found
    return "/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None


def plugin_binary(name: str) -> Path:
    """Build ``name`` with scripts/build-plugins if needed and return its binary."""
    started = time.monotonic()
    result = subprocess.run(
        [str(BUILD_PLUGINS), name], capture_output=True, text=True, check=False, timeout=3600
    )
    if result.returncode != 0:
        if _go() is None:
            pytest.fail(_GO_HINT, pytrace=False)
        pytest.fail(
            f"scripts/build-plugins {name} failed (exit {result.returncode}) after "
            f"{time.monotonic() - started:.0f}s:\n{result.stderr[-3000:]}\n"
            "The build needs the Go module proxy (GOPROXY) and Go >= 1.26; "
            "see the build.log it names.",
            pytrace=False,
        )
    binary = Path(result.stdout.strip().splitlines()[-1])
    assert binary.name == BINARIES[name], result.stdout
    assert os.access(binary, os.X_OK), f"{binary} is not executable"
    return binary


def static_image(binary: Path, ref: str, at: str, data: Mapping[str, Path] | None = None) -> Path:
    """An OCI archive (cached by content) of the static ``binary`` at ``at``, and of the
    files ``data`` maps image paths to, named ``ref``: what a Go plugin built with
    CGO_ENABLED=0 needs."""
    from sandbox.images.oci import PATH, write_archive
    from sandbox.images.tarfiles import layer_tar
    from sandbox.runtimes.native import cache_dir

    files = {at: binary.read_bytes(), **{k: v.read_bytes() for k, v in (data or {}).items()}}
    cache = cache_dir() / "images"
    cache.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256(ref.encode() + at.encode())
    for path, content in sorted(files.items()):
        h.update(path.encode() + b"\0" + hashlib.sha256(content).digest())
    dest = cache / f"{binary.name}-{h.hexdigest()[:16]}.oci.tar"
    if not dest.is_file():
        layer = layer_tar(files, {at}, dirs={"/tmp", "/var", "/var/run", "/etc"})
        write_archive(dest, ref, [layer], {"Env": [PATH], "Cmd": [at]})
    return dest


def require_private_mounts() -> None:
    """FAIL (not skip) when a private mount namespace cannot be made here."""
    if os.geteuid() != 0:
        pytest.fail("these tests bind-mount the fake tree in a private mount namespace: "
                    "run them as root", pytrace=False)  # fmt: skip
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: apt-get install util-linux mount", pytrace=False)


@dataclass(frozen=True)
class Bind:
    source: str
    target: str


@dataclass(frozen=True)
class Tmpfs:
    target: str


def in_private_mounts(
    argv: Sequence[str], mounts: Sequence[Bind | Tmpfs], *, unset_env: Sequence[str] = ()
) -> list[str]:
    """``argv`` run inside ``unshare -m --propagation private`` after making ``mounts`` in
    order. A bind target missing on the host must lie under an earlier ``Tmpfs`` (e.g. a
    tmpfs on /var/lib for /var/lib/kubelet/device-plugins): it is created there, never on
    the host.
    A bind whose source a tmpfs would hide must come before that tmpfs.

    ``sandbox.kubelet.check`` formats every argument: ``{kubelet_dir}`` in a bind source
    becomes the harness's device-plugins directory (so no other braces in paths).
    """
    steps = ["set -e"]
    scratch: list[str] = []
    for m in mounts:
        if isinstance(m, Tmpfs):
            steps.append(f"mount -t tmpfs -o mode=0755 hwsandbox-scratch {shlex.quote(m.target)}")
            scratch.append(m.target)
            continue
        if any(_under(m.target, t) for t in scratch):
            steps.append(f"mkdir -p {shlex.quote(m.target)}")
        steps.append(f"mount --bind {shlex.quote(m.source)} {shlex.quote(m.target)}")
    env = ["env", *(f"--unset={v}" for v in unset_env)] if unset_env else []
    steps.append("exec " + shlex.join([*env, *argv]))
    return ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", "\n".join(steps)]


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


@contextlib.contextmanager
def running_plugin(argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
                   ) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` (stdout and stderr to ``log``) for the duration of the block; stop it on
    exit: SIGTERM, up to 10 s, then SIGKILL and up to 10 s more."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def short_dir(prefix: str) -> Iterator[Path]:
    """A directory under /tmp: gRPC unix socket paths must stay within 105 bytes."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class LiveNode:
    root: Path  # the FUSE mount: root/sys, root/dev, root/proc
    control: Path  # the control socket

    def client(self) -> ControlClient:
        return ControlClient(self.control)


@contextlib.contextmanager
def live_node(profile: str, node: str) -> Iterator[LiveNode]:
    """Mount ``profile``'s ``node`` live; unmount, reap the server and clean up on exit."""
    with short_dir("hwn-") as base, served_node(profile, node, base) as live:
        yield live


@contextlib.contextmanager
def served_node(profile: str, node: str, base: Path) -> Iterator[LiveNode]:
    """Serve ``profile``'s ``node`` at ``base/root`` with its control socket and saved
    states in ``base`` (so a second one on the same ``base`` comes back as the first left
    it); unmount and reap the server on exit."""
    if shutil.which("fusermount3") is None or not os.path.exists("/dev/fuse"):
        pytest.fail("FUSE is needed: apt-get install fuse3 libfuse3-dev pkg-config gcc "
                    "(and /dev/fuse must exist)", pytrace=False)  # fmt: skip
    root = base / "root"
    server = spawn_node(str(PROFILES / profile), node, root, state_dir=base,
                        log_file=base / "mount.log")
    try:
        yield LiveNode(root, base / "control.sock")
    finally:
        try:
            unmount(root)
            assert wait_unmounted(root), f"{root} still mounted"
        finally:
            # It exits once unmounted (detached, not our child); killed if stuck.
            supervisor.stop([server], timeout=10.0)

"""NVIDIA's unmodified device plugin and gpu-feature-discovery on a live fake node, through
our NVML (sandbox/nvml, docs/nvml.md).

- ``nvml_library()``: our libnvidia-ml.so.1, compiled into the cache on first use; FAILS
  with an install hint when gcc is missing.
- ``nvidia_binary(name)``: ``nvidia-device-plugin`` or ``gpu-feature-discovery`` v0.18.0,
  built (with cgo) by scripts/build-plugins into the cache; FAILS with a hint when Go or
  gcc is missing.
- ``nvml_env(live, log)``: the environment that points a process at our library and at
  the node's tree.
- ``nvidia_ctk()``: ``nvidia-ctk`` v1.20.0 (the container toolkit's CLI), built the same way.
- ``write_nvidia_image(dest)``: the image the bundled manifest names
  (``nvcr.io/nvidia/k8s-device-plugin:v0.18.0``) as an OCI archive, made here from those
  two binaries and the glibc they link (there is no registry).
- ``write_dra_image(dest)``: the image plugins/manifests/nvidia-dra-driver.yaml names, from
  NVIDIA's gpu-kubelet-plugin v0.4.1 and nvidia-cdi-hook v1.19.1 (as upstream's image
  carries them) and the glibc they link.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sandbox.images.oci import PATH, write_archive
from sandbox.images.tarfiles import layer_tar
from sandbox.nvml import NvmlBuildError, build
from tests.support.thirdparty import BUILD_PLUGINS, LiveNode

VERSION = "v0.18.0"
IMAGE = f"nvcr.io/nvidia/k8s-device-plugin:{VERSION}"
_HINT = (
    "NVIDIA's programs are built from {m} with cgo: they need Go >= 1.24 "
    "(https://go.dev/doc/install, on PATH or GO=/path/go), gcc and libc6-dev "
    "(apt-get install gcc libc6-dev) and the Go module proxy; `scripts/build-plugins {n}` "
    "builds it once into ${{HWSANDBOX_CACHE:-~/.cache/hw-sandbox}}/plugins/"
)


def tree_gpu_minors(root: Path) -> dict[str, int]:
    """GPU UUID -> device minor, from a node tree's proc/driver/nvidia/gpus/*/information."""
    minors = {}
    for info in (root / "proc/driver/nvidia/gpus").glob("*/information"):
        text = info.read_text()
        uuid = re.search(r"GPU UUID:\s*(\S+)", text)
        minor = re.search(r"Device Minor:\s*(\d+)", text)
        assert uuid, text
        assert minor, text
        minors[uuid.group(1)] = int(minor.group(1))
    return minors


def nvml_library() -> Path:
    try:
        return build()
    except NvmlBuildError as e:
        pytest.fail(str(e), pytrace=False)


DRA_VERSION = "v0.4.1"
DRA_IMAGE = f"localhost/hw-sandbox/nvidia-dra-driver:{DRA_VERSION}"
# scripts/build-plugins name -> (binary, module@version for the hint)
_BUILT = {
    "nvidia-device-plugin": ("nvidia-device-plugin",
                             f"github.com/NVIDIA/k8s-device-plugin@{VERSION}"),
    "gpu-feature-discovery": ("gpu-feature-discovery",
                              f"github.com/NVIDIA/k8s-device-plugin@{VERSION}"),
    "nvidia-dra-driver": ("gpu-kubelet-plugin",
                          f"sigs.k8s.io/dra-driver-nvidia-gpu@{DRA_VERSION}"),
    "nvidia-cdi-hook": ("nvidia-cdi-hook", "github.com/NVIDIA/nvidia-container-toolkit@v1.19.1"),
}


def nvidia_binary(name: str) -> Path:
    binary_name, module = _BUILT[name]
    started = time.monotonic()
    result = subprocess.run([str(BUILD_PLUGINS), name], capture_output=True, text=True,
                            check=False, timeout=3600)  # fmt: skip
    if result.returncode != 0:
        missing = [t for t in ("go", "gcc") if shutil.which(t) is None and not (
            t == "go" and os.environ.get("GO"))]
        note = f" (missing: {', '.join(missing)})" if missing else ""
        pytest.fail(
            f"scripts/build-plugins {name} failed (exit {result.returncode}) after "
            f"{time.monotonic() - started:.0f}s{note}:\n{result.stderr[-3000:]}\n"
            + _HINT.format(m=module, n=name),
            pytrace=False,
        )
    binary = Path(result.stdout.strip().splitlines()[-1])
    assert binary.name == binary_name, result.stdout
    assert os.access(binary, os.X_OK), f"{binary} is not executable"
    return binary


CTK_VERSION = "v1.20.0"


def nvidia_ctk() -> Path:
    """NVIDIA's ``nvidia-ctk`` (github.com/NVIDIA/nvidia-container-toolkit), built with cgo
    by scripts/build-plugins into the cache; FAILS with a hint when it cannot be built."""
    result = subprocess.run([str(BUILD_PLUGINS), "nvidia-ctk"], capture_output=True,
                            text=True, check=False, timeout=3600)  # fmt: skip
    if result.returncode != 0:
        pytest.fail(
            f"scripts/build-plugins nvidia-ctk failed (exit {result.returncode}):\n"
            f"{result.stderr[-3000:]}\nnvidia-ctk is built from "
            f"github.com/NVIDIA/nvidia-container-toolkit@{CTK_VERSION} with cgo: it needs Go "
            ">= 1.24 (on PATH or GO=/path/go), gcc and libc6-dev and the Go module proxy",
            pytrace=False,
        )
    binary = Path(result.stdout.strip().splitlines()[-1])
    assert binary.name == "nvidia-ctk", result.stdout
    return binary


def nvml_env(live: LiveNode, log: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment for a program that should load our NVML and see ``live``'s GPUs."""
    lib = nvml_library()
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(lib.parent),
        "HWSANDBOX_NVML_ROOT": str(live.root),
        **extra,
    }
    if log is not None:
        env["HWSANDBOX_NVML_LOG"] = str(log)
    return env


def _linked(binary: Path) -> dict[str, Path]:
    """The shared objects ``binary`` links and the dynamic loader (ldd), at the paths the
    binary asks for them: NVIDIA's programs are built with cgo."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True,
                         timeout=60).stdout  # fmt: skip
    files: dict[str, Path] = {}
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            files[parts[2]] = Path(parts[2]).resolve()
        elif parts and parts[0].startswith("/"):
            files[parts[0]] = Path(parts[0]).resolve()
    return files


def write_nvidia_image(dest: Path) -> Path:
    """NVIDIA's plugin and GFD binaries (unmodified) with the glibc they link, as the image
    the bundled manifest names: the image is ours, the programs are NVIDIA's. No
    libnvidia-ml.so.1 in it, as upstream (the pods mount ours)."""
    files: dict[str, bytes | Path] = {}
    for name in ("nvidia-device-plugin", "gpu-feature-discovery"):
        binary = nvidia_binary(name)
        files[f"/usr/bin/{name}"] = binary
        files.update(_linked(binary))
    # the loader must be executable, as the kernel execs it
    write_archive(dest, IMAGE, [layer_tar(files, set(files), dirs={"/tmp", "/etc"})],
                  {"Env": [PATH], "Entrypoint": ["/usr/bin/nvidia-device-plugin"]})
    return dest


def write_dra_image(dest: Path) -> Path:
    """NVIDIA's DRA kubelet plugin and the CDI hook its image carries (both unmodified),
    with the glibc they link, and a static busybox for the manifest's shell (upstream's
    image has busybox too), as the image plugins/manifests/nvidia-dra-driver.yaml names.
    No NVML in it: the driver loads ours from the node's driver root."""
    from sandbox.images.pause import BUSYBOX

    if not BUSYBOX.is_file():
        pytest.fail(f"{BUSYBOX} is missing: apt-get install busybox-static "
                    "(scripts/build-k8s installs it)", pytrace=False)
    files: dict[str, bytes | Path] = {"/bin/busybox": BUSYBOX}
    for name in ("nvidia-dra-driver", "nvidia-cdi-hook"):
        binary = nvidia_binary(name)
        files[f"/usr/bin/{binary.name}"] = binary
        files.update(_linked(binary))
    applets = {f"/bin/{a}": "busybox" for a in ("sh", "mount", "ls", "cat")}
    write_archive(dest, DRA_IMAGE, [layer_tar(files, set(files), symlinks=applets,
                                              dirs={"/tmp", "/etc", "/root", "/var/run"})],
                  {"Env": [PATH], "Entrypoint": ["/usr/bin/gpu-kubelet-plugin"]})
    return dest

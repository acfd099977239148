"""The sandbox image: our packages (``sandbox``, ``hwplugins``) on Debian's Python 3.11 + FUSE.

Every pod the kind runtime deploys runs it (the agent serving each node's FUSE tree, our
device plugin and DRA driver). Two ways to make it:

- **offline** (when the agent rootfs tarball of ``rootfs`` is in the cache): an OCI
  archive of three uncompressed layers written here, no Docker build and no registry:

      1. the Debian rootfs (python3, libfuse3, fuse3) by mmdebstrap
      2. the dependencies, installed by the image's own python3 (``deps``)
      3. our two packages

  loaded with ``kind load image-archive``. Node images from ``node`` preload layers 1
  and 2 (they list them in ``PRELOADED_LABEL``); the archive then carries only what the
  node lacks (containerd imports a manifest whose other blobs it already has), so a
  ``sandbox up`` ships a few MiB instead of ~300.
- **registry** (otherwise, or with ``SANDBOX_AGENT_BASE``): ``docker build`` on
  ``python:3.11-slim-bookworm`` (FUSE from apt) or the given base, loaded with ``kind load
  docker-image``; the same layer 2 is copied in (its cp311 wheels fit any CPython 3.11).

``build_agent_base`` makes the offline base for the registry way (``AGENT_BASE_IMAGE``:
the agent rootfs loaded into Docker). The host's Python plays no part in the image: any
Python >= 3.11 can run ``sandbox`` and build it. Everything lands in /opt/hw-sandbox/site
(PYTHONPATH).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sandbox.errors import RuntimeBackendError
from sandbox.images.deps import SITE, deps_layer
from sandbox.images.dockerload import docker_load, image_label
from sandbox.images.oci import PATH, layer_digests, write_archive
from sandbox.images.rootfs import AGENT_PACKAGES, SUITE, build_rootfs, cached_rootfs, say
from sandbox.images.tarfiles import layer_tar
from sandbox.progress import Progress

IMAGE = "hw-sandbox:latest"  # what the manifests name
IMAGE_REF = "docker.io/library/hw-sandbox:latest"  # how containerd's CRI names it
PRELOADED_LABEL = "dev.hwsandbox.preloaded-layers"  # on node images: blobs they carry
REGISTRY_BASE = "python:3.11-slim-bookworm"
ENV = [PATH, f"PYTHONPATH=/{SITE}", "PYTHONDONTWRITEBYTECODE=1"]
AGENT_BASE_IMAGE = f"hw-sandbox/agent-base:{SUITE}"
AGENT_BASE_LABEL = "dev.hwsandbox.agent-base"  # "ready": Debian's Python 3.11 and FUSE
KEY_LABEL = "dev.hwsandbox.build-key"  # on images built here: the key of their inputs


# --- layers -----------------------------------------------------------------------------------

def package_layer() -> bytes:
    """Layer 3: the ``sandbox`` and ``hwplugins`` packages as installed here."""
    import hwplugins

    import sandbox

    files: dict[str, Path] = {}
    for pkg in (sandbox, hwplugins):
        top = Path(pkg.__file__ or "").parent
        for path in sorted(top.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files[f"{SITE}/{top.name}/{path.relative_to(top).as_posix()}"] = path
    return layer_tar(files)


# --- the image --------------------------------------------------------------------------------

@dataclass
class AgentImage:
    """How to get the image into the nodes: an archive for ``kind load image-archive``,
    or a Docker image for ``kind load docker-image``."""

    archive: Path | None
    ref: str
    shipped_bytes: int  # what the load sends to each node

    @property
    def shipped(self) -> str:
        size = self.shipped_bytes
        return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 1024:.0f} KiB"


def offline_layers(progress: Progress) -> list[Path | bytes] | None:
    """Layers 1 and 2 when the agent rootfs is cached (else None: use the registry way)."""
    rootfs = cached_rootfs("agent", AGENT_PACKAGES)
    if rootfs is None:
        return None
    return [rootfs, deps_layer(progress)]


def build(progress: Progress, work: Path, preloaded: frozenset[str]) -> AgentImage:
    """The sandbox image for ``kind load``; ``work`` holds a written archive."""
    base = offline_layers(progress) if not os.environ.get("SANDBOX_AGENT_BASE") else None
    if base is None:
        return _docker_build(progress)
    layers = [*base, package_layer()]
    archive = work / "hw-sandbox-image.oci.tar"
    write_archive(archive, IMAGE_REF, layers,
                  {"Env": ENV, "Labels": {"app.kubernetes.io/part-of": "hw-sandbox"}},
                  omit=preloaded)
    shipped = sum(len(x) if isinstance(x, bytes) else x.stat().st_size
                  for x, d in zip(layers, layer_digests(layers), strict=True)
                  if d not in preloaded)
    return AgentImage(archive, IMAGE_REF, shipped)


def dockerfile(base: str, ready_base: bool) -> str:
    lines = [f"FROM {base}"]
    if not ready_base:
        lines.append("RUN apt-get update && apt-get install -y --no-install-recommends fuse3 "
                     "libfuse3-3 && rm -rf /var/lib/apt/lists/*")
    lines += ["COPY site /opt/hw-sandbox/site",
              *(f"ENV {e}" for e in ENV[1:]),
              'LABEL app.kubernetes.io/part-of="hw-sandbox"']
    return "\n".join(lines) + "\n"


def _docker_build(progress: Progress) -> AgentImage:
    import docker

    client = docker.from_env(timeout=120)
    base = os.environ.get("SANDBOX_AGENT_BASE") or REGISTRY_BASE
    try:
        ready = (client.images.get(base).labels or {}).get(AGENT_BASE_LABEL) == "ready"
    except Exception:  # noqa: BLE001 - not here (yet): the build pulls it
        ready = False
    deps = deps_layer(progress)
    pkg = package_layer()
    text = dockerfile(base, ready)
    tag = "hw-sandbox:" + hashlib.sha256(
        text.encode() + deps.name.encode() + pkg).hexdigest()[:16]
    try:
        image = client.images.get(tag)
    except Exception:  # noqa: BLE001 - not built yet
        progress(f"building the sandbox image on {base}")
        with tempfile.TemporaryDirectory(prefix="hwsb-image-") as ctx:
            for layer in (deps.read_bytes(), pkg):
                with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
                    tar.extractall(Path(ctx) / "layers", filter="tar")
            shutil.move(str(Path(ctx) / "layers" / SITE), Path(ctx) / "site")
            (Path(ctx) / "Dockerfile").write_text(text)
            try:
                image, _logs = client.images.build(path=ctx, tag=tag, rm=True)
            except Exception as exc:  # noqa: BLE001 - docker raises many types
                raise RuntimeBackendError(
                    "image", f"docker build on {base} failed: {str(exc).strip()} (with no "
                    "registry, build the offline base first: scripts/build-kind-node-image)"
                ) from exc
    image.tag(IMAGE)
    size = int(image.attrs.get("Size", 0))
    return AgentImage(None, IMAGE, size)


def build_agent_base(progress: Progress = say) -> str:
    """The sandbox agent's base ``AGENT_BASE_IMAGE``: Debian, Python 3.11 and FUSE."""
    rootfs = build_rootfs("agent", AGENT_PACKAGES, progress)
    key = f"{rootfs.name}+ready"
    if image_label(AGENT_BASE_IMAGE, KEY_LABEL) == key:
        return AGENT_BASE_IMAGE
    progress(f"agent base image: loading {rootfs.name} into Docker")
    docker_load(AGENT_BASE_IMAGE, [rootfs],
                {"Env": [PATH], "Cmd": ["python3"],
                 "Labels": {KEY_LABEL: key, AGENT_BASE_LABEL: "ready"}})
    return AGENT_BASE_IMAGE

"""OCI image tarballs built from local files, for clusters that cannot reach a registry.

``write_image(dest, ref, layer)`` writes an OCI image layout (``oci-layout``, ``index.json``,
``blobs/sha256/...``) as one tar file that ``ctr images import`` accepts; the index entry
carries ``io.containerd.image.name`` so the import names the image ``ref``. ``Layer`` is the
image's single filesystem layer: regular files (bytes or a host file to copy), symlinks
and directories. Output is deterministic (mtime 0, uid/gid 0, sorted entries): the same
input gives the same digest, so a cached tarball is reused only while it is current.

``pause_image`` and ``busybox_image`` are the two images the native runtime needs: our own
pause program (``_pause.c``, compiled here with ``gcc -static``) and Debian's static
busybox with one symlink per applet.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox.errors import CommandError, RuntimeBackendError

PAUSE_SOURCE = Path(__file__).with_name("_pause.c")
BUSYBOX = Path("/bin/busybox")

_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_LAYER = "application/vnd.oci.image.layer.v1.tar"
_INDEX = "application/vnd.oci.image.index.v1+json"


@dataclass
class Layer:
    """One image layer; paths are absolute inside the image."""

    files: dict[str, bytes | Path] = field(default_factory=dict)
    executables: set[str] = field(default_factory=set)
    symlinks: dict[str, str] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)

    def to_tar(self) -> bytes:
        entries: dict[str, tarfile.TarInfo] = {}
        payload: dict[str, bytes] = {}

        def add_dir(path: str) -> None:
            parts = path.strip("/").split("/")
            for i in range(1, len(parts) + 1):
                name = "/".join(parts[:i])
                if name and name not in entries:
                    info = tarfile.TarInfo(name)
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o1777 if name == "tmp" else 0o755
                    entries[name] = info

        for d in self.dirs:
            add_dir(d)
        for path, content in self.files.items():
            add_dir(os.path.dirname(path))
            data = content.read_bytes() if isinstance(content, Path) else content
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size = len(data)
            info.mode = 0o755 if path in self.executables else 0o644
            entries[info.name] = info
            payload[info.name] = data
        for path, target in self.symlinks.items():
            add_dir(os.path.dirname(path))
            info = tarfile.TarInfo(path.lstrip("/"))
            info.type = tarfile.SYMTYPE
            info.linkname = target
            info.mode = 0o777
            entries[info.name] = info

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(entries):
                info = entries[name]
                info.mtime = 0
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                body = payload.get(name)
                tar.addfile(info, io.BytesIO(body) if body is not None else None)
        return buf.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"digest": digest, "size": len(data)}


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_image(
    dest: Path,
    ref: str,
    layer: Layer,
    entrypoint: list[str] | None = None,
    cmd: list[str] | None = None,
    env: list[str] | None = None,
) -> str:
    """Write ``ref``'s OCI archive to ``dest``; return the manifest digest."""
    blobs: dict[str, bytes] = {}
    layer_tar = layer.to_tar()
    layer_desc = {"mediaType": _LAYER, **_blob(blobs, layer_tar)}
    config: dict[str, Any] = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {
            "Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            **({"Entrypoint": entrypoint} if entrypoint else {}),
            **({"Cmd": cmd} if cmd else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
    }
    config_desc = {"mediaType": _CONFIG, **_blob(blobs, _json(config))}
    manifest = {
        "schemaVersion": 2,
        "mediaType": _MANIFEST,
        "config": config_desc,
        "layers": [layer_desc],
    }
    manifest_desc = {"mediaType": _MANIFEST, **_blob(blobs, _json(manifest))}
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": _INDEX,
        "manifests": [
            {
                **manifest_desc,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": ref,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    files = {
        "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
        "index.json": _json(index),
        **{f"blobs/sha256/{d.split(':', 1)[1]}": data for d, data in blobs.items()},
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, mode="w") as tar:
        for dirname in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(dirname)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        for name in sorted(files):
            data = files[name]
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(dest)
    return str(manifest_desc["digest"])


def compile_pause(cache: Path) -> Path:
    """Our pause program, compiled once per source version into ``cache``."""
    source = PAUSE_SOURCE.read_bytes()
    out = cache / f"pause-{hashlib.sha256(source).hexdigest()[:16]}"
    if out.is_file():
        return out
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeBackendError(
            "pause image", "gcc not found (run scripts/build-k8s to install gcc and libc6-dev)"
        )
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    argv = [gcc, "-static", "-Os", "-s", "-o", str(tmp), str(PAUSE_SOURCE)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CommandError(argv, proc.returncode, proc.stdout + proc.stderr)
    tmp.replace(out)
    return out


def pause_image(cache: Path, ref: str) -> Path:
    """The pod sandbox image: just ``/pause``."""
    binary = compile_pause(cache)
    dest = cache / f"{binary.name}-{hashlib.sha256(ref.encode()).hexdigest()[:8]}.oci.tar"
    if not dest.is_file():
        layer = Layer(files={"/pause": binary}, executables={"/pause"})
        write_image(dest, ref, layer, entrypoint=["/pause"])
    return dest


def busybox_image(cache: Path, ref: str) -> Path:
    """A workload image: Debian's static busybox, ``/bin/<applet>`` -> busybox."""
    if not BUSYBOX.is_file():
        raise RuntimeBackendError(
            "busybox image", f"{BUSYBOX} not found (run scripts/build-k8s: busybox-static)"
        )
    data = BUSYBOX.read_bytes()
    dest = cache / f"busybox-{hashlib.sha256(data + ref.encode()).hexdigest()[:16]}.oci.tar"
    if dest.is_file():
        return dest
    listing = subprocess.run(
        [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    layer = Layer(
        files={
            "/bin/busybox": data,
            "/etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n",
            "/etc/group": b"root:x:0:\nnogroup:x:65534:\n",
        },
        executables={"/bin/busybox"},
        symlinks={f"/bin/{applet}": "busybox" for applet in listing if applet != "busybox"},
        dirs={"/tmp", "/root", "/dev", "/proc", "/sys", "/etc", "/var"},
    )
    write_image(dest, ref, layer, cmd=["sh"])
    return dest

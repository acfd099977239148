"""The one writer of OCI image archives: an image layout (``oci-layout``, ``index.json``,
``blobs/sha256/...``) as one tar file for ``ctr images import`` (what the native runtime
runs, and ``kind load image-archive``).

The index entry carries ``io.containerd.image.name``, so the import names the image
``ref``. Layers are uncompressed tars (``tarfiles.layer_tar``, or a tar file here such as
a rootfs); their digests are cached beside files (``layer_digests``: a rootfs is hashed
once). Blobs in ``omit`` are left out: an importer that already has them (a node image
that preloads them) takes the manifest without them. Output is deterministic.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandbox.images.tarfiles import digest, size, tar_add

PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_LAYER = "application/vnd.oci.image.layer.v1.tar"
_INDEX = "application/vnd.oci.image.index.v1+json"


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def layer_digests(layers: Sequence[Path | bytes]) -> list[str]:
    """Digests of uncompressed layers (cached beside files: a rootfs is hashed once)."""
    out = []
    for layer in layers:
        if isinstance(layer, Path):
            stamp = layer.with_name(layer.name + ".sha256")
            if stamp.is_file() and stamp.stat().st_mtime >= layer.stat().st_mtime:
                out.append(stamp.read_text().strip())
                continue
            found = digest(layer)
            stamp.write_text(found + "\n")
            out.append(found)
        else:
            out.append(digest(layer))
    return out


def write_archive(dest: Path, ref: str, layers: Sequence[Path | bytes], config: dict[str, Any],
                  omit: frozenset[str] = frozenset()) -> str:
    """Write the OCI archive of image ``ref`` (``layers`` bottom first, ``config`` the image
    config's ``config``: Env, Entrypoint, Cmd, Labels...) to ``dest``, atomically; return
    the manifest's digest."""
    digests = layer_digests(layers)
    image_config = _json({
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": config, "rootfs": {"type": "layers", "diff_ids": digests},
    })
    manifest = _json({
        "schemaVersion": 2, "mediaType": _MANIFEST,
        "config": {"mediaType": _CONFIG, "digest": digest(image_config),
                   "size": len(image_config)},
        "layers": [{"mediaType": _LAYER, "digest": d, "size": size(x)}
                   for d, x in zip(digests, layers, strict=True)],
    })
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = _json({"schemaVersion": 2, "mediaType": _INDEX, "manifests": [{
        "mediaType": _MANIFEST, "digest": digest(manifest), "size": len(manifest),
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": tag},
    }]})
    blobs: dict[str, Path | bytes] = {digest(image_config): image_config,
                                      digest(manifest): manifest}
    blobs.update((d, x) for d, x in zip(digests, layers, strict=True) if d not in omit)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        with tarfile.open(tmp, "w") as tar:
            tar_add(tar, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
            tar_add(tar, "index.json", index)
            for name in ("blobs", "blobs/sha256"):
                info = tarfile.TarInfo(name)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            for blob in sorted(blobs):
                tar_add(tar, f"blobs/sha256/{blob.split(':', 1)[1]}", blobs[blob])
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return digest(manifest)

"""Images loaded into Docker from local files (the kind node image's base, the agent's base
image): a docker-archive of uncompressed layers and an image config written here, then
``docker load``; and the labels of local images (how a cached build is recognised)."""

from __future__ import annotations

import hashlib
import json
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from sandbox.cache import cache_root
from sandbox.commands import run
from sandbox.images.tarfiles import digest, tar_add


def docker_load(ref: str, layers: list[Path | bytes], config: dict[str, Any]) -> None:
    """``docker load`` an image made of uncompressed layer tars and an image config."""
    diff_ids = [digest(layer).split(":", 1)[1] for layer in layers]
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
            for diff_id, layer in zip(diff_ids, layers, strict=True):
                tar_add(tar, f"{diff_id}/layer.tar", layer)
            tar_add(tar, "manifest.json", json.dumps(manifest).encode())
        archive.flush()
        run(["docker", "load", "--quiet", "-i", archive.name], step=f"docker load {ref}",
            timeout=None)


def image_label(ref: str, label: str) -> str | None:
    """A label of a local image; None when the image is absent."""
    done = run(["docker", "image", "inspect", ref, "--format",
                f'{{{{index .Config.Labels "{label}"}}}}'], check=False, timeout=None)
    return done.stdout.strip() if done.returncode == 0 else None


def image_id(ref: str) -> str:
    """The id of a local image; "" when it is absent."""
    done = run(["docker", "image", "inspect", "-f", "{{.Id}}", ref], check=False, timeout=None)
    return done.stdout.strip()


def remove(*argv: str) -> None:
    """``docker rm``/``rmi`` of what a build leaves behind; gone already is no error."""
    run(["docker", *argv], check=False, timeout=None)

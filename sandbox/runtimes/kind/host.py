"""What the kind runtime needs to know of, and undo on, this host: the Docker host's facts
for the kind config (``host_facts``), the mounts below a directory and their lazy
unmount, the Docker volumes of a cluster's nodes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandbox.cache import cache_root
from sandbox.commands import run
from sandbox.errors import SandboxError
from sandbox.images.node import KIND_VERSION, SHAPE_LABEL
from sandbox.runtimes.kind.api import KIND_TIMEOUT, docker_client
from sandbox.runtimes.kind.config import HostFacts


def no_kind() -> str:
    """Why kind cannot run for want of a binary, and the one thing to do about it."""
    built = cache_root() / "tools" / f"kind-{KIND_VERSION}" / "kind"
    if built.is_file():
        return f"no kind on PATH; the test tooling built one: export PATH={built.parent}:$PATH"
    return f"no kind on PATH; install it with `go install sigs.k8s.io/kind@{KIND_VERSION}`"


def localdocker_client() -> bool:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    return host.startswith("unix://")


def caps_missing() -> bool:
    """This machine's capability bounding set lacks one the kernel has (CI VMs)."""
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapBnd:"):
                want = (1 << (last + 1)) - 1
                return int(line.split()[1], 16) & want != want
    except (OSError, ValueError):
        pass
    return False


def host_facts(client: Any, image: str, info: Mapping[str, Any] | None = None) -> HostFacts:
    """What the config needs from the Docker host (``info``: its ``docker info`` if the
    caller has it already) and from the node image's labels."""
    info = client.info() if info is None else info
    labels: dict[str, str] = {}
    with contextlib.suppress(Exception):
        labels = client.images.get(image).labels or {}
    return HostFacts(cgroup_v1=str(info.get("CgroupVersion", "2")) == "1",
                     restrict_oom=localdocker_client() and caps_missing(),
                     minimal=labels.get(SHAPE_LABEL) == "minimal")


def propagation(path: Path) -> str:
    out = run(["findmnt", "-n", "-o", "PROPAGATION", "--target", str(path)], check=False,
              timeout=None).stdout.split()
    return out[0] if out else ""


def _findmnt(*args: str) -> list[list[str]]:
    out = run(["findmnt", "-rn", *args], check=False, timeout=None).stdout.splitlines()
    return [[f.replace("\\x20", " ") for f in line.split(" ")] for line in out]


def mounts_under(path: Path) -> list[str]:
    """Mounts at or below ``path``, and bind mounts of a directory below it made elsewhere
    (Docker's bidirectional binds can surface on the host at the node's volume path:
    same device, a filesystem root inside ``path``), deepest first."""
    prefix = str(path).rstrip("/") + "/"
    found = {t for t, *_ in _findmnt("-o", "TARGET") if t == str(path) or t.startswith(prefix)}
    holder = _findmnt("-o", "TARGET,FSROOT,MAJ:MIN", "--target", str(path))
    # (only when ``path`` lies inside its filesystem: were it a mount root itself, every
    # mount of that device would "lie below" it)
    if holder and len(holder[0]) == 3 and os.path.relpath(path, holder[0][0]) != ".":
        target, fsroot, dev = holder[0]
        inner = os.path.normpath(os.path.join(fsroot, os.path.relpath(path, target)))
        for t, root, d in (r for r in _findmnt("-o", "TARGET,FSROOT,MAJ:MIN") if len(r) == 3):
            if d == dev and (root == inner or root.startswith(inner.rstrip("/") + "/")):
                found.add(t)
    return sorted(found, key=len, reverse=True)


def node_volumes(cluster: str) -> dict[str, Path]:
    """The Docker volumes of ``cluster``'s node containers: name -> host path."""
    containers = docker_client().containers.list(
        all=True, filters={"label": f"io.x-k8s.kind.cluster={cluster}"})
    return {m["Name"]: Path(m["Source"]) for c in containers for m in c.attrs.get("Mounts", [])
            if m.get("Type") == "volume" and m.get("Name") and m.get("Source")}


def delete_cluster(cluster: str) -> None:
    """``kind delete cluster``, then its nodes' /var volumes. What the nodes' kubelets
    mounted below those volumes (pods' projected service-account tmpfs) surfaced on the
    host through the nodes' shared propagation and outlives the nodes; it kept Docker from
    removing the volumes with them, so they go now."""
    volumes = node_volumes(cluster)
    run(["kind", "delete", "cluster", "--name", cluster], timeout=KIND_TIMEOUT)
    unmount([m for v in volumes.values() for m in mounts_under(v)])
    client = docker_client()
    for volume in volumes:
        with contextlib.suppress(Exception):  # removed with its container after all
            client.volumes.get(volume).remove()


def unmount(mounts: list[str]) -> None:
    """Lazily unmount each of ``mounts`` (deepest first); SandboxError naming any that
    stays mounted."""
    problems = []
    for mount in mounts:
        result = run(["umount", "-l", mount], check=False, timeout=None)
        if result.returncode != 0 and os.path.ismount(mount):
            problems.append(f"cannot unmount {mount}: {result.stderr.strip()}")
    if problems:
        raise SandboxError("; ".join(problems))

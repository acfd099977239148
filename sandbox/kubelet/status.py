"""The kubelet harness's status file: what it would advertise, for other processes.

The harness (``harness``: ``python -m sandbox.kubelet --status-file``) rewrites it
atomically on every change; the local runtime reads it for ``up`` (waiting until the
plugin has advertised) and ``status``::

    {"resources": {"nvidia.com/gpu": {"capacity": 8, "allocatable": 7, "connected": true,
                   "by_numa": {"0": 3, "1": 4},        # healthy devices per NUMA node
                   "devices": [{"id": "...", "health": "Healthy", "numa": [0]}, ...]}},
     "updated": 1764410000.0}

``by_numa`` counts healthy devices; a device without NUMA information counts under "-1"
(what sysfs ``numa_node`` says then); with ``numa_nodes`` every node 0..N-1 is listed.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox.kubelet.resources import Snapshot


@dataclass(frozen=True)
class ResourceCounts:
    """One extended resource as the status file gives it."""

    name: str
    capacity: int
    allocatable: int
    by_numa: dict[int, int] = field(default_factory=dict)  # healthy devices per NUMA node
    connected: bool = True  # a plugin serves it now (false from a kubelet restart until the
    # plugin has registered again)


def status_data(snap: Snapshot, numa_nodes: list[int] | None = None) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    for name, st in sorted(snap.resources.items()):
        by_numa = {str(n): 0 for n in numa_nodes or ()}
        for node, ids in st.by_numa(healthy_only=True).items():
            by_numa[str(-1 if node is None else node)] = len(ids)
        resources[name] = {
            "capacity": st.capacity,
            "allocatable": st.allocatable,
            "connected": st.connected,
            "by_numa": dict(sorted(by_numa.items(), key=lambda kv: int(kv[0]))),
            "devices": [
                {"id": d.id, "health": d.health, "numa": list(d.numa_nodes)} for d in st.devices
            ],
        }
    return {"resources": resources, "updated": time.time()}


def write_status(path: Path, snap: Snapshot, numa_nodes: list[int] | None = None) -> None:
    """Write the status JSON so that a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # a fresh name (O_EXCL): never written through a link planted at a predictable name
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(status_data(snap, numa_nodes), indent=1) + "\n")
        os.chmod(tmp, 0o644)  # readers (status, tests) are not always its writer
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_status(path: Path) -> list[ResourceCounts]:
    """The resources of a status file, sorted by name; [] when there is none (yet) or it is
    not one (a reader must never fail on what another process writes)."""
    try:
        data = json.loads(path.read_text())
        resources = data.get("resources", {}) if isinstance(data, dict) else {}
        return [
            ResourceCounts(
                name, int(res.get("capacity", 0)), int(res.get("allocatable", 0)),
                {int(k): int(v) for k, v in res.get("by_numa", {}).items() if k != "null"},
                bool(res.get("connected", True)),
            )
            for name, res in sorted(resources.items())
        ]
    except (OSError, ValueError, TypeError, AttributeError):
        return []

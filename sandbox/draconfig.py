"""What the reference DRA driver is given and would publish for a resolved node.

``driver_config`` is the ``--config`` of ``python -m hwplugins.dra``: the GPU models'
memory and partition schemes, which real drivers learn from NVML rather than sysfs.
``node_slices`` renders the node's fake root to a temporary directory and runs the
driver's own discovery and slice building on it (no cluster). Used by the native runtime,
``sandbox dra`` and the tests. What a running cluster's claims hold: ``draclaims``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Collection
from typing import Any

from hwplugins.dra import ConfigError, build_pool, config_from_devices, discover, parse_config
from hwplugins.dra import resource_slices as make_slices

from sandbox.errors import SandboxError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import NodeSpec


def driver_config(node: NodeSpec) -> dict[str, Any]:
    """The driver config for the GPUs of ``node`` (plain data in, plain data out)."""
    gpus = []
    for d in node.devices:
        if d.gpu is None:
            continue
        fn = d.functions[0]
        p = d.gpu.partitions
        gpus.append({
            "vendorID": fn.vendor_id, "deviceID": fn.device_id, "name": d.model_name,
            "memory": d.gpu.memory,
            "partitions": None if p is None else {
                "memorySlices": p.memory_slices, "computeSlices": p.compute_slices,
                "modes": list(p.modes),
                "profiles": [{"name": q.name, "memorySlices": q.memory_slices,
                              "computeSlices": q.compute_slices, "memory": q.memory}
                             for q in p.profiles],
            },
        })  # fmt: skip
    try:
        return config_from_devices(gpus)
    except ConfigError as exc:
        raise SandboxError(str(exc)) from exc


def node_slices(node: NodeSpec, compatibility_groups: bool = False,
                skip_node_operations: Collection[str] = ()) -> list[dict[str, Any]]:  # fmt: skip
    config = parse_config(driver_config(node))
    with tempfile.TemporaryDirectory(prefix="hwsb-dra-") as tmp:
        render(build_tree(node), tmp, force=True)
        pool = build_pool(discover(tmp), config, compatibility_groups, skip_node_operations)
    return make_slices(pool, node.name)

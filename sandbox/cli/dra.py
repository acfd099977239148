"""`sandbox dra slices|config PROFILE`: what the reference DRA driver would publish.

``slices`` renders the node's fake root to a temporary directory and runs the driver's own
discovery and slice building on it (no cluster); ``config`` prints the driver config
(``--config`` of ``python -m hwplugins.dra``) that carries the GPU models' memory and
partition schemes, which real drivers learn from NVML rather than sysfs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

import yaml
from hwplugins.dra import ConfigError, build_pool, config_from_devices, discover, parse_config
from hwplugins.dra import resource_slices as make_slices

from sandbox.errors import SandboxError
from sandbox.fakehw.build import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import NodeSpec, load_profile


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("dra", help="what the reference DRA driver would publish",
                       description=__doc__)  # fmt: skip
    verbs = p.add_subparsers(dest="dra_command", metavar="WHAT", required=True)
    s = verbs.add_parser("slices", help="print the ResourceSlices as YAML")
    c = verbs.add_parser("config", help="print the driver config (GPU memory, partitions)")
    for q in (s, c):
        q.add_argument("profile", metavar="PROFILE")
        q.add_argument("--node", metavar="NAME", help="node (replica); default: the first")
    s.add_argument("--compatibility-groups", action="store_true",
                   help="offer every partition mode (needs DRADeviceCompatibilityGroups)")
    c.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    p.set_defaults(func=run)


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


def node_slices(node: NodeSpec, compatibility_groups: bool = False) -> list[dict[str, Any]]:
    config = parse_config(driver_config(node))
    with tempfile.TemporaryDirectory(prefix="hwsb-dra-") as tmp:
        render(build_tree(node), tmp, force=True)
        pool = build_pool(discover(tmp), config, compatibility_groups)
    return make_slices(pool, node.name)


def run(args: argparse.Namespace) -> int:
    cluster = load_profile(args.profile).cluster
    node = cluster.node(args.node) if args.node else (cluster.nodes or (None,))[0]
    if node is None:
        names = ", ".join(n.name for n in cluster.nodes)
        raise SandboxError(f"no node {args.node} in {args.profile} (nodes: {names})")
    if args.dra_command == "config":
        data = driver_config(node)
        if args.output == "json":
            sys.stdout.write(json.dumps(data, indent=2) + "\n")
        else:
            yaml.safe_dump(data, sys.stdout, sort_keys=False)
        return 0
    yaml.safe_dump_all(node_slices(node, args.compatibility_groups), sys.stdout,
                       sort_keys=False)  # fmt: skip
    return 0

"""`sandbox dra slices|config PROFILE`: what the reference DRA driver would publish.

``slices`` renders the node's fake root to a temporary directory and runs the driver's own
discovery and slice building on it (no cluster); ``config`` prints the driver config
(``--config`` of ``python -m hwplugins.dra``) that carries the GPU models' memory and
partition schemes, which real drivers learn from NVML rather than sysfs. Both come from
``sandbox.dra``; this module only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml
from hwplugins.dra.slices import TYPES

from sandbox.dra import driver_config, node_slices
from sandbox.errors import SandboxError
from sandbox.profile import load_profile


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
    s.add_argument("--skip-node-operations", metavar="TYPES", default="",
                   help="comma-separated device types for the control plane only "
                   "(needs DRAOptionalNodeOperations)")
    c.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    p.set_defaults(func=run)


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
    skip = [t for t in args.skip_node_operations.split(",") if t]
    unknown = sorted(set(skip) - set(TYPES))
    if unknown:
        raise SandboxError(f"--skip-node-operations: unknown type(s) {', '.join(unknown)} "
                           f"(known: {', '.join(TYPES)})")  # fmt: skip
    yaml.safe_dump_all(node_slices(node, args.compatibility_groups, skip), sys.stdout,
                       sort_keys=False)  # fmt: skip
    return 0

"""`sandbox show PROFILE`: what a profile describes, per node and NUMA node."""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from sandbox.errors import SandboxError
from sandbox.profile import PROFILE_HELP, load_profile, spec
from sandbox.profile.defaults import defaulted_profile
from sandbox.profile.show import cluster_text


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "show",
        help="summarise a profile: NUMA nodes, CPUs, memory, devices",
        description="Print each node of the profile: its NUMA nodes with their CPUs and "
        "memory, and the devices attached to each with their stable ids (gpu0, nic1...) "
        "and PCI addresses. --output yaml|json prints the profile with every default "
        "stated (CPU lists, memory per NUMA node, host bridges, device memory, ports...): "
        "a profile `sandbox validate` accepts that renders the same tree. --output spec "
        "prints the resolved spec file (docs/spec-format.md) that `sandbox mount --spec` "
        "serves: the whole cluster, or one node with --node.",
    )
    p.add_argument("profile", metavar="PROFILE", help=PROFILE_HELP)
    p.add_argument("-o", "--output", choices=("table", "json", "yaml", "spec"), default="table")
    p.add_argument("--node", metavar="NAME", help="with -o spec: only this node (replica name)")
    p.add_argument("--index", type=int, metavar="I", help="replica index of a counted node")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    loaded = load_profile(args.profile)
    cluster = loaded.cluster
    if args.node is not None or args.index is not None:
        if args.output != "spec":
            raise SandboxError("--node and --index go with --output spec")
        node = cluster.node(args.node or "", args.index)
        if node is None:
            names = ", ".join(n.name for n in cluster.nodes)
            raise SandboxError(f"no node {args.node} in {args.profile} (nodes: {names})")
        sys.stdout.write(spec.dump(node))
    elif args.output == "spec":
        sys.stdout.write(spec.dump(cluster))
    elif args.output == "json":
        json.dump(defaulted_profile(loaded.profile, cluster), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif args.output == "yaml":
        yaml.safe_dump(defaulted_profile(loaded.profile, cluster), sys.stdout,
                       sort_keys=False)
    else:
        sys.stdout.write(cluster_text(cluster))
    return 0

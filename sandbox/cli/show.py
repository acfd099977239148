"""`sandbox show PROFILE`: what a profile describes, per node and NUMA node."""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from sandbox.profile import load_profile
from sandbox.profile.show import cluster_data, cluster_text


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "show",
        help="summarise a profile: NUMA nodes, CPUs, memory, devices",
        description="Print each node of the profile: its NUMA nodes with their CPUs and "
        "memory, and the devices attached to each with their stable ids (gpu0, nic1...) "
        "and PCI addresses. --output json|yaml prints the fully defaulted model.",
    )
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = load_profile(args.profile).cluster
    if args.output == "json":
        json.dump(cluster_data(cluster), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif args.output == "yaml":
        yaml.safe_dump(cluster_data(cluster), sys.stdout, sort_keys=False)
    else:
        sys.stdout.write(cluster_text(cluster))
    return 0

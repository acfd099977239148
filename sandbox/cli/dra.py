"""`sandbox dra slices|config PROFILE` and `sandbox dra claims` (see ``DESCRIPTION``).
Everything comes from ``sandbox.draconfig`` and ``sandbox.draclaims``; this module only
parses arguments and prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import yaml
from hwplugins.dra.devtypes import TYPES

from sandbox.cli.status import add_file_arguments, check_picture_file, write_picture
from sandbox.draclaims import quantity, read_usage
from sandbox.draconfig import driver_config, node_slices
from sandbox.draw import claims_svg
from sandbox.errors import SandboxError
from sandbox.profile import PROFILE_HELP, load_profile
from sandbox.session import find_session
from sandbox.textui import dump, table

DESCRIPTION = """\
What our reference DRA driver (hwplugins.dra) would publish for a profile, and what a
running sandbox's claims hold.

  sandbox dra slices PROFILE   the ResourceSlices, from the driver's own discovery run on
                               a rendered copy of the node's tree (no cluster needed)
  sandbox dra config PROFILE   the driver config (GPU memory and partition schemes, which
                               real drivers learn from NVML rather than sysfs)
  sandbox dra claims           on a running sandbox (native or kind): which pod's claim
                               holds which device or partition, and what is left of each
                               GPU's counters and each NIC's bandwidth (-o svg|png: a
                               picture for slides)
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("dra", help="what the reference DRA driver would publish",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    verbs = p.add_subparsers(dest="dra_command", metavar="WHAT", required=True)
    s = verbs.add_parser("slices", help="print the ResourceSlices as YAML")
    c = verbs.add_parser("config", help="print the driver config (GPU memory, partitions)")
    for q in (s, c):
        q.add_argument("profile", metavar="PROFILE", help=PROFILE_HELP)
        q.add_argument("--node", metavar="NAME", help="node (replica); default: the first")
    s.add_argument("--compatibility-groups", action="store_true",
                   help="offer every partition mode (needs DRADeviceCompatibilityGroups)")
    s.add_argument("--skip-node-operations", metavar="TYPES", default="",
                   help="comma-separated device types for the control plane only "
                   "(needs DRAOptionalNodeOperations)")
    for q in (s, c):
        q.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml",
                       help="yaml (default; slices: one document per slice) or json (slices: "
                       "a list)")
    u = verbs.add_parser("claims", help="on a running sandbox: which claim holds which device "
                         "or partition, and what is left of each GPU's counters and each "
                         "NIC's bandwidth")
    u.add_argument("--name", help="which sandbox (default: the only one running)")
    u.add_argument("--kubeconfig", help="any cluster instead of a sandbox")
    u.add_argument("-o", "--output", choices=("table", "json", "yaml", "svg", "png"),
                   default="table",
                   help="svg/png: the same as a picture for slides (one card per GPU and NIC)")
    add_file_arguments(u)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.dra_command == "claims":
        return _claims(args)
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
    slices = node_slices(node, args.compatibility_groups, skip)
    if args.output == "json":
        sys.stdout.write(json.dumps(list(slices), indent=2) + "\n")
    else:
        yaml.safe_dump_all(slices, sys.stdout, sort_keys=False)
    return 0


def _claims(args: argparse.Namespace) -> int:
    check_picture_file(args)
    kubeconfig = args.kubeconfig
    title = str(kubeconfig)
    if kubeconfig is None:
        session = find_session(args.name)
        title = f"sandbox {session.name} ({session.runtime})"
        kubeconfig = session.record.kubeconfig
        if not kubeconfig:
            raise SandboxError(f"sandbox {session.name!r} runs the {session.runtime} runtime, "
                               "which has no API server and no claims; use --runtime native "
                               "or kind")
    use = read_usage(str(kubeconfig))
    if args.output in ("svg", "png"):
        write_picture(claims_svg(use, title=f"DRA claims: {title}", scale=args.scale),
                      args.output, args.file, args.force)
        return 0
    if args.output in ("json", "yaml"):
        dump(dataclasses.asdict(use), args.output)
        return 0
    print(table(("CLAIM", "POD", "REQUEST", "POOL", "DEVICE", "TAKES"), [
        (a.claim, ",".join(a.pods) or "-", a.request, a.pool, a.device,
         ", ".join(f"{k} {v}" for k, v in a.consumed) or "-") for a in use.allocated])
        if use.allocated else "no allocated claims")
    for title, rows in (("COUNTER SET", use.counters), ("DEVICE", use.capacity)):
        if rows:
            print()
            print(table(("POOL", title, "OF", "USED", "LEFT", "TOTAL"), [
                (r.pool, r.owner, r.name, quantity(r.used), quantity(r.total - r.used),
                 quantity(r.total)) for r in rows]))
    return 0


"""`sandbox render PROFILE --node NAME --out DIR`: write one node's fake root to a directory."""

from __future__ import annotations

import argparse
import os

from sandbox.errors import RenderError
from sandbox.fakehw.builder import build_tree
from sandbox.fakehw.render import render
from sandbox.profile import PROFILE_HELP, load_profile


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "render",
        help="write a node's fake /sys, /dev and /proc to a directory",
        description="Build the fake root of one node of PROFILE and write it under DIR "
        "(DIR/sys, DIR/dev, DIR/proc). Device nodes are empty placeholders listed in "
        "DIR/dev/.devices; with --mknod (root) real character devices, each a harmless "
        "memory device (null, zero, full, random and urandom as themselves, every other "
        "node as 1:3, /dev/null), mode <= 0660 and the umask applied. --real-numbers "
        "gives them the tree's own numbers instead: they then open the HOST's real "
        "drivers of those numbers (a profile's devNodes choose any), so use it only in a "
        "directory no one else can reach.",
    )
    p.add_argument("profile", metavar="PROFILE", help=PROFILE_HELP)
    p.add_argument("--node", metavar="NAME",
                   help="node (replica) name; may be omitted when the profile has one node")
    p.add_argument("--index", type=int, metavar="I", help="replica index of a counted node")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write into")
    p.add_argument("--mknod", action="store_true",
                   help="create real device nodes, harmless stand-ins (root)")
    p.add_argument("--real-numbers", action="store_true",
                   help="with --mknod: the tree's own major:minor (the host's real devices)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = load_profile(args.profile).cluster
    names = ", ".join(n.name for n in cluster.nodes)
    if args.node is None:
        if len(cluster.nodes) != 1:
            raise RenderError(f"{args.profile} has several nodes; pick one with --node ({names})")
        node = cluster.nodes[0]
    else:
        found = cluster.node(args.node, args.index)
        if found is None:
            which = args.node if args.index is None else f"{args.node} index {args.index}"
            raise RenderError(f"no node {which} in {args.profile} (nodes: {names})")
        node = found
    if args.real_numbers and not args.mknod:
        raise RenderError("--real-numbers needs --mknod")
    if args.mknod and os.geteuid() != 0:
        raise RenderError("--mknod makes real device nodes, which needs root (sudo); "
                          "without --mknod they are empty placeholder files listed in "
                          "DIR/dev/.devices")
    stats = render(build_tree(node), args.out, mknod=args.mknod, force=args.force,
                   real_numbers=args.real_numbers)
    kind = "device nodes" if stats.mknod else "device placeholders (see dev/.devices)"
    print(f"rendered node {node.name} to {args.out}: {stats.files} files, {stats.links} "
          f"links, {stats.dirs} directories, {stats.devices} {kind}")
    return 0

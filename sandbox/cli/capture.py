"""`sandbox capture [--root DIR] -o PROFILE.yaml`: a machine's /sys and /proc as a profile."""

from __future__ import annotations

import argparse

from sandbox.capture import capture, write_capture
from sandbox.capture.reading import shown
from sandbox.outfile import check_target


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "capture",
        help="write a hardware profile of this machine (or of a sysfs-like directory)",
        description="Read a machine's /sys and /proc and write a hardware profile of it: "
        "CPU model and topology, NUMA nodes (CPUs, memory, hugepages, distances), and every "
        "PCI function that is not a bridge, with its ids, NUMA node and SR-IOV settings. "
        "GPUs, NICs and FPGAs the catalogue knows (`sandbox schema`) become those device "
        "types; anything else becomes a generic device with its raw ids. The profile is "
        "validated before it is written, and its header comment says where and when it was "
        "captured and what it leaves out. Only the -o file is written: as a whole new "
        "regular file renamed into place, so a failure (a full disk) leaves no file or the "
        "old one; a directory, FIFO, device, socket or symbolic link there is refused.",
        epilog="Examples: sandbox capture -o this-host.yaml; sandbox capture --root DIR -o "
        "out.yaml (DIR holds sys/ and proc/, e.g. a `sandbox render` output); then "
        "sandbox render out.yaml --out TREE to see it as a fake root.",
    )
    p.add_argument("--root", default="/", metavar="DIR",
                   help="directory holding sys/ and proc/ to read (default: / , this host)")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.yaml",
                   help="file to write ('-' for stdout); never overwritten without --force")
    p.add_argument("--force", action="store_true",
                   help="replace an existing -o file (a regular file, never a link)")
    p.add_argument("--name", metavar="NAME",
                   help="the profile's metadata.name (default: the root's hostname)")
    p.add_argument("--node-name", metavar="NAME",
                   help="the node's name (default: the root's hostname); serials, UUIDs "
                   "and GUIDs of the rendered tree are derived from both names")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.output != "-":
        check_target(args.output, args.force)  # a bad -o fails before the machine is read
    result = capture(args.root, name=args.name, node_name=args.node_name)
    write_capture(result, args.output, force=args.force)
    if args.output != "-":
        node = result.profile["nodes"][0]
        devices = sum(d.get("count", 1) for d in node["devices"])
        print(f"captured {shown(str(args.root))} to {shown(str(args.output))}: "
              f"{node['cpu']['sockets']} socket(s), "
              f"{len(node['numa']['nodes'])} NUMA node(s), {devices} device(s); "
              f"{len(result.left_out)} note(s) on what was left out in its header")
    return 0

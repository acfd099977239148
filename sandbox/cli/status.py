"""`sandbox status`: what each node's kubelet advertises, devices per NUMA node, health."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from sandbox.draw import DeviceView, svg_to_png, topology_svg
from sandbox.errors import SandboxError
from sandbox.outfile import check_target, write_file
from sandbox.profile import load_profile
from sandbox.runtimes import runtime_for
from sandbox.runtimes.base import SandboxStatus
from sandbox.session import find_session
from sandbox.textui import table

RUNTIME_NOTE = {
    "local": "FUSE trees + reference device plugin + kubelet harness; no Kubernetes",
    "native": "real Kubernetes components as host processes",
    "kind": "kind cluster in Docker",
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show nodes, devices per NUMA node, health, capacity vs allocatable",
        description="Show a running sandbox. --output svg|png draws its topology (NUMA nodes, "
        "CPUs, PCI, devices coloured by health) for slides and workshops.",
    )
    p.add_argument("--name", help="which sandbox (default: the only one running)")
    p.add_argument("-o", "--output", choices=("table", "json", "svg", "png"), default="table")
    add_file_arguments(p)
    p.set_defaults(func=run)


def add_file_arguments(p: argparse.ArgumentParser) -> None:
    """``--file`` and ``--force`` of a command that draws svg/png (status, dra claims)."""
    p.add_argument("-f", "--file", metavar="FILE",
                   help="write svg/png here (default: stdout): a new regular file renamed "
                   "into place; a directory, FIFO, device, socket or symbolic link there "
                   "is refused")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --file (a regular file, never a link)")


def check_picture_file(args: argparse.Namespace) -> None:
    """Refuse a bad --file before any work is done (``write_picture`` checks again)."""
    if args.file is not None and args.output in ("svg", "png"):
        check_target(args.file, args.force)


def text(status: SandboxStatus) -> str:
    out = [f"sandbox {status.name}  runtime: {status.runtime} "
           f"({RUNTIME_NOTE.get(status.runtime, '')})  profile: {status.profile}"]
    for node in status.nodes:
        out.append("")
        out.append(f"node {node.name}  {'Ready' if node.ready else 'NotReady'}")
        out.extend(f"  ! {n}" for n in node.notes)
        if node.resources:
            numas = sorted({k for r in node.resources for k in r.by_numa})
            rows = [(r.resource, r.capacity, r.allocatable,
                     *(r.by_numa.get(k, 0) for k in numas)) for r in node.resources]
            out.append(table(("RESOURCE", "CAPACITY", "ALLOCATABLE",
                              *(f"HEALTHY@NUMA{k}" for k in numas)), rows, indent="  "))
        else:
            out.append("  (no extended resources advertised)")
        by_numa: dict[int, list[str]] = defaultdict(list)
        for d in node.devices:
            reason = f": {d.reason}" if d.reason else ""
            mark = "" if d.health == "healthy" else f" [{d.health}{reason}]"
            by_numa[d.numa_node].append(f"{d.id}{mark}")
        for numa in sorted(by_numa):
            out.append(f"  NUMA {numa}: {', '.join(by_numa[numa])}")
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    check_picture_file(args)
    session = find_session(args.name)
    status = runtime_for(session.runtime).status(session.state_dir)
    ready = 0 if all(n.ready for n in status.nodes) else 1  # scripts can test the status
    if args.output == "json":
        json.dump(status.to_dict(), sys.stdout, indent=2)
        print()
        return ready
    if args.output == "table":
        sys.stdout.write(text(status))
        return ready
    cluster = load_profile(status.profile).cluster
    views = {
        n.name: {d.id: DeviceView(d.health, d.reason, d.allocated_to) for d in n.devices}
        for n in status.nodes
    }
    svg = topology_svg(cluster.nodes, views, title=f"{status.name} ({status.runtime})")
    write_picture(svg, args.output, args.file, args.force)
    return 0


def write_picture(svg: str, output: str, file: str | None, force: bool = False) -> None:
    """``svg`` as ``output`` ("svg" or "png") to ``file`` (``sandbox.outfile.write_file``:
    an existing one only with ``force``), else to stdout (never PNG bytes to a terminal)."""
    data = svg.encode() if output == "svg" else svg_to_png(svg)
    if file is not None:
        write_file(file, data, force=force)
        print(f"wrote {file}", file=sys.stderr)
    elif output == "png" and sys.stdout.isatty():
        raise SandboxError("refusing to write PNG to a terminal; use --file or a redirect")
    else:
        sys.stdout.buffer.write(data)

"""`sandbox wait RESOURCE=N...`: block until the kubelet advertises what a test needs.

It asks the sandbox's runtime for its status (as `sandbox status` does: the kubelet's
node object on kind and native, the kubelet harness on local) until every condition holds,
printing each change of what it sees, or gives up at the timeout (exit 1, saying what it
last saw). For CI steps that would otherwise sleep a fixed time after deploying a plugin.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass

from sandbox.errors import SandboxError
from sandbox.runtimes import runtime_for
from sandbox.runtimes.base import SandboxStatus
from sandbox.session import find_session

_CONDITION = re.compile(r"^(?P<resource>[A-Za-z0-9][A-Za-z0-9._/-]*)=(?P<count>[0-9]+)$")


@dataclass(frozen=True)
class Condition:
    resource: str
    count: int

    def __str__(self) -> str:
        return f"{self.resource}={self.count}"


def _condition(text: str) -> Condition:
    m = _CONDITION.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RESOURCE=N, e.g. nvidia.com/gpu=8")
    return Condition(m["resource"], int(m["count"]))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "wait",
        help="wait until resources are allocatable (RESOURCE=N), e.g. after deploying a plugin",
        description="Wait until every RESOURCE=N holds: the resource's allocatable count is "
        "N (--at-least: N or more), on --node or, without it, summed over the sandbox's "
        "nodes. Prints what it sees whenever that changes; exit 0 once everything holds, 1 "
        "at the timeout (naming what it last saw). Resources are the kubelet's: extended "
        "resources a device plugin advertises (nvidia.com/gpu, hwsandbox.dev/...).",
    )
    p.add_argument("conditions", nargs="+", type=_condition, metavar="RESOURCE=N")
    p.add_argument("--name", help="which sandbox (default: the only one running)")
    p.add_argument("--node", help="one node of the sandbox (default: all, summed)")
    p.add_argument("--at-least", action="store_true",
                   help="N or more instead of exactly N")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="give up after this long (default: 120)")
    p.add_argument("--interval", type=float, default=0.5, metavar="SECONDS",
                   help="how often to ask (default: 0.5)")
    p.set_defaults(func=run)


def allocatable(status: SandboxStatus, node: str | None) -> dict[str, int]:
    """Resource -> allocatable count, on ``node`` or summed over every node."""
    if node is not None and all(n.name != node for n in status.nodes):
        known = ", ".join(n.name for n in status.nodes) or "none"
        raise SandboxError(f"sandbox {status.name!r} has no node {node!r} (nodes: {known})")
    out: dict[str, int] = {}
    for n in status.nodes:
        if node is None or n.name == node:
            for r in n.resources:
                out[r.resource] = out.get(r.resource, 0) + r.allocatable
    return out


def run(args: argparse.Namespace) -> int:
    if args.timeout < 0 or args.interval <= 0:
        raise SandboxError("--timeout must be 0 or more and --interval above 0 seconds")
    session = find_session(args.name)
    runtime = runtime_for(session.runtime)
    where = f"node {args.node}" if args.node else f"sandbox {session.name}"
    deadline = time.monotonic() + args.timeout
    seen: str | None = None
    while True:
        have = allocatable(runtime.status(session.state_dir), args.node)
        now = ", ".join(f"{c.resource}={have.get(c.resource, 0)}" for c in args.conditions)
        if now != seen:
            print(f"{where}: allocatable {now}", file=sys.stderr, flush=True)
            seen = now
        if all(have.get(c.resource, 0) == c.count
               or (args.at_least and have.get(c.resource, 0) >= c.count)
               for c in args.conditions):
            return 0
        if time.monotonic() >= deadline:
            wanted = ", ".join(str(c) for c in args.conditions)
            more = " or more" if args.at_least else ""
            raise SandboxError(f"timed out after {args.timeout:g}s waiting for {wanted}{more} "
                               f"on {where}: allocatable {now}")
        time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))

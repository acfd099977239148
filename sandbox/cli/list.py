"""`sandbox list`: the sandboxes of this state root, from their records (no process is
asked anything: `sandbox status --name NAME` does that)."""

from __future__ import annotations

import argparse
import sys

from sandbox.runtimes.base import StateBusy, StateLock, default_state_root
from sandbox.session import list_sessions
from sandbox.textui import dump, table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "list",
        help="list the sandboxes",
        description="One line per sandbox of the state root "
        f"({default_state_root()}; HWSANDBOX_STATE_DIR overrides): its name, runtime, "
        "nodes and profile, and whether a `sandbox up` or `down` of it is running now. "
        "Read from the sandboxes' records only; `sandbox status --name NAME` asks the "
        "kubelet and the fake hardware.",
    )
    p.add_argument("-o", "--output", choices=("table", "wide", "json", "yaml"), default="table",
                   help="wide: with each state dir")
    p.set_defaults(func=run)


def rows() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for session in list_sessions():
        try:
            StateLock.check_free(session.state_dir)
            state = "up"
        except StateBusy:
            state = "busy"  # an `up` still coming up, or a `down` going on
        out.append({"name": session.name, "runtime": session.runtime,
                    "nodes": sorted(session.nodes),
                    "profile": session.record.profile,
                    "state": state, "state_dir": str(session.state_dir)})
    return out


def run(args: argparse.Namespace) -> int:
    found = rows()
    if args.output in ("json", "yaml"):
        dump(found, args.output)
        return 0
    if not found:
        print("no sandboxes; start one with `sandbox up 8gpu-2numa`", file=sys.stderr)
        return 0
    headers = ["NAME", "RUNTIME", "STATE", "NODES", "PROFILE"]
    if args.output == "wide":
        headers.append("STATE_DIR")
    print(table(headers, [[", ".join(v) if isinstance(v := r[h.lower()], list) else v
                           for h in headers] for r in found]))
    return 0

"""`sandbox profiles`: the bundled hardware profiles, by the names `up` and friends take."""

from __future__ import annotations

import argparse

from sandbox.errors import ProfileError
from sandbox.profile import load_profile
from sandbox.profile.bundled import bundled
from sandbox.textui import dump, table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "profiles",
        help="list the bundled hardware profiles",
        description="The profiles that ship with the sandbox, one line each. Every verb "
        "that reads a profile takes one by its NAME (`sandbox up 8gpu-2numa`) as well as a "
        "file path; `sandbox show NAME` describes one, and copying its FILE is the quickest "
        "start for a profile of your own.",
    )
    p.add_argument("-o", "--output", choices=("table", "wide", "json", "yaml"), default="table",
                   help="wide: with each profile's file")
    p.set_defaults(func=run)


def rows() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for name, path in bundled().items():
        try:
            cluster = load_profile(path).cluster
        except ProfileError as exc:  # a broken bundled profile is our bug: say which
            out.append({"name": name, "file": str(path), "nodes": 0, "devices": 0,
                        "description": f"INVALID: {exc.problems[0]}"})
            continue
        out.append({"name": name, "file": str(path), "nodes": len(cluster.nodes),
                    "devices": sum(len(n.devices) for n in cluster.nodes),
                    "description": cluster.description})
    return out


def run(args: argparse.Namespace) -> int:
    found = rows()
    if args.output in ("json", "yaml"):
        dump(found, args.output)
    else:
        headers = ["NAME", "NODES", "DEVICES", "DESCRIPTION"]
        if args.output == "wide":
            headers.append("FILE")
        print(table(headers, [[r[h.lower()] for h in headers] for r in found]))
    return 0

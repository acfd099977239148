"""`sandbox validate PROFILE...`: check profiles, report every problem, exit 1 if any."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import TextIO

from sandbox.errors import ProfileError
from sandbox.profile import load_profile
from sandbox.textui import dump


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "validate",
        help="check hardware profiles",
        description="Load and check each profile. Every problem is printed as "
        "FILE:LINE:COL: FIELD.PATH: MESSAGE; the exit code is 1 if any profile has one.",
    )
    p.add_argument("profiles", nargs="+", metavar="PROFILE",
                   help="profile files, names of bundled profiles (`sandbox profiles`), or - "
                   "for standard input")
    p.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    p.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text",
                   help="json/yaml: one entry per profile (ok, nodes, devices, and each "
                   "problem's file, line, column, path and message) on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.output != "text":
        return _as_data(args.profiles, args.output)
    failed = 0
    for path in args.profiles:
        try:
            loaded = load_profile(path)
        except ProfileError as exc:
            failed += 1
            for problem in exc.problems:
                _say(str(problem), sys.stderr)
            continue
        if not args.quiet:
            nodes = loaded.cluster.nodes
            devices = sum(len(n.devices) for n in nodes)
            _say(f"{path}: ok ({len(nodes)} node(s), {devices} device(s))", sys.stdout)
    if failed:
        _say(f"{failed} of {len(args.profiles)} profile(s) invalid", sys.stderr)
    return 1 if failed else 0


def _as_data(paths: list[str], output: str) -> int:
    results: list[dict[str, object]] = []
    for path in paths:
        try:
            loaded = load_profile(path)
        except ProfileError as exc:
            results.append({"profile": path, "ok": False,
                            "problems": [dataclasses.asdict(p) for p in exc.problems]})
            continue
        nodes = loaded.cluster.nodes
        results.append({"profile": path, "ok": True, "nodes": len(nodes),
                        "devices": sum(len(n.devices) for n in nodes), "problems": []})
    dump(results, output)
    return 0 if all(r["ok"] for r in results) else 1


def _say(line: str, stream: TextIO) -> None:
    """Print, but a reader that went away (``validate x | head -1``) must not change the
    verdict: the exit status still says whether every profile is valid."""
    try:
        print(line, file=stream, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)

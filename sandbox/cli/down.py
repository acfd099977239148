"""`sandbox down`: remove a sandbox and everything it made."""

from __future__ import annotations

import argparse
import sys

from sandbox.runtimes import runtime_for
from sandbox.session import find_session


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "down",
        help="stop a sandbox and remove its processes, mounts and state",
        description="Stop every process, unmount every fake tree (dead mounts included) and "
        "remove the sandbox's state directory.",
    )
    p.add_argument("--name", help="which sandbox (default: the only one running)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    session = find_session(args.name)
    runtime = runtime_for(session.runtime)

    def progress(message: str) -> None:
        print(f"  {message}", file=sys.stderr)

    runtime.down(session.state_dir, progress)
    print(f"sandbox {session.name!r} removed")
    return 0

"""``python -m sandbox.agent --spec FILE --node NAME ROOT``: the node server's entry point.

What the runtimes start (``sandbox.agent.spawn``, the kind agent's static pod): read the
node (a resolved spec, or a profile), mount its tree at ROOT and serve it and its control
socket until unmounted or signalled. Prints the ready line once it serves; errors are
``error: ...`` lines on stderr (what ``supervisor.log_tail`` shows) and exit 1. Users
run ``sandbox mount``, which calls the same functions.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from sandbox.agent.node import announce_ready, load_node, serve_node
from sandbox.errors import SandboxError
from sandbox.fakehw.devnodes import STAND_IN, parse_map


def _dev_map(text: str) -> tuple[int, int]:
    try:
        return parse_map(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sandbox.agent",
                                description="Serve one node's fake /sys, /dev, /proc over FUSE "
                                "at ROOT, with its control socket (see `sandbox mount`).")
    p.add_argument("root", metavar="ROOT", type=Path, help="mount point (created if missing)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec", type=Path, metavar="FILE", help="a resolved spec file")
    source.add_argument("--profile", metavar="FILE", help="a profile (resolved here)")
    p.add_argument("--node", help="node (or replica) name; needed with a profile")
    p.add_argument("--index", type=int, help="replica index when the node has count > 1")
    p.add_argument("--state-dir", type=Path, help="where control.sock and state.json live")
    p.add_argument("--dev-dir", type=Path, help="also create the node's device nodes here")
    p.add_argument("--dev-map", type=_dev_map, nargs="?", const=STAND_IN, metavar="MAJ:MIN",
                   help="with --dev: report every device node as MAJ:MIN (default 1:3)")
    p.add_argument("--dev", action="store_true", help="mount with the dev option")
    p.add_argument("-v", "--verbose", action="store_true", help="debug log, tracebacks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s" if not args.verbose else "%(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        spec = load_node(spec_file=args.spec, profile_path=args.profile, node=args.node,
                         index=args.index)
        serve_node(spec, args.root, state_dir=args.state_dir, dev_dir=args.dev_dir,
                   dev_map=args.dev_map, allow_dev=args.dev,
                   ready=lambda paths: announce_ready(paths, args.root))
    except SandboxError as exc:
        if args.verbose:
            traceback.print_exc()
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

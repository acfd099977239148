"""The ``sandbox`` command line: one small module per verb, each registering itself here.

A verb module exposes ``register(subparsers)`` which adds its parser and sets
``func=run`` where ``run(args) -> int``. Verbs parse flags and call the library; they hold
no logic of their own. Only ``SandboxError`` is caught: it prints ``error: ...`` (every
line of it) and exits 1, with the traceback only under ``-v``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Sequence

from sandbox import __version__
from sandbox.errors import SandboxError

# Verb modules, in the order `sandbox --help` lists them.
VERBS = (
    "up",
    "down",
    "status",
    "validate",
    "show",
    "schema",
    "render",
    "mount",
    "fault",
    "kubelet",
    "dra",
    "plugins",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandbox",
        description=(
            "Emulate GPUs, NICs, FPGAs and NUMA topology for local Kubernetes: a YAML "
            "hardware profile becomes a fake /sys and /dev that real device plugins read."
        ),
        epilog="Start with: sandbox up profiles/8gpu-2numa.yaml   (see `sandbox COMMAND --help`)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logs and tracebacks on errors"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for verb in VERBS:
        try:
            module = importlib.import_module(f"sandbox.cli.{verb}")
        except ModuleNotFoundError as exc:
            if exc.name != f"sandbox.cli.{verb}":
                raise
            continue  # verb not built yet
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s" if not args.verbose else "%(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code: int = args.func(args)
    except SandboxError as exc:
        if args.verbose:
            traceback.print_exc()
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `sandbox show -o yaml | head`
        sys.stderr.close()
        return 0
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

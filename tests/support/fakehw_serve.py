"""Serve any ``rebuild`` callable's tree live over FUSE, for tests and benchmarks:

    PYTHONPATH=tests/support python -m fakehw_serve ROOT --rebuild fakehw_toy:rebuild

``sandbox mount`` serves a profile's (or a resolved spec's) node; this serves hand-made
trees (``fakehw_toy``) through the same ``sandbox.fakehw.serve.fs.serve``, and prints
``ready SOCKET`` once mounted and listening.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import cast

import trio

from sandbox.errors import MountError
from sandbox.fakehw.control import ControlPaths
from sandbox.fakehw.serve.fs import DEFAULT_DEV_MAP, serve
from sandbox.fakehw.serve.live import Rebuild
from sandbox.fakehw.serve.mountroot import check_mount_root


def _load_rebuild(spec: str) -> Rebuild:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise MountError(f"--rebuild {spec!r}: expected MODULE:FUNCTION")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise MountError(f"--rebuild {spec!r}: {exc}") from exc
    if not callable(obj):
        raise MountError(f"--rebuild {spec!r}: not callable")
    return cast(Rebuild, obj)


def _parse_dev(text: str) -> tuple[int, int]:
    major, sep, minor = text.partition(":")
    if not sep or not major.isdigit() or not minor.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected MAJOR:MINOR")
    return int(major), int(minor)


class _PrintReady:
    """A trio TaskStatus that announces readiness on stdout for a parent process."""

    def started(self, value: ControlPaths | None = None) -> None:
        sock = value.socket if value is not None else ""
        print(f"ready {sock}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fakehw_serve",
        description="Serve a rebuild callable's live tree over FUSE (tests, benchmarks).",
    )
    parser.add_argument("root", help="mount point")
    parser.add_argument(
        "--rebuild",
        required=True,
        metavar="MODULE:FUNC",
        help="callable (states) -> Tree, e.g. fakehw_toy:rebuild",
    )
    parser.add_argument("--state-dir", help="directory for control.sock and state.json")
    parser.add_argument(
        "--dev-map",
        type=_parse_dev,
        nargs="?",
        const=DEFAULT_DEV_MAP,
        metavar="MAJOR:MINOR",
        help="report every char device as this (default 1:3)",
    )
    parser.add_argument("--dev", action="store_true", help="mount with the dev option")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("pyfuse3").setLevel(logging.INFO)  # per-request noise otherwise
    try:
        rebuild = _load_rebuild(args.rebuild)
        trio.run(
            lambda: serve(
                check_mount_root(args.root),
                rebuild,
                state_dir=args.state_dir,
                dev_map=args.dev_map,
                allow_dev=args.dev,
                task_status=_PrintReady(),
            )
        )
    except MountError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

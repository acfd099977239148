"""`sandbox load IMAGE... [--archive FILE.tar]`: local images into a sandbox's nodes, so a
plugin image built here runs there with no registry (``Runtime.load_images``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sandbox.errors import SandboxError
from sandbox.runtimes import runtime_for
from sandbox.session import find_session

DESCRIPTION = """\
Put local images into the nodes of a running sandbox, for pods that run them (e.g. the
manifest of `sandbox plugins template`; use imagePullPolicy IfNotPresent or Never):
  kind    `kind load docker-image` / `kind load image-archive` into every node
  native  `ctr images import` into the node's containerd (a Docker image is saved first)
  local   refused: it runs no containers
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("load", help="put local images into a sandbox's nodes (kind, native)",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("images", nargs="*", metavar="IMAGE",
                   help="an image of the local Docker daemon (name:tag)")
    p.add_argument("--archive", action="append", default=[], metavar="FILE.tar",
                   help="an image archive instead (`docker save`, or an OCI layout tar); "
                   "repeatable")
    p.add_argument("--name", help="which sandbox (default: the only one running)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.images and not args.archive:
        raise SandboxError("nothing to load: name an IMAGE, or an archive with --archive "
                           "FILE.tar")
    archives = [Path(a) for a in args.archive]
    for archive in archives:
        if archive.is_dir():
            raise SandboxError(f"{archive}: is a directory, not an image archive")
        if not archive.is_file():
            raise SandboxError(f"{archive}: no such image archive")
    session = find_session(args.name)
    runtime_for(session.runtime).load_images(
        session.state_dir, args.images, archives,
        lambda line: print(line, file=sys.stderr, flush=True))
    print(f"loaded {len(args.images) + len(archives)} image(s) into sandbox {session.name}",
          file=sys.stderr)
    return 0

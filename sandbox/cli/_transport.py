"""``--transport``, shared by the verbs that talk to a node's sockets (``fault``,
``status``): how a kind sandbox's node sockets are reached (``runtimes.kind.transport``)."""

from __future__ import annotations

import argparse
import os

from sandbox.runtimes.kind.transport import TRANSPORT_ENV


def add_transport_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transport", choices=("auto", "host", "exec"),
        help="kind: how to reach the nodes' sockets: `host` through the state dir's bind "
        "mount, `exec` through the Kubernetes API (Docker Desktop, a remote Docker host); "
        f"default: what `up` chose ({TRANSPORT_ENV} sets it too)")


def use_transport(args: argparse.Namespace) -> None:
    if getattr(args, "transport", None):
        os.environ[TRANSPORT_ENV] = args.transport

"""`sandbox plugins list|show|deploy`: the bundled plugin manifests."""

from __future__ import annotations

import argparse
import subprocess
import sys

from sandbox.catalog import PLUGINS, find_plugin
from sandbox.errors import CommandError, SandboxError
from sandbox.session import find_session
from sandbox.textui import table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plugins",
        help="bundled device plugin and DRA driver manifests",
        description="Ready manifests for our reference plugins and well-known third-party "
        "ones, adapted only through hostPaths that point at each node's fake tree "
        "(/var/lib/hw-sandbox/root on the node).",
    )
    verbs = p.add_subparsers(dest="plugins", metavar="ACTION", required=True)
    verbs.add_parser("list", help="what is bundled, what each shows, which profile suits it")
    show = verbs.add_parser("show", help="print a plugin's manifest")
    show.add_argument("plugin")
    deploy = verbs.add_parser("deploy", help="apply a plugin's manifest to a running sandbox")
    deploy.add_argument("plugin")
    deploy.add_argument("--name", help="which sandbox (default: the only one running)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.plugins == "list":
        rows = [(p.name, p.kind, p.profiles, p.shows) for p in PLUGINS]
        print(table(("NAME", "KIND", "SUITS", "WHAT IT SHOWS"), rows))
        return 0
    plugin = find_plugin(args.plugin)
    if args.plugins == "show":
        sys.stdout.write(plugin.text())
        return 0
    session = find_session(args.name)
    kubeconfig = session.record.get("kubeconfig")
    if not kubeconfig:
        raise SandboxError(
            f"sandbox {session.name!r} runs the {session.runtime} runtime, which has no API "
            "server to deploy to; use --runtime native or kind")
    if plugin.nvml:
        if session.runtime != "kind":
            raise SandboxError(
                f"{plugin.name} runs in pods on kind (its pods load our NVML from each node); "
                "on the native runtime run it outside a pod, as docs/nvml.md shows")
        from sandbox.runtimes.kindapi import install_nvml

        for path in install_nvml(session.state_dir):
            print(f"our NVML for the node's pods: {path}")
    argv = ["kubectl", "--kubeconfig", str(kubeconfig), "apply", "-f", "-"]
    result = subprocess.run(argv, input=plugin.text(), text=True, capture_output=True,
                            check=False)
    if result.returncode != 0:
        raise CommandError(argv, result.returncode, result.stdout + result.stderr)
    sys.stdout.write(result.stdout)
    return 0

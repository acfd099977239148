"""`sandbox plugins list|show|deploy`: the bundled plugin manifests."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from sandbox import commands
from sandbox.errors import SandboxError
from sandbox.manifests import PLUGINS, find_plugin
from sandbox.session import find_session
from sandbox.textui import dump, table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plugins",
        help="bundled device plugin and DRA driver manifests",
        description="Ready manifests for our reference plugins and well-known third-party "
        "ones, adapted only through hostPaths that point at each node's fake tree "
        "(/var/lib/hw-sandbox/root on the node).",
    )
    verbs = p.add_subparsers(dest="plugins", metavar="ACTION", required=True)
    ls = verbs.add_parser("list", help="what is bundled, what each shows, which profile suits it")
    ls.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    show = verbs.add_parser("show", help="print a plugin's manifest")
    show.add_argument("plugin")
    deploy = verbs.add_parser("deploy", help="apply a plugin's manifest to a running sandbox")
    deploy.add_argument("plugin")
    deploy.add_argument("--name", help="which sandbox (default: the only one running)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.plugins == "list":
        rows = [(p.name, p.kind, p.profiles, p.shows) for p in PLUGINS]
        if args.output == "table":
            print(table(("NAME", "KIND", "SUITS", "WHAT IT SHOWS"), rows))
            return 0
        dump([dict(zip(("name", "kind", "suits", "shows"), r, strict=True)) for r in rows],
             args.output)
        return 0
    plugin = find_plugin(args.plugin)
    if args.plugins == "show":
        sys.stdout.write(plugin.text())
        return 0
    session = find_session(args.name)
    kubeconfig = session.record.kubeconfig
    native = session.runtime == "native"
    if not kubeconfig:
        raise SandboxError(
            f"sandbox {session.name!r} runs the {session.runtime} runtime, which has no API "
            "server to deploy to; use --runtime native or kind")
    text = plugin.text()
    kubectl = "kubectl"
    if native:
        from sandbox.runtimes.native.hostpaths import link_host_paths

        # the node is this host: its /var/lib/hw-sandbox/* (the manifests' hostPaths)
        # become links to this sandbox's directories, removed by `sandbox down`
        for link, target in link_host_paths(session.state_dir).items():
            print(f"node path {link} -> {target}")
        built = Path(session.record.bin_dir or "") / "kubectl"
        kubectl = str(built) if built.is_file() else kubectl
    if plugin.nvml:
        if session.runtime == "kind":
            from sandbox.runtimes.kind.api import install_nvml

            for path in install_nvml(session.state_dir):
                print(f"our NVML for the node's pods: {path}")
        elif native:
            from sandbox.runtimes.native import hostpaths

            print(f"our NVML for the node's pods: {hostpaths.install_nvml(session.state_dir)}")
            text = _native_outputs(text, hostpaths.NFD_FEATURES,
                                   str(hostpaths.HOST_STATE / "features.d"))
        else:
            raise SandboxError(f"{plugin.name} needs a kind or native sandbox")
    argv = [kubectl, "--kubeconfig", str(kubeconfig), "apply", "-f", "-"]
    result = commands.run(argv, input=text, timeout=None)
    sys.stdout.write(result.stdout)
    return 0


def _native_outputs(text: str, host_path: str, instead: str) -> str:
    """The manifest with every hostPath volume at ``host_path`` moved to ``instead``: on
    the native runtime a pod's hostPath is the host's own, and nothing of a sandbox may be
    left in the host's /etc."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    moved = 0
    for doc in docs:
        volumes = doc.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", [])
        for volume in volumes:
            if volume.get("hostPath", {}).get("path") == host_path:
                volume["hostPath"]["path"] = instead
                moved += 1
    if moved == 0:
        return text
    print(f"node path {host_path} (gpu-feature-discovery's output) is {instead} on native")
    return yaml.safe_dump_all(docs, sort_keys=False)

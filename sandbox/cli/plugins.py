"""`sandbox plugins list|show|deploy|template`: the bundled plugin manifests, and a
manifest for a plugin author's own image (``sandbox.manifests.plugin_template``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import yaml

from sandbox import commands
from sandbox.errors import SandboxError
from sandbox.manifests import PLUGINS, find_plugin, plugin_template
from sandbox.outfile import write_file
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
    deploy = verbs.add_parser(
        "deploy", help="apply a plugin's manifest to a running sandbox",
        description="Apply a bundled plugin's manifest, or a manifest file of your own (such "
        "as `sandbox plugins template` writes), to a kind or native sandbox. On native the "
        "node is this host: /var/lib/hw-sandbox/root is linked to the sandbox's tree first.")
    deploy.add_argument("plugin", metavar="PLUGIN|FILE",
                        help="a bundled plugin's name, a manifest file (*.yaml, or a path "
                        "with a /), or - for standard input")
    deploy.add_argument("--name", help="which sandbox (default: the only one running)")
    template = verbs.add_parser(
        "template", help="a DaemonSet for your own plugin image on the fake hardware",
        description="Print a commented manifest that runs your plugin IMAGE on every node "
        "the sandbox serves, with the node's fake /sys at /sys, the node's /dev (a stand-in "
        "device node for every fake one) at /dev, the whole fake tree at /hw-sandbox/root "
        "(its dev/ and proc/driver: a pod can have neither at the real path) and the "
        "kubelet's device plugin (--dra: DRA) directories. Then: `sandbox load IMAGE` and "
        "`sandbox plugins deploy FILE`.")
    template.add_argument("--image", required=True, help="your plugin's image (name:tag)")
    template.add_argument("--name", help="the DaemonSet's name, a DNS-1123 label (default: "
                          "from the image's name)")
    template.add_argument("--namespace", default="kube-system", help="default: kube-system")
    template.add_argument("--command", action="append", default=[], metavar="CMD",
                          help="the program and its first words, split as a shell would "
                          "(default: the image's ENTRYPOINT); repeatable")
    template.add_argument("--args", action="append", default=[], metavar="ARGS",
                          help="its arguments, split as a shell would (default: the image's "
                          "CMD); repeatable; one beginning with - as --args=-v")
    template.add_argument("--dra", action="store_true",
                          help="a DRA driver's kubelet plugin: its RBAC, plugins_registry "
                          "and plugins dirs, /var/run/cdi")
    template.add_argument("-o", "--output", metavar="FILE",
                          help="write it to FILE (default: standard output); never "
                          "overwritten without --force")
    template.add_argument("--force", action="store_true", help="overwrite an existing FILE")
    p.set_defaults(func=run)


def _words(values: list[str], flag: str) -> list[str]:
    out = []
    for value in values:
        try:
            out += shlex.split(value)
        except ValueError as exc:
            raise SandboxError(f"{flag} {value!r}: {exc}") from None
    return out


def _template(args: argparse.Namespace) -> int:
    text = plugin_template(args.image, args.name, args.namespace,
                           _words(args.command, "--command"), _words(args.args, "--args"),
                           dra=args.dra)
    if args.output and args.output != "-":
        write_file(args.output, text, force=args.force)
        print(f"wrote {args.output}; next: sandbox load {shlex.quote(args.image)} && "
              f"sandbox plugins deploy {shlex.quote(args.output)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _own_manifest(arg: str) -> str | None:
    """The text of a manifest file named on the command line (``-``: stdin); None when
    ``arg`` names a bundled plugin."""
    if arg == "-":
        return sys.stdin.read()
    if "/" not in arg and not arg.endswith((".yaml", ".yml")):
        return None
    try:
        return Path(arg).read_text()
    except OSError as exc:
        raise SandboxError(f"{arg}: cannot read the manifest: {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    if args.plugins == "list":
        rows = [(p.name, p.kind, p.profiles, p.shows) for p in PLUGINS]
        if args.output == "table":
            print(table(("NAME", "KIND", "SUITS", "WHAT IT SHOWS"), rows))
            return 0
        dump([dict(zip(("name", "kind", "suits", "shows"), r, strict=True)) for r in rows],
             args.output)
        return 0
    if args.plugins == "template":
        return _template(args)
    own = _own_manifest(args.plugin) if args.plugins == "deploy" else None
    plugin = None if own is not None else find_plugin(args.plugin)
    text = plugin.text() if plugin is not None else own or ""
    if args.plugins == "show":
        sys.stdout.write(text)
        return 0
    if not text.strip():
        raise SandboxError(f"{args.plugin}: the manifest is empty")
    session = find_session(args.name)
    kubeconfig = session.record.kubeconfig
    native = session.runtime == "native"
    if not kubeconfig:
        raise SandboxError(
            f"sandbox {session.name!r} runs the {session.runtime} runtime, which has no API "
            "server to deploy to; use --runtime native or kind")
    kubectl = "kubectl"
    if native:
        from sandbox.runtimes.native.hostpaths import link_host_paths

        # the node is this host: its /var/lib/hw-sandbox/* (the manifests' hostPaths)
        # become links to this sandbox's directories, removed by `sandbox down`
        for link, target in link_host_paths(session.state_dir).items():
            print(f"node path {link} -> {target}")
        built = Path(session.record.bin_dir or "") / "kubectl"
        kubectl = str(built) if built.is_file() else kubectl
    if plugin is not None and plugin.nvml:
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

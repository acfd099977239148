"""`sandbox plugins list|show|deploy|template`: the bundled plugin manifests, and a
manifest for a plugin author's own image (``sandbox.manifests.plugin_template``)."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    deploy.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set this environment variable in every container of the "
                        "manifest's workloads, replacing the manifest's value (repeatable), "
                        "e.g. `--env FEATURE_GATES=DynamicMIG=true` for NVIDIA's DRA driver")
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
    if args.env:
        text = _with_env(text, _env_pairs(args.env))
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
        else:
            raise SandboxError(f"{plugin.name} needs a kind or native sandbox")
    if native:
        text = _native_manifest(text, session.state_dir)
    argv = [kubectl, "--kubeconfig", str(kubeconfig), "apply", "-f", "-"]
    result = commands.run(argv, input=text, timeout=None)
    sys.stdout.write(result.stdout)
    return 0


def _env_pairs(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, setting = value.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SandboxError(f"--env {value!r}: expected NAME=VALUE (NAME a variable name)")
        out[name] = setting
    return out


def _pod_specs(docs: list[Any]) -> Iterator[dict[str, Any]]:
    """The pod specs of the workloads in ``docs`` (DaemonSets, Deployments, Jobs, Pods)."""
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        pod = doc.get("spec", {}).get("template", {}).get("spec") if doc.get("kind") != "Pod" \
            else doc.get("spec")
        if isinstance(pod, dict):
            yield pod


def _with_env(text: str, env: dict[str, str]) -> str:
    """``text`` with ``env`` set in every container of its workloads (replacing values)."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    pods = list(_pod_specs(docs))
    if not pods:
        raise SandboxError("--env: the manifest has no workload (DaemonSet, Deployment, ...) "
                           "to set it in")
    for pod in pods:
        for container in pod.get("containers", []):
            kept = [e for e in container.get("env", []) if e.get("name") not in env]
            container["env"] = kept + [{"name": k, "value": v} for k, v in env.items()]
    return yaml.safe_dump_all(docs, sort_keys=False)


def _native_manifest(text: str, state_dir: Path) -> str:
    """The manifest as the native runtime's node needs it, where a pod's hostPath is the
    host's own and there is no kube-proxy: gpu-feature-discovery's output moves from the
    host's /etc to /var/lib/hw-sandbox/features.d, a DRA driver's /var/run/cdi and
    /var/run/nri to the sandbox containerd's CDI and NRI dirs (nothing of a sandbox is left
    in the host's /etc or /run),
    and a pod with a service account reaches the API server at the host's address (the
    Service IP does not route). Unchanged text when nothing applies."""
    from sandbox.runtimes.native import Layout
    from sandbox.runtimes.native.hostpaths import HOST_STATE, NFD_FEATURES
    from sandbox.runtimes.record import read_record

    record = read_record(state_dir)
    moves = {NFD_FEATURES: str(HOST_STATE / "features.d"),
             "/var/run/cdi": str(Layout(state_dir).cdi_plugins),
             "/var/run/nri": str(Layout(state_dir).nri)}
    docs = [d for d in yaml.safe_load_all(text) if d]
    changed = False
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {}) if isinstance(doc, dict) \
            else {}
        for volume in pod.get("volumes", []):
            path = volume.get("hostPath", {}).get("path")
            if path in moves:
                volume["hostPath"]["path"] = moves[path]
                print(f"node path {path} is {moves[path]} on native")
                changed = True
        port = (record.ports or {}).get("apiserver") if record is not None else None
        if pod.get("serviceAccountName") and record is not None and record.host_ip and port:
            api = {"KUBERNETES_SERVICE_HOST": str(record.host_ip),
                   "KUBERNETES_SERVICE_PORT": str(port)}
            for container in pod.get("containers", []):
                env = container.setdefault("env", [])
                have = {e.get("name") for e in env}
                env += [{"name": k, "value": v} for k, v in api.items() if k not in have]
            changed = True
    return yaml.safe_dump_all(docs, sort_keys=False) if changed else text

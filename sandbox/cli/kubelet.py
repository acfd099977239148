"""`sandbox kubelet serve|check`: the kubelet harness as a command.

``serve`` runs the harness server (``sandbox.kubelet.harness``, also ``python -m
sandbox.kubelet``): a device manager on a device-plugins directory until SIGTERM/SIGINT,
restarted as a kubelet restart does on SIGHUP, with a JSON status file of what it sees.
``check`` grades a device plugin's kubelet protocol behaviour (``sandbox.kubelet.check``):
as it is, or (``--profile``) unmodified on a profile's node served live
(``sandbox.kubelet.livenode``, ``nodeview``); ``--junit`` writes the report for CI
(``sandbox.kubelet.junit``).

The status file's format and its reader and writer are ``sandbox.kubelet.status``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sandbox.errors import SandboxError
from sandbox.kubelet import CheckReport, check
from sandbox.kubelet.conformance import check_program, shell_fault
from sandbox.kubelet.harness import RESTART_SIGNALS, serve_harness
from sandbox.kubelet.junit import junit_xml
from sandbox.kubelet.livenode import check_on_node, pick_node, require_host
from sandbox.outfile import check_target, write_file
from sandbox.profile.bundled import PROFILE_HELP
from sandbox.supervisor import sigterm_as_interrupt
from sandbox.textui import dump

CHECK_DESCRIPTION = """\
Start PLUGIN-CMD (after --) against a fresh kubelet harness and print one line per
check; exit 1 if any fails.

Without --profile the plugin runs as it is: `{kubelet_dir}` in PLUGIN-CMD becomes the
harness's device-plugins directory (also in KUBELET_DEVICE_PLUGIN_DIR and
PLUGIN_SOCK_DIR), and the health-update check runs only with --fault.

With --profile (root) the profile's node is served live over FUSE, and the plugin runs
unmodified in a private mount namespace of its own where the node's tree is /sys, /dev
(the host's null, zero, full, random and urandom kept) and /proc/driver, and the
harness is /var/lib/kubelet/device-plugins; the check makes one advertised device
unhealthy itself. The host's /sys, /dev and /var/lib/kubelet are never touched, and
nothing is left after it (no mount, process or temp dir), Ctrl-C and SIGTERM included."""

CHECK_EPILOG = """\
examples:
  sudo sandbox kubelet check --profile 8gpu-2numa --junit report.xml -- ./my-plugin
  sandbox kubelet check --fault 'sandbox fault --socket S health gpu-worker gpu1 unhealthy' \\
      -- python3 -m hwplugins.deviceplugin --root R --kubelet-dir {kubelet_dir}"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "kubelet",
        help="a kubelet stand-in for device plugins: serve, or grade a plugin",
        description="The kubelet's device-plugin side, without a cluster: `serve` listens on "
        "DIR/kubelet.sock as the kubelet does and records what plugins advertise; `check` runs "
        "a plugin against it and grades its protocol behaviour.",
    )
    verbs = p.add_subparsers(dest="kubelet", metavar="ACTION", required=True)

    s = verbs.add_parser(
        "serve",
        help="serve Registration on DIR/kubelet.sock until stopped",
        description="Run a device manager on DIR (its device-plugins directory) until SIGTERM "
        "or SIGINT. Prints `ready` once kubelet.sock listens. The restart signal (SIGHUP by "
        "default) does what a kubelet restart does: every socket in DIR is deleted, kubelet.sock "
        "is made again and plugins must register again.",
    )
    s.add_argument("--dir", type=Path, required=True, help="device-plugins directory")
    s.add_argument(
        "--status-file", type=Path, help="keep this JSON file up to date with the resources seen"
    )
    s.add_argument(
        "--numa-nodes",
        type=int,
        metavar="N",
        help="the node has NUMA nodes 0..N-1 (default: those the devices name)",
    )
    s.add_argument(
        "--restart-on",
        choices=(*RESTART_SIGNALS, "none"),
        default="SIGHUP",
        help="signal that restarts the kubelet (default SIGHUP)",
    )
    s.set_defaults(func=run)

    c = verbs.add_parser(
        "check",
        help="grade a device plugin: registration, ListAndWatch, Allocate, health, restart",
        description=CHECK_DESCRIPTION,
        epilog=CHECK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--profile", metavar="PROFILE",
                   help=f"serve this profile's node live and run the plugin on it ({PROFILE_HELP})")
    c.add_argument("--node", metavar="NAME",
                   help="with --profile: node (replica) name; may be omitted when it has one")
    c.add_argument("--index", type=int, metavar="I",
                   help="with --profile: replica index of a counted node")
    c.add_argument("--resource", help="grade this resource (default: the first registered)")
    c.add_argument(
        "--fault",
        metavar="SHELL-CMD",
        help="command that makes a device unhealthy, for the health-update check (with "
        "--profile it replaces the check's own fault and finds the node in "
        "$HWSANDBOX_CONTROL_SOCKET, $HWSANDBOX_NODE)",
    )
    c.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for each step (default 10)"
    )
    c.add_argument(
        "--restart-within",
        type=float,
        default=5.0,
        help="seconds a plugin has to re-register after a kubelet restart (default 5)",
    )
    c.add_argument(
        "--log", action="store_true", help="also print the protocol log and the plugin's output"
    )
    c.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text",
                   help="json/yaml: every check with its status and message, the protocol "
                   "log and the plugin's output")
    c.add_argument("--junit", metavar="FILE", type=Path,
                   help="also write the checks as JUnit XML for CI (one testsuite "
                   "sandbox-kubelet-check; a regular file there is replaced)")
    c.add_argument("plugin", nargs=argparse.REMAINDER, metavar="-- PLUGIN-CMD...")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.kubelet == "serve":
        return _serve(args)
    return _check(args)


# serve ---------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    serve_harness(args.dir, status_file=args.status_file, numa_nodes=args.numa_nodes,
                  restart_on=None if args.restart_on == "none" else args.restart_on)
    return 0


# check ---------------------------------------------------------------------------------------


def _check(args: argparse.Namespace) -> int:
    plugin = list(args.plugin)
    if plugin[:1] == ["--"]:
        plugin = plugin[1:]
    if not plugin:
        raise SandboxError("kubelet check: give the plugin command after --")
    check_program(plugin[0])
    if args.junit is not None:
        check_target(args.junit, force=True)  # a bad name fails before anything runs
    spec = None
    if args.profile is not None:
        spec = pick_node(args.profile, args.node, args.index)  # its errors come first
        require_host()
    elif args.node is not None or args.index is not None:
        raise SandboxError("--node and --index go with --profile")
    started = time.time()
    with sigterm_as_interrupt():  # a CI job's timeout cleans up as Ctrl-C does
        if spec is not None:
            report = check_on_node(plugin, spec, fault_cmd=args.fault, resource=args.resource,
                                   timeout=args.timeout, restart_within=args.restart_within)
        else:
            report = _check_in_dir(args, plugin)
    if args.junit is not None:
        props = {"plugin": shlex.join(plugin)}
        if spec is not None:
            props |= {"profile": args.profile, "node": spec.name}
        write_file(args.junit, junit_xml(report, props, started=started), force=True)
    if args.output != "text":
        dump({"passed": report.passed,
              "checks": [dataclasses.asdict(r) for r in report.results],
              "events": [dataclasses.asdict(e) for e in report.events],
              "plugin_output": report.plugin_output}, args.output)
        return 0 if report.passed else 1
    print(report)
    if args.log or not report.passed:
        print("\n--- protocol log ---")
        for event in report.events:
            print(event)
        print("--- plugin output (last 40 lines) ---")
        print("\n".join(report.plugin_output.splitlines()[-40:]))
    failed = sum(r.status == "fail" for r in report.results)
    print(f"\nresult: {'FAILED' if failed else 'PASSED'} "
          f"({failed} of {len(report.results)} checks failed)")  # fmt: skip
    sys.stdout.flush()
    return 0 if report.passed else 1


def _check_in_dir(args: argparse.Namespace, plugin: list[str]) -> CheckReport:
    # Plugin sockets sit beside kubelet.sock: keep the directory short (unix paths <= 105).
    workdir = Path(tempfile.mkdtemp(prefix="kc-", dir="/tmp"))
    try:
        return check(plugin, workdir=workdir, resource=args.resource,
                     fault=shell_fault(args.fault) if args.fault else None,
                     timeout=args.timeout, restart_within=args.restart_within)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

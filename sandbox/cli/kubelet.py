"""`sandbox kubelet serve|check`: the kubelet harness as a command.

``serve`` runs the harness server (``sandbox.kubelet.harness``, also ``python -m
sandbox.kubelet``): a device manager on a device-plugins directory until SIGTERM/SIGINT,
restarted as a kubelet restart does on SIGHUP, with a JSON status file of what it sees.
``check`` grades a device plugin's kubelet protocol behaviour (``sandbox.kubelet.check``).

The status file's format and its reader and writer are ``sandbox.kubelet.status``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

from sandbox import commands
from sandbox.errors import SandboxError
from sandbox.kubelet import check
from sandbox.kubelet.harness import RESTART_SIGNALS, serve_harness
from sandbox.textui import dump


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
        help="grade a device plugin: registration, ListAndWatch, Allocate, restart",
        description="Start PLUGIN-CMD (after --) against a fresh harness and print one line "
        "per check; exit 1 if any fails. `{kubelet_dir}` in PLUGIN-CMD is replaced by the "
        "harness's device-plugins directory, also passed as KUBELET_DEVICE_PLUGIN_DIR and "
        "PLUGIN_SOCK_DIR.",
        epilog="example: sandbox kubelet check --fault 'sandbox fault --socket S health "
        "gpu-worker gpu1 unhealthy' -- python -m hwplugins.deviceplugin --root R "
        "--kubelet-dir {kubelet_dir}",
    )
    c.add_argument("--resource", help="grade this resource (default: the first registered)")
    c.add_argument(
        "--fault",
        metavar="SHELL-CMD",
        help="command that makes a device unhealthy, for the health-update check",
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
    fault_cmd: str | None = args.fault

    def fault() -> None:
        assert fault_cmd is not None
        result = commands.run(["sh", "-c", fault_cmd], check=False, timeout=None)
        if result.returncode != 0:
            raise SandboxError(f"--fault {fault_cmd!r} failed (exit {result.returncode}): "
                               f"{result.stderr.strip()}")  # fmt: skip

    # Plugin sockets sit beside kubelet.sock: keep the directory short (unix paths <= 105).
    workdir = Path(tempfile.mkdtemp(prefix="kc-", dir="/tmp"))
    try:
        report = check(plugin, workdir=workdir, resource=args.resource,
                       fault=fault if fault_cmd else None, timeout=args.timeout,
                       restart_within=args.restart_within)  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
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

"""`sandbox up PROFILE`: bring up a sandbox (kind where possible, else local).

Interrupting it (SIGINT, Ctrl-C) has one rule, whatever the moment: before the ``is up``
line, everything made so far is removed and ``up`` exits 130 (before it has made
anything it simply dies of the signal, as any program; a shell shows 130 too); once the
line is printed the sandbox is up, ``up`` only exits (0) and ignores SIGINT, and the
sandbox stays until ``sandbox down``. ``up`` returns right after that line: the servers
run detached, nothing stays in the foreground. In between, a SIGINT raises
KeyboardInterrupt, except where a process is being started and recorded
(``steps.interrupts_held``), and the clean-up itself is not interrupted by another.

From before its first record until it exits, ``up`` holds the sandbox's lock
(``base.StateLock``): ``sandbox down`` of that name, or another ``sandbox up`` of it,
refuses with "is coming up" meanwhile instead of removing (or reusing) what this one is
still making.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hwplugins.dra.devtypes import TYPES as DRA_DEVICE_TYPES

from sandbox.cli import on_sigint
from sandbox.errors import OptionRefused, SandboxError
from sandbox.profile import PROFILE_HELP, STDIN_NAME, LoadedProfile, load_profile
from sandbox.runtimes import RUNTIMES, choose_runtime, runtime_for
from sandbox.runtimes.base import STDIN_COPY, default_state_root, state_dir_for
from sandbox.runtimes.bringup import bring_up
from sandbox.runtimes.record import check_name
from sandbox.session import list_sessions


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up",
        help="start a sandbox from a hardware profile",
        description="Start every node of PROFILE with its fake hardware and device plugins. "
        "Runtimes: kind (default where a Docker daemon answers and kind is on PATH; node "
        "image from SANDBOX_KIND_IMAGE, else hw-sandbox/kind-node:v1.37.2 if built by "
        "scripts/build-kind-node-image, else kind's default; see docs/kind-runtime.md), "
        "local (FUSE trees + the reference device plugin + a kubelet harness; works on any "
        "Linux with FUSE, no Kubernetes), native (a real single-node Kubernetes built from "
        "source; see docs/native-runtime.md). State lives in "
        f"{default_state_root()}/NAME (HWSANDBOX_STATE_DIR overrides).",
        epilog="Ctrl-C (SIGINT) before the 'is up' line removes everything made so far "
        "and exits 130; once 'is up' is printed, up has finished (the sandbox's processes "
        "run detached) and the sandbox stays up until `sandbox down`. While up runs, "
        "`sandbox down` (or another `sandbox up`) of the same name refuses: the sandbox "
        "is coming up. A failed up removes what it made (unless --retain), a full state "
        "root included: one error line, nothing left.",
    )
    p.add_argument("profile", metavar="PROFILE", help=PROFILE_HELP)
    p.add_argument("--runtime", choices=("auto", *RUNTIMES), default="auto")
    p.add_argument("--name", help="sandbox name (default: the profile's metadata.name)")
    p.add_argument("--retain", action="store_true",
                   help="on failure keep what was made, for debugging")
    p.add_argument("--no-device-plugin", action="store_true",
                   help="serve the fake hardware but run no reference device plugin (kind "
                   "and native runtimes), so that a third-party plugin you deploy next "
                   "(`sandbox plugins deploy nvidia-device-plugin`) is the only one "
                   "advertising it")
    p.add_argument("--kubelet-topology", choices=("emulated", "host"), default="emulated",
                   help="emulated (default, kind and native runtimes): each node's kubelet "
                   "sees the profile's CPUs, NUMA nodes and memory, and applies its CPU, "
                   "topology and memory manager settings; host: the kubelet sees this "
                   "machine, and only the topology manager policy applies (kind: not even "
                   "that, and no kubelet restart during up)")
    p.add_argument("--pre-start-required", action="store_true",
                   help="the reference device plugin asks the kubelet to call its "
                   "PreStartContainer before every container holding one of its devices "
                   "(kind and native runtimes; the call shows in the plugin's log)")
    p.add_argument("--feature-gates", metavar="A=true,B=false", type=parse_feature_gates,
                   help="Kubernetes feature gates for every component (native runtime only: "
                   "kube-apiserver, controller-manager, scheduler, kubelet), e.g. "
                   "DRADeviceCompatibilityGroups=true,DRAOptionalNodeOperations=true")
    dra = p.add_argument_group(
        "DRA driver (native runtime only; any of these runs our reference DRA driver on the "
        "node, as HWSANDBOX_NATIVE_DRA=1 does)")
    dra.add_argument("--dra-driver", action="store_true",
                     help="run the reference DRA driver (hwplugins.dra) next to the device "
                     "plugin")
    dra.add_argument("--dra-compatibility-groups", action="store_true",
                     help="publish every partition mode with compatibility groups (needs "
                     "--feature-gates DRADeviceCompatibilityGroups=true)")
    dra.add_argument("--dra-skip-node-operations", metavar="TYPES",
                     type=parse_device_types,
                     help="comma-separated device types published for the control plane "
                     f"only ({', '.join(DRA_DEVICE_TYPES)}): no NodePrepare/Unprepare (needs "
                     "--feature-gates DRAOptionalNodeOperations=true)")
    p.set_defaults(func=run)


_NO_PLUGIN_LOCAL = ("--no-device-plugin needs the kind or native runtime (the local runtime "
                    "is our device plugin and a kubelet harness, nothing else would run)")
# what a runtime refused (OptionRefused.option), in the flags' words
_REFUSED = {
    "reference_plugin": _NO_PLUGIN_LOCAL,
    "plugin_options": "--pre-start-required needs the kind or native runtime",
    "feature_gates": "runtime {runtime} takes no feature gates or DRA options",
    "dra_options": "runtime {runtime} takes no feature gates or DRA options",
    "dra_driver": "runtime {runtime} takes no feature gates or DRA options",
}


def parse_device_types(text: str) -> list[str]:
    types = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in types if t not in DRA_DEVICE_TYPES]
    if bad or not types:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or repr(text)}: not a device type (one or more of "
            f"{', '.join(DRA_DEVICE_TYPES)}, comma-separated)")
    return types


def dra_options(args: argparse.Namespace, gates: dict[str, bool]) -> list[str]:
    """The DRA driver's extra flags from ``sandbox up``'s; refuses an alpha option whose
    feature gate is not on (the API server would drop the fields, silently)."""
    options: list[str] = []
    if args.dra_compatibility_groups:
        options.append("--compatibility-groups")
    if args.dra_skip_node_operations:
        options += ["--skip-node-operations", ",".join(args.dra_skip_node_operations)]
    needs = {"--compatibility-groups": "DRADeviceCompatibilityGroups",
             "--skip-node-operations": "DRAOptionalNodeOperations"}
    for flag, gate in needs.items():
        if flag in options and not gates.get(gate):
            raise SandboxError(f"--dra-{flag.removeprefix('--')} needs the {gate} feature gate: "
                               f"add --feature-gates {gate}=true")
    return options


def parse_feature_gates(text: str) -> dict[str, bool]:
    """``A=true,B=false`` -> {"A": True, "B": False}; argparse reports a ValueError."""
    gates: dict[str, bool] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if not sep or not name or value not in ("true", "false"):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not NAME=true or NAME=false (e.g. "
                "--feature-gates DRADeviceCompatibilityGroups=true,DRAConsumableCapacity=false)")
        if not name.isidentifier():
            raise argparse.ArgumentTypeError(f"{name!r} is not a feature gate name")
        gates[name] = value == "true"
    if not gates:
        raise argparse.ArgumentTypeError("no feature gates given (NAME=true,NAME=false)")
    return gates


def run(args: argparse.Namespace) -> int:
    # Until something is made, a SIGINT ends `up` at once (killed by the signal, as any
    # program): nothing to undo, and no traceback from inside an import.
    on_sigint(signal.SIG_DFL)
    if args.name is not None:
        check_name(args.name)  # before anything is loaded, started or created
    # the runtime's options, refused before anything is checked, started or created
    wants_dra = bool(args.dra_driver or args.dra_compatibility_groups
                     or args.dra_skip_node_operations)
    gates = dict(args.feature_gates or {})
    options = dra_options(args, gates)
    if (gates or wants_dra) and args.runtime != "native":
        what = "--feature-gates needs" if gates else "the --dra-* options need"
        raise SandboxError(f"{what} --runtime native (not {args.runtime}: only the native "
                           "runtime runs its own Kubernetes components)")
    if args.no_device_plugin and args.runtime == "local":
        raise SandboxError(_NO_PLUGIN_LOCAL)
    if args.pre_start_required and (args.runtime == "local" or args.no_device_plugin):
        raise SandboxError("--pre-start-required is for the reference device plugin on a "
                           "real kubelet: --runtime native or kind, without --no-device-plugin")
    loaded = load_profile(args.profile)
    name = args.name or loaded.cluster.name
    # the runtime's options, given when it is made (each runtime refuses what it lacks)
    chosen: dict[str, Any] = {}
    if args.no_device_plugin:
        chosen["reference_plugin"] = False
    if args.kubelet_topology == "host":
        chosen["emulate_topology"] = False
    if args.pre_start_required:
        chosen["plugin_options"] = ("--pre-start-required",)
    if gates or wants_dra:
        chosen.update(feature_gates=gates, dra_options=options)
        if wants_dra:
            chosen["dra_driver"] = True
    try:
        if args.runtime == "auto":
            runtime, why = choose_runtime(**chosen)
            print(f"runtime: {runtime.name}; {why}", file=sys.stderr)
        else:
            runtime = runtime_for(args.runtime, **chosen)
            reason = runtime.unavailable_reason()
            if reason:
                # the same words as a failed step: nothing was made yet, nothing to undo
                raise SandboxError(f"sandbox up failed at step 'preflight': the "
                                   f"{args.runtime} runtime cannot run here: {reason}")
            print(f"runtime: {runtime.name}", file=sys.stderr)
    except OptionRefused as exc:  # auto chose local
        raise SandboxError(_REFUSED.get(exc.option, "").format(runtime=exc.runtime)
                           or str(exc)) from None
    state_dir = state_dir_for(name)
    # From here on something may be made: a SIGINT is a KeyboardInterrupt, and the
    # clean-up (bringup.bring_up) removes everything made so far (see the docstring).
    on_sigint(signal.default_int_handler)
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"  [{time.monotonic() - started:5.1f}s] {message}", file=sys.stderr, flush=True)

    # Up, or failed: from then on SIGINT is ignored (one is enough: neither the "is up"
    # line nor the clean-up, and the fusermount3 it runs in our process group, is cut).
    _lock = bring_up(runtime, loaded.cluster, _profile_file(loaded, state_dir), state_dir,
                    progress, retain=args.retain,
                    stdin_text=loaded.text if loaded.path == STDIN_NAME else None,
                    settle=lambda: on_sigint(signal.SIG_IGN))
    elapsed = time.monotonic() - started
    # with another sandbox beside it, the bare verbs would ask which one
    which = f" --name {name}" if len(list_sessions(state_dir.parent)) > 1 else ""
    hints = [(f"sandbox status{which}", "what the kubelet sees"),
             (f"sandbox fault{which} list", "devices and their health"),
             (f"sandbox down{which}", "remove it")]
    if runtime.name != "local":  # the runtimes with an API server
        hints.insert(2, (f"sandbox kubeconfig{which}", "for kubectl (--path: the file)"))
    width = max(len(c) for c, _ in hints) + 2
    print(f"sandbox {name!r} is up ({runtime.name} runtime, {elapsed:.1f}s). Next:\n"
          + "\n".join(f"  {c:<{width}}{what}" for c, what in hints), flush=True)
    # `_lock` is not released: the process's exit drops it, so a `down` that gets it
    # knows this `up` is over.
    return 0


def _profile_file(loaded: LoadedProfile, state_dir: Path) -> str:
    """The profile file the sandbox's record names (``status`` and ``fault`` read it again):
    the file read, or for a profile read from stdin the copy ``up`` keeps in the state dir
    once the runtime is up."""
    if loaded.path != STDIN_NAME:
        return os.path.abspath(loaded.path)
    return str(state_dir / STDIN_COPY)



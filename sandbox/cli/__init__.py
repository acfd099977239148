"""The ``sandbox`` command line: one small module per verb, each registering itself here.

A verb module exposes ``register(subparsers)`` which adds its parser and sets
``func=run`` where ``run(args) -> int``. Verbs parse flags and call the library; they hold
no logic of their own. Only ``SandboxError`` is caught: it prints ``error: ...`` (every
line of it) and exits 1, with the traceback only under ``-v``; so is an ``OSError`` of a
full disk (``No space left on device``, a quota), which is the machine's, not a bug.

Ctrl-C (SIGINT), run as the program (``python -m sandbox``, the console script): from
this module's first statement (after two imports of modules the interpreter has loaded
already) until the verb runs, a SIGINT ends the process at once, killed by the signal as
any program's would be: nothing is made while Python imports and the arguments are
parsed, and no traceback comes from inside an import. Before that statement the
interpreter is still starting (``site``, ``runpy``): what a SIGINT does there is Python's
own. The verb then sees a SIGINT as KeyboardInterrupt, which prints ``interrupted`` and
exits 130 (``sandbox up`` keeps its own rule: ``sandbox.cli.up``).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the C module: loaded at start-up
import sys

if (getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
        == "sandbox.__main__"
        or str(getattr(sys.modules.get("__main__"), "__file__", None) or "").endswith(
            "/sandbox")):
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)  # run as the program: see above

import os  # noqa: E402 - after the line above, on purpose
import signal  # noqa: E402
import threading  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from sandbox import __version__  # noqa: E402

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence
    from types import FrameType
    from typing import Any

# Verb modules, in the order `sandbox --help` lists them, with their one-line help.
# Only the verb being run is imported, so every command starts fast.
VERBS = {
    "up": "start a sandbox from a hardware profile",
    "down": "stop a sandbox and remove its processes, mounts and state",
    "list": "list the sandboxes",
    "status": "show nodes, devices per NUMA node, health, capacity vs allocatable",
    "kubeconfig": "print a sandbox's kubeconfig (kind and native runtimes)",
    "wait": "wait until resources are allocatable (RESOURCE=N), e.g. after deploying a plugin",
    "profiles": "list the bundled hardware profiles",
    "validate": "check hardware profiles",
    "show": "summarise a profile: NUMA nodes, CPUs, memory, devices",
    "schema": "print the profile JSON Schema",
    "render": "write a node's fake /sys, /dev, /proc to a directory",
    "capture": "write a hardware profile of this machine's /sys and /proc",
    "mount": "serve a node's fake /sys, /dev, /proc live over FUSE",
    "fault": "inject faults: device health, unplug/plug, SR-IOV VFs, kubelet restart",
    "kubelet": "a kubelet stand-in: serve, or check a device plugin's protocol",
    "dra": "what the reference DRA driver would publish",
    "plugins": "bundled device plugin and DRA driver manifests",
    "load": "put local images into a sandbox's nodes (kind, native)",
    "completion": "print a shell completion script (bash, zsh, fish)",
}


def _chosen_verb(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in VERBS else None
    return None


def build_parser(argv: Sequence[str] = (), every_verb: bool = False) -> argparse.ArgumentParser:
    """The parser for ``argv``: only the verb it names is imported and registered whole
    (every verb with ``every_verb``, for `sandbox completion`)."""
    import argparse
    import importlib
    import importlib.util

    parser = argparse.ArgumentParser(
        prog="sandbox",
        description=(
            "Emulate GPUs, NICs, FPGAs and NUMA topology for local Kubernetes: a YAML "
            "hardware profile becomes a fake /sys and /dev that real device plugins read."
        ),
        epilog="Start with: sandbox up profiles/8gpu-2numa.yaml   (see `sandbox COMMAND --help`)",
    )
    parser.add_argument("--version", action=_version_action(), nargs=0,
                        help="show the version and the pinned Kubernetes, kind and "
                        "containerd versions, and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen_verb(argv)
    for verb, summary in VERBS.items():
        if importlib.util.find_spec(f"sandbox.cli.{verb}") is None:
            continue  # not built yet
        if verb != chosen and not every_verb:
            sub.add_parser(verb, help=summary, add_help=False)
            continue
        try:
            module = importlib.import_module(f"sandbox.cli.{verb}")
        except ModuleNotFoundError as exc:
            if exc.name != f"sandbox.cli.{verb}":
                raise
            sub.add_parser(verb, help=summary + " (not available in this build)")
            continue
        module.register(sub)
        _verbose_everywhere(sub.choices[verb])
    return parser


VERBOSE_HELP = "debug logs and tracebacks on errors"


def _verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """``-v`` before the verb or anywhere after it (``sandbox up P -v``), in every nested
    verb too; SUPPRESS keeps a ``-v`` given before the verb from being reset."""
    import argparse

    if "-v" not in parser._option_string_actions:
        parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                            help=VERBOSE_HELP)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in set(action.choices.values()):
                _verbose_everywhere(nested)


def versions() -> str:
    """This sandbox's version and the versions of what it builds and runs."""
    from sandbox.cache import CONTAINERD_VERSION
    from sandbox.images.node import KIND_VERSION
    from sandbox.runtimes.native.common import K8S_VERSION

    return (f"sandbox {__version__} (Kubernetes v{K8S_VERSION}, kind {KIND_VERSION}, "
            f"containerd v{CONTAINERD_VERSION})")


def _version_action() -> type[argparse.Action]:
    import argparse

    class Version(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                     values: object, option_string: str | None = None) -> None:
            print(versions())
            parser.exit()

    return Version


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command line; ``argv`` None: the process's own (the console script,
    ``python -m sandbox``), whose SIGINT handling this takes over (see above); with an
    ``argv`` (in-process), the caller's SIGINT handler is left alone."""
    program = argv is None
    previous = signal.getsignal(signal.SIGINT)
    if program:
        on_sigint(signal.SIG_DFL)
    try:
        return _main(list(sys.argv[1:] if argv is None else argv), program)
    except KeyboardInterrupt:
        if program:
            on_sigint(signal.SIG_IGN)  # a second Ctrl-C: no traceback while we exit
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if not program and previous is not None:  # a verb (up) may have changed it
            on_sigint(previous)


def on_sigint(handler: Callable[[int, FrameType | None], Any] | int) -> None:
    """Install ``handler`` for SIGINT where Python allows it (the main thread); a verb
    called from another thread leaves the process's handler alone."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)


def _main(argv: list[str], program: bool) -> int:
    import errno
    import logging
    import traceback

    from sandbox.errors import SandboxError

    # gRPC core's own INFO lines ("I1201 ... chttp2_transport ... GOAWAY") are not ours to
    # print; set before any verb imports grpc. An explicit GRPC_VERBOSITY still wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s" if not args.verbose else "%(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if program:
        on_sigint(signal.default_int_handler)
    try:
        code: int = args.func(args)
    except SandboxError as exc:
        if args.verbose:
            traceback.print_exc()
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `sandbox show -o yaml | head`
        sys.stderr.close()
        return 0
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if args.verbose:
            traceback.print_exc()
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""`sandbox mount PROFILE --node NAME ROOT`: serve one node's fake tree live over FUSE.

The server is ``sandbox.agent``'s: in this process, or (``--daemon``) left running as
``python -m sandbox.agent``."""

from __future__ import annotations

import argparse
from pathlib import Path

from sandbox.agent import announce_ready, load_node, resolve_node, serve_node, spawn_node
from sandbox.errors import SandboxError
from sandbox.fakehw.control import control_paths
from sandbox.fakehw.devnodes import STAND_IN, parse_map
from sandbox.outfile import check_target, write_file
from sandbox.profile.bundled import PROFILE_HELP, STDIN


def _dev(text: str) -> tuple[int, int]:
    try:
        return parse_map(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mount",
        help="serve a node's fake /sys, /dev, /proc live over FUSE",
        description="Mount the node's tree at ROOT (ROOT/sys, ROOT/dev, ROOT/proc) and serve "
        "it until unmounted (fusermount3 -u ROOT) or interrupted. Faults change it live through "
        "the control socket (ROOT.sock beside the mount, or STATE_DIR/control.sock); see "
        "`sandbox fault`. A dead mount left by a killed server is recovered first. "
        "With --spec, PROFILE is a resolved spec file (`sandbox show -o spec`, "
        "docs/spec-format.md), served as it is instead of resolving a profile.",
    )
    p.add_argument("profile", metavar="PROFILE",
                   help=f"{PROFILE_HELP} (with --spec: a resolved spec file)")
    p.add_argument("root", metavar="ROOT", help="mount point (created if missing)")
    p.add_argument("--spec", action="store_true",
                   help="PROFILE is a resolved spec: a node, or a cluster with --node")
    p.add_argument("--node", help="node name (or replica name like worker-1); needed with a "
                   "profile and with a spec file of several nodes")
    p.add_argument("--index", type=int, help="replica index when the node has count > 1")
    p.add_argument("--state-dir", type=Path,
                   help="where control.sock and state.json live (default: beside ROOT)")
    p.add_argument("--daemon", action="store_true",
                   help="return once mounted, leaving the server in the background")
    p.add_argument("--pid-file", metavar="FILE",
                   help="with --daemon: write the server's pid here (checked before the "
                   "server starts; a regular file there is replaced, a directory, FIFO, "
                   "device, socket or symbolic link refused)")
    p.add_argument("--log-file", type=Path, help="with --daemon: server log (default: beside ROOT)")
    p.add_argument("--dev-map", type=_dev, nargs="?", const=STAND_IN, metavar="MAJ:MIN",
                   help="with --dev: report every device node of the mount as MAJ:MIN, a "
                   "harmless memory device (default 1:3, /dev/null)")
    p.add_argument("--dev", action="store_true",
                   help="mount with the dev option so mapped device nodes can be opened")
    p.add_argument("--dev-dir", type=Path,
                   help="also create the node's device nodes in this directory, each a "
                   "harmless memory device (null, zero, full, random, urandom as "
                   "themselves, every other one as 1:3), mode <= 0660; removed on exit "
                   "(docs/sysfs-reference.md)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    spec_file = Path(args.profile) if args.spec else None
    profile = None if args.spec else args.profile
    # A spec file is read here: a bad one fails before anything is mounted or started.
    spec = (load_node(spec_file=spec_file, node=args.node, index=args.index)
            if spec_file is not None else None)
    if spec is None and args.node is None:
        raise SandboxError("--node NAME is needed with a profile")
    if args.daemon:
        if profile == STDIN:
            raise SandboxError("mount --daemon cannot read the profile from standard input "
                               "(the server it leaves running reads it again): give a file")
        if profile is not None:  # a wrong node is said here, not by the server's log
            resolve_node(profile, args.node, args.index)
        if args.pid_file is not None:
            check_target(args.pid_file, force=True)  # before a server is left running
        paths = control_paths(root, args.state_dir)  # a socket path too long: say so here
        log_file = args.log_file or root.absolute().parent / f"{root.name}.log"
        extra: list[str] = []
        if args.dev_map is not None:
            extra += ["--dev-map", f"{args.dev_map[0]}:{args.dev_map[1]}"]
        if args.dev:
            extra.append("--dev")
        # the replica name alone names a spec file's node
        node, index = (spec.name, None) if spec is not None else (args.node, args.index)
        pid = spawn_node(profile, node, root, index=index, state_dir=args.state_dir,
                         log_file=log_file, dev_dir=args.dev_dir, extra=extra,
                         spec_file=spec_file).pid
        if args.pid_file is not None:
            write_file(args.pid_file, f"{pid}\n", force=True)
        print(f"mounted {root} (pid {pid}); control socket {paths.socket}; log {log_file}")
        return 0
    if spec is None:
        spec = load_node(profile_path=profile, node=args.node, index=args.index)
    serve_node(spec, root, state_dir=args.state_dir, dev_dir=args.dev_dir,
               dev_map=args.dev_map, allow_dev=args.dev,
               ready=lambda paths: announce_ready(paths, root))
    return 0

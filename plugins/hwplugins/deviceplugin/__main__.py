"""Command line: ``python -m hwplugins.deviceplugin --root DIR --kubelet-dir DIR``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from hwplugins.deviceplugin.config import ConfigError, load_config
from hwplugins.deviceplugin.discovery import discover
from hwplugins.deviceplugin.server import run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hwplugins.deviceplugin",
        description="Reference device plugin: PCI devices under ROOT/sys and ROOT/dev become "
        "extended resources, one gRPC server and socket per resource.",
    )
    p.add_argument(
        "--root",
        type=Path,
        default=Path("/"),
        help="root holding sys/, dev/ and proc/ (default: /)",
    )
    p.add_argument(
        "--kubelet-dir",
        type=Path,
        default=Path("/var/lib/kubelet/device-plugins"),
        help="device-plugins directory with kubelet.sock "
        "(default: /var/lib/kubelet/device-plugins)",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between rescans of the tree (default: 1)",
    )
    p.add_argument(
        "--watch",
        type=Path,
        metavar="SOCKET",
        help="a live tree's control socket: rescan on its change events, and only every "
        "--resync seconds otherwise (every --interval while it is unreachable)",
    )
    p.add_argument(
        "--resync",
        type=float,
        default=30.0,
        help="seconds between full rescans while --watch is followed (default: 30)",
    )
    p.add_argument("--config", type=Path, help="JSON config: rules, ignore, preStartRequired")
    p.add_argument(
        "--resource",
        action="append",
        default=[],
        metavar="NAME",
        help="serve only this resource (repeatable; default: all found)",
    )
    p.add_argument(
        "--pre-start-required",
        action="store_true",
        help="ask the kubelet to call PreStartContainer for every resource",
    )
    p.add_argument(
        "--no-preferred-allocation", action="store_true", help="do not offer GetPreferredAllocation"
    )
    p.add_argument(
        "--socket-prefix",
        default="hwplugins",
        help="socket file names are PREFIX-<resource>.sock (default: hwplugins)",
    )
    p.add_argument(
        "--cdi-dir",
        type=Path,
        metavar="DIR",
        help="keep CDI specs for the CDI names Allocate answers with in DIR (a directory "
        "the container runtime reads, such as /var/run/cdi), so a runtime with CDI "
        "(containerd 2.x) resolves them; removed on exit",
    )
    p.add_argument("--list", action="store_true", help="print the devices found as JSON and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = dataclasses.replace(
        config,
        only=frozenset(args.resource),
        pre_start_required=True if args.pre_start_required else config.pre_start_required,
        preferred_allocation=config.preferred_allocation and not args.no_preferred_allocation,
    )
    if args.list:
        devices = discover(args.root, config.rules, config.ignore)
        json.dump([dataclasses.asdict(d) for d in devices], sys.stdout, indent=2)
        print()
        return 0
    if args.interval <= 0 or args.resync <= 0:
        print("error: --interval and --resync must be positive", file=sys.stderr)
        return 2
    if not args.kubelet_dir.is_dir():
        print(f"error: --kubelet-dir {args.kubelet_dir} is not a directory", file=sys.stderr)
        return 2
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only set flags here: logging from a signal handler can re-enter the stderr
        # writer the main thread is in the middle of ("reentrant call") and kill the stop.
        signals.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logging.getLogger("hwplugins.deviceplugin").info(
        "root %s, kubelet dir %s, rescan every %.2fs%s", args.root, args.kubelet_dir,
        args.interval, f", on change events of {args.watch}" if args.watch else "",
    )
    run(
        args.root,
        args.kubelet_dir,
        config,
        interval=args.interval,
        socket_prefix=args.socket_prefix,
        stop=stop,
        watch=args.watch,
        resync=args.resync,
        cdi_dir=args.cdi_dir,
    )
    if signals:
        logging.getLogger("hwplugins.deviceplugin").info("signal %d: stopped", signals[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
